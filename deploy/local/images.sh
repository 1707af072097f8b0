#!/usr/bin/env bash
# The images the pod test and the local cluster run, built with kvxfer's own Docker daemon
# (deploy/local/docker.sh) from the registries only:
#
#   kvxfer-base:bookworm   Debian 12 (debootstrap --variant=minbase from Debian's mirror, docker import)
#   kvxfer:local           the sidecar (Dockerfile.ucx, default target: UCX from the pinned wheel)
#   kvxfer-engine:local    the simulated engine behind vLLM's command line (target sim-vllm)
#   kvxfer-router:local    vllm-router from PyPI (deploy/local/router.Dockerfile)
#   kvxfer-pause:local     the pod sandbox: a static pause program FROM scratch (deploy/local/pause/)
#
#   deploy/local/images.sh [NAME...]   build them (all by default); Docker's layer cache makes an
#                                      unchanged tree cost seconds
#   deploy/local/images.sh --print     print the image names and exit
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/local/versions.sh
eval "$(bash deploy/local/docker.sh env)"
export DOCKER_HOST

BASE=kvxfer-base:bookworm
ALL=(base kvxfer engine router pause)
fail() { echo "kvxfer images: $*" >&2; exit 1; }
if [ "${1:-}" = "--print" ]; then echo "$BASE kvxfer:local kvxfer-engine:local kvxfer-router:local kvxfer-pause:local"; exit 0; fi
want=("$@")
[ ${#want[@]} -gt 0 ] || want=("${ALL[@]}")

bash deploy/local/docker.sh start
# The machine's CA bundle, for the build steps that download over HTTPS (an egress proxy's CA
# where there is one); the images keep their own.
CA_BUNDLE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
secret=()
[ -f "$CA_BUNDLE" ] && secret=(--secret "id=ca,src=$CA_BUNDLE")
build() { # build NAME ARGS...: BuildKit, host network (the daemon has no NAT of its own)
  local name=$1; shift
  local t0; t0=$(date +%s)
  local try
  for try in 1 2; do
    DOCKER_BUILDKIT=1 "$DOCKER" build --network host --progress plain "${secret[@]}" "$@" >".tools/image-$name.log" 2>&1 \
      && break
    # A toolchain that crashed is tried once more (2026-12-06: tsc died of SIGSEGV in the kvxfer
    # image's build step once in a fresh clone's CI run; the same build passed at once after);
    # any other failure, or a second crash, is final.
    if [ "$try" = 1 ] && grep -q "exit code: 139" ".tools/image-$name.log"; then
      cp ".tools/image-$name.log" ".tools/image-$name.crashed.log"
      echo "kvxfer images: building $name crashed (SIGSEGV, log: .tools/image-$name.crashed.log); trying once more" >&2
      continue
    fi
    tail -30 ".tools/image-$name.log" >&2
    fail "building $name failed (log: .tools/image-$name.log)"
  done
  echo "kvxfer images: $name ($(( $(date +%s) - t0 )) s)"
}

base() {
  if "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null || fail "no debootstrap: apt-get install debootstrap (deploy/local/setup.sh does)"
  local t0 root; t0=$(date +%s)
  root=$(mktemp -d /var/tmp/kvxfer-rootfs.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" http://deb.debian.org/debian \
    >.tools/image-base.log 2>&1 || { tail -20 .tools/image-base.log >&2; fail "debootstrap failed (log: .tools/image-base.log)"; }
  # The same suites as a Debian 12 machine: bookworm, its updates and its security fixes.
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # What an image never needs: apt's lists and downloads, logs, documentation.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/var/log/* "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
  tar -C "$root" --numeric-owner -c . | "$DOCKER" import --change 'CMD ["/bin/bash"]' \
    --change 'ENV LANG=C.UTF-8' - "$BASE" >/dev/null
  echo "kvxfer images: base $BASE ($(( $(date +%s) - t0 )) s, debootstrap)"
}

for w in "${want[@]}"; do
  case $w in
    base) base ;;
    kvxfer) base; build kvxfer -f Dockerfile.ucx --build-arg "BASE_IMAGE=$BASE" -t kvxfer:local . ;;
    engine) base; build engine -f Dockerfile.ucx --build-arg "BASE_IMAGE=$BASE" --target sim-vllm -t kvxfer-engine:local . ;;
    router) base; build router -f deploy/local/router.Dockerfile --build-arg "BASE_IMAGE=$BASE" -t kvxfer-router:local deploy/local ;;
    pause) base; build pause -f deploy/local/pause/Dockerfile --build-arg "BASE_IMAGE=$BASE" -t kvxfer-pause:local deploy/local/pause ;;
    *) fail "unknown image '$w' (one of ${ALL[*]})" ;;
  esac
done
