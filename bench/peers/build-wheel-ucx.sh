#!/usr/bin/env bash
# Builds kvxfer's addon a second time, against the UCX of the libucx-cu12 wheel in the project
# venv (.venv), into build/native-wheel-ucx/. `kvxfer bench peers` then runs it as
# "kvxfer (wheel UCX)" next to the default build on Debian's UCX, so a difference that comes
# from UCX's version shows up as one. Install the wheel first: kvxfer bench peers --install.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${root}/.venv/bin/python"
[[ -x "${python}" ]] || { echo "no ${python}: run 'kvxfer bench peers --install' first" >&2; exit 1; }
prefix="$("${python}" -c 'import libucx, os; print(os.path.dirname(libucx.__file__))' 2>/dev/null)" || {
  echo "libucx-cu12 is not installed in .venv: run 'kvxfer bench peers --install' first" >&2
  exit 1
}
cd "${root}"
npx cmake-js compile --directory native --out build/native-wheel-ucx --CDKVXFER_UCX_PREFIX="${prefix}"
echo "built build/native-wheel-ucx/Release/kvxfer.node against UCX in ${prefix}"
