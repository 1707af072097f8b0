#!/usr/bin/env bash
# helm, for the Helm chart's tests (deploy/tests: `helm lint` and `helm template`), built from its
# source through the Go module proxy into .tools/bin (ignored by git) once; an unchanged version is
# not built again. Go: the machine's when it is 1.21 or newer (it fetches the toolchain helm asks
# for itself), else a toolchain from the Go module proxy into .tools/go.
#
#   scripts/setup-helm.sh      install (idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION=v3.22.0
GO_FALLBACK=1.26.8 # the toolchain fetched when the machine has no usable Go
TOOLS=$PWD/.tools
stamp=$TOOLS/bin/.helm-version

fail() { echo "kvxfer setup (helm): $*" >&2; exit 1; }

if [ -x "$TOOLS/bin/helm" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$HELM_VERSION" ]; then
  echo "kvxfer setup (helm): .tools/bin/helm $HELM_VERSION is up to date"
  exit 0
fi

go_ok() { # a go that can fetch newer toolchains itself (1.21+)
  "$1" version 2>/dev/null | grep -qE 'go1\.(2[1-9]|[3-9][0-9])'
}
GO=""
if command -v go >/dev/null 2>&1 && go_ok go; then
  GO=$(command -v go)
elif [ -x "$TOOLS/go/bin/go" ] && go_ok "$TOOLS/go/bin/go"; then
  GO=$TOOLS/go/bin/go
else
  echo "kvxfer setup (helm): no Go 1.21+ here; fetching go$GO_FALLBACK from the Go module proxy"
  python3 - "$TOOLS" "$GO_FALLBACK" <<'PY' || fail "could not fetch a Go toolchain from proxy.golang.org"
import io, os, shutil, stat, sys, urllib.request, zipfile
tools, version = sys.argv[1], sys.argv[2]
url = f"https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go{version}.linux-amd64.zip"
with urllib.request.urlopen(url, timeout=300) as r:
    data = r.read()
prefix = f"golang.org/toolchain@v0.0.1-go{version}.linux-amd64/"
dest = os.path.join(tools, "go")
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(io.BytesIO(data)) as z:
    for info in z.infolist():
        if not info.filename.startswith(prefix) or info.is_dir():
            continue
        path = os.path.join(dest, info.filename[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(info) as src, open(path, "wb") as out:
            shutil.copyfileobj(src, out)
        mode = info.external_attr >> 16
        if mode & 0o111:
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
PY
  GO=$TOOLS/go/bin/go
fi

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
