#!/usr/bin/env bash
# Builds the local cluster's Kubernetes programs from the Go module proxy into .tools/ (ignored by
# git), once per pinned version: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# kube-proxy and kubectl of Kubernetes $K8S_VERSION, and CoreDNS $COREDNS_VERSION (the cluster's
# DNS: the chart's pods reach each other by their StatefulSet names). An unchanged pin builds
# nothing. The first build takes 6-15 min on 2 cores (docs/deploy.md).
#
# k8s.io/kubernetes is not meant to be required as a module: its go.mod requires each of its
# k8s.io/* staging modules at v0.0.0 and replaces them with folders of its own tree. A wrapper
# module here requires k8s.io/kubernetes $K8S_VERSION and replaces every one of those with the
# published staging module of the same release (v0.MINOR.PATCH), read from that go.mod itself.
#
#   deploy/local/build.sh          build what is missing (idempotent)
#   deploy/local/build.sh --print  print the folder of the programs and exit
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh

ROOT=$PWD
BIN=$K8S_BIN
stamp=$BIN/.kvxfer-build
want="kubernetes $K8S_VERSION coredns $COREDNS_VERSION"
fail() { echo "kvxfer cluster (build): $*" >&2; exit 1; }

if [ "${1:-}" = "--print" ]; then echo "$ROOT/$BIN"; exit 0; fi
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "kvxfer cluster (build): $BIN ($want) is up to date"
  exit 0
fi

GO=$(bash scripts/setup-go.sh)
echo "kvxfer cluster (build): building $want with $("$GO" version) into $BIN (first time: 6-15 min on 2 cores)"
start=$(date +%s)
work=$ROOT/.tools/k8s-build
mkdir -p "$work/k8s" "$work/coredns" "$BIN"
log=$ROOT/.tools/k8s-build.log
: >"$log"
# Module downloads and the build cache live under .tools too, so that a fresh checkout builds
# from nothing but the proxy, and removing .tools removes everything this made.
export GOMODCACHE=$work/gomod GOCACHE=$work/gocache GOTOOLCHAIN=auto GOFLAGS=-mod=mod CGO_ENABLED=0
export GOPROXY=${GOPROXY:-https://proxy.golang.org,direct}

staging=${K8S_VERSION/#v1./v0.}
(
  cd "$work/k8s"
  rm -f go.mod go.sum
  "$GO" mod init kvxfer.local/k8s >>"$log" 2>&1
  "$GO" mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
  "$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" >kubernetes.json 2>>"$log" \
    || fail "could not download k8s.io/kubernetes@$K8S_VERSION (log: $log)"
  mod=$(sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p' kubernetes.json)
  [ -f "$mod" ] || fail "no go.mod for k8s.io/kubernetes@$K8S_VERSION in the module cache"
  # Every k8s.io/* module that go.mod replaces with a folder of its own tree ("=> ./staging/...").
  mods=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$mod" | sort -u)
  required=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) v0.0.0$#\1#p' "$mod" | sort -u)
  # One `go mod edit` for all of them, then a check that go.mod has each: a fresh clone's CI run
  # once built with one of the 29 missing (k8s.io/controller-manager, one edit per module then),
  # and the build failed on the proxy's "v0.0.0 not available" far from the cause.
  declare -A staged=()
  for m in $mods; do staged[$m]=1; done
  edits=()
  for m in $required; do
    if [ -n "${staged[$m]:-}" ]; then edits+=("-replace=$m=$m@$staging"); fi
  done
  [ ${#edits[@]} -gt 0 ] || fail "no staging module found in $mod"
  missing=("${edits[@]}")
  for try in 1 2; do
    "$GO" mod edit "${missing[@]}"
    missing=()
    for e in "${edits[@]}"; do
      m=${e#-replace=}; m=${m%%=*}
      grep -Eq "^(replace)?[[:space:]]*$m => $m $staging[[:space:]]*\$" go.mod || missing+=("$e")
    done
    [ ${#missing[@]} -eq 0 ] && break
    echo "kvxfer cluster (build): go.mod lacks the replace of ${missing[*]#-replace=} after go mod edit (try $try)" >&2
  done
  [ ${#missing[@]} -eq 0 ] || fail "go.mod lacks the replace of ${missing[*]#-replace=} ($work/k8s/go.mod)"
  n=${#edits[@]}
  echo "kvxfer cluster (build): k8s.io/kubernetes $K8S_VERSION with $n staging modules at $staging"
  # The version the programs report (kubectl version, the node's kubeletVersion).
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
    t0=$(date +%s)
    "$GO" build -trimpath -ldflags "$ldflags" -o "$ROOT/$BIN/$cmd" "k8s.io/kubernetes/cmd/$cmd" >>"$log" 2>&1 \
      || { tail -20 "$log" >&2; fail "go build k8s.io/kubernetes/cmd/$cmd failed (log: $log)"; }
    echo "kvxfer cluster (build): $cmd ($(( $(date +%s) - t0 )) s)"
  done
)
(
  # CoreDNS with only the plugins the cluster's Corefile uses (up.sh: bind, errors, cache,
  # kubernetes), the way CoreDNS documents building it from outside its tree: a main package
  # that imports those plugins, sets the directive order (plugin.cfg's order) and calls
  # coremain.Run. `go install` of the whole program compiles every plugin it ships (the cloud
  # DNS providers' SDKs among them): 281 s of the first build here, against 88 s slim (fresh module cache).
  cd "$work/coredns"
  t0=$(date +%s)
  rm -f go.mod go.sum
  "$GO" mod init kvxfer.local/coredns >>"$log" 2>&1
  "$GO" mod edit -require="github.com/coredns/coredns@$COREDNS_VERSION"
  cat >main.go <<'GO'
// The local cluster's DNS: CoreDNS with the plugins its Corefile names (deploy/local/up.sh).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func init() {
	// In CoreDNS's own plugin.cfg order: the order a query goes through them.
	dnsserver.Directives = []string{"bind", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
  "$GO" build -trimpath -ldflags "-s -w" -o "$ROOT/$BIN/coredns" . >>"$log" 2>&1 \
    || { tail -20 "$log" >&2; fail "go build of CoreDNS $COREDNS_VERSION failed (log: $log)"; }
  "$ROOT/$BIN/coredns" -plugins | grep -qw kubernetes \
    || fail "the CoreDNS built has no kubernetes plugin"
  echo "kvxfer cluster (build): coredns ($(( $(date +%s) - t0 )) s)"
)
reported=$("$BIN/kubectl" version --client 2>/dev/null || true)
case $reported in *"$K8S_VERSION"*) ;; *) fail "$BIN/kubectl does not report $K8S_VERSION: $reported" ;; esac
echo "$want" >"$stamp"
# The build cache is only needed to build again; the module downloads stay (a rebuild after a
# version change reuses most of them).
rm -rf "$GOCACHE"
echo "kvxfer cluster (build): $want ready in $BIN ($(( $(date +%s) - start )) s)"
