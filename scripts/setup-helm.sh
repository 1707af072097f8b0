#!/usr/bin/env bash
# helm, for the Helm chart's tests (deploy/tests: `helm lint` and `helm template`), built from its
# source through the Go module proxy into .tools/bin (ignored by git) once; an unchanged version is
# not built again. Go: scripts/setup-go.sh (the machine's when it is 1.21 or newer, else a
# toolchain from the Go module proxy into .tools/go).
#
#   scripts/setup-helm.sh      install (idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v3.22.0
TOOLS=$PWD/.tools
stamp=$TOOLS/bin/.helm-version

fail() { echo "kvxfer setup (helm): $*" >&2; exit 1; }

if [ -x "$TOOLS/bin/helm" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$HELM_VERSION" ]; then
  echo "kvxfer setup (helm): .tools/bin/helm $HELM_VERSION is up to date"
  exit 0
fi

GO=$(bash scripts/setup-go.sh) || fail "no Go to build helm with"

echo "kvxfer setup (helm): building helm $HELM_VERSION with $("$GO" version) (first time: a few minutes)"
mkdir -p "$TOOLS/bin"
log=$TOOLS/helm-build.log
if ! GOBIN=$TOOLS/bin GOTOOLCHAIN=auto GOFLAGS=-mod=mod CGO_ENABLED=0 \
  "$GO" install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >"$log" 2>&1; then
  tail -20 "$log" >&2
  fail "go install helm.sh/helm/v3/cmd/helm@$HELM_VERSION failed (full log: $log)"
fi
"$TOOLS/bin/helm" version >/dev/null || fail ".tools/bin/helm does not run"
echo "$HELM_VERSION" >"$stamp"
echo "kvxfer setup (helm): .tools/bin/helm $HELM_VERSION ready"
