#!/usr/bin/env bash
# Stages what the GPU device check (bench/gpu/run.sh) needs on a machine with CUDA, Python and
# torch but no Node, no UCX and no internet, into bench/gpu/carry/ (ignored by git; name it in
# the device run's `carry`). Run here, after `npm run build`:
#
#   bash bench/gpu/prepare.sh            # stages, prints the size, fails above 60 MiB
#   bash bench/gpu/prepare.sh --check    # and then proves the staging: the carried node runs
#                                        # after decompression, and the harness's dry run (host
#                                        # memory, no CUDA) passes with only carried files
#
# carry/ holds: node.xz (this host's Node 20, stripped, xz -9), package.json + native/ (so the
# addon's loader finds its root), build/native/Release/kvxfer.node (the prebuilt addon; it finds
# UCX through LD_LIBRARY_PATH there), dist/src/native/*.js + dist/src/errors.js (the only
# JavaScript the harness imports), ucx/lib/ (UCX 1.22.0 from the pinned libucx-cu12 wheel: libucp,
# libucs, libuct, libucm and the modules cma, cuda (cuda_copy, cuda_ipc) and ucm_cuda, with the
# CUDA 12 runtime libucm_cuda needs, stripped; CUDA 12's runtime runs on driver 580, CUDA 13's),
# py/ (the protobuf runtime the connector's generated messages need, for part c).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
C=bench/gpu/carry
LIMIT=$((60 << 20))
UCX=.ucx/libucx/lib

# The project's Python (its .venv, or $PYTHON): the protobuf runtime the connector's generated code
# needs is carried from it, and the dry run (--check) needs its torch (CPU is enough).
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

for need in build/native/Release/kvxfer.node dist/src/native/index.js dist/src/errors.js "$UCX/libucp.so.0"; do
  [ -e "$need" ] || { echo "prepare: $need is missing: run scripts/setup-ucx.sh and npm run build first" >&2; exit 1; }
done
NODE=$(command -v node)
case "$(node -p process.versions.node)" in
  20.*) ;;
  *) echo "prepare: node $(node -p process.versions.node) at $NODE; the device check carries Node 20" >&2; exit 1 ;;
esac

rm -rf "$C"
mkdir -p "$C/native" "$C/build/native/Release" "$C/dist/src/native" "$C/ucx/lib/ucx"
printf '{ "name": "kvxfer-gpu-carry", "private": true, "type": "module" }\n' >"$C/package.json"
cp build/native/Release/kvxfer.node "$C/build/native/Release/"
strip --strip-unneeded "$C/build/native/Release/kvxfer.node"
cp dist/src/native/*.js "$C/dist/src/native/"
cp dist/src/errors.js "$C/dist/src/"

# UCX: the sonames the addon and the modules load, as plain files (no links travel).
for lib in libucp.so.0 libucs.so.0 libuct.so.0 libucm.so.0; do
  cp -L "$UCX/$lib" "$C/ucx/lib/$lib"
done
for mod in libuct_cma.so.0 libuct_cuda.so.0 libucm_cuda.so.0; do
  cp -L "$UCX/ucx/$mod" "$C/ucx/lib/ucx/$mod"
done
cp -L .ucx/libucx_cu12.libs/libcudart-*.so.* "$C/ucx/lib/"
strip --strip-unneeded "$C"/ucx/lib/*.so* "$C"/ucx/lib/ucx/*.so*

# protobuf for Python (pure Python plus an abi3 extension, so it loads on the device's 3.12): the
# connector's generated messages need the runtime they were generated for (part c imports them).
pb=$("$PY" -c 'import google.protobuf as p, os; print(os.path.dirname(p.__file__))') || {
  echo "prepare: $PY has no google.protobuf (set PYTHON to the project's .venv python)" >&2; exit 1; }
mkdir -p "$C/py/google"
cp -r "$pb" "$C/py/google/protobuf"
[ -d "$(dirname "$pb")/_upb" ] && cp -r "$(dirname "$pb")/_upb" "$C/py/google/_upb"
find "$C/py" -name __pycache__ -prune -exec rm -rf {} +

# The sidecar's CLI, bundled into one file (rolldown) for part (c)'s real sidecars, with the
# node_modules a bundle cannot hold: zeromq's JavaScript and its one prebuilt addon that loads on
# glibc >= 2.25 (linux-x64 glibc-127-Release) and cmake-ts's loader for it. The simulator's and the
# benchmarks' packages are not in the bundle (the CLI loads them by a name it computes). Packed with xz.
sc=$(mktemp -d)
trap 'rm -rf "$sc"' EXIT
node_modules/.bin/rolldown dist/src/cli/main.js --dir "$sc/cli" --format esm --platform node --external zeromq \
  --external zeromq/draft --no-code-splitting >/dev/null
mkdir -p "$sc/node_modules/zeromq/build/linux/x64/node" "$sc/node_modules/cmake-ts/build"
cp node_modules/zeromq/package.json "$sc/node_modules/zeromq/"
cp -r node_modules/zeromq/lib "$sc/node_modules/zeromq/"
find "$sc/node_modules/zeromq/lib" \( -name '*.map' -o -name '*.ts' \) -delete
cp node_modules/zeromq/build/manifest.json "$sc/node_modules/zeromq/build/"
cp -r node_modules/zeromq/build/linux/x64/node/glibc-127-Release "$sc/node_modules/zeromq/build/linux/x64/node/"
cp node_modules/cmake-ts/package.json "$sc/node_modules/cmake-ts/"
cp node_modules/cmake-ts/build/loader.js "$sc/node_modules/cmake-ts/build/"
tar -cJf "$C/sidecar.tar.xz" -C "$sc" cli node_modules

# pyzmq for the GPU machine's Python 3.12 (the engine link of part c's workers): one abi3 wheel,
# the version the connector pins, fetched with pip (DEVELOPERS' way to carry a package). Without
# network the check still runs, without real sidecars in part (c).
pyzmq=$(grep '^pyzmq==' connectors/vllm/requirements-lock.txt | cut -d= -f3)
mkdir -p "$C/whl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$C/whl" "pyzmq==$pyzmq" || echo "prepare: no pyzmq $pyzmq wheel (offline?): part (c) will run without sidecars" >&2

# Node: stripped of its symbol table (the dynamic symbols addons link against stay), then xz.
tmp=$(mktemp)
trap 'rm -f "$tmp"; rm -rf "$sc"' EXIT
cp "$NODE" "$tmp"
strip "$tmp"
xz -9 -T2 -c "$tmp" >"$C/node.xz"
sha256sum "$tmp" | cut -d' ' -f1 >"$C/node.sha256"

size=$(du -sb "$C" | cut -f1)
tracked=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
awk -v c="$C" -v s="$size" -v n="$(stat -c %s "$C/node.xz")" -v u="$(du -sb "$C/ucx" | cut -f1)" -v t="$tracked" \
  'BEGIN { m = 1048576; printf "prepare: staged %s: %.1f MiB (node.xz %.1f MiB, ucx %.1f MiB); working tree %.1f MiB; together %.1f MiB of 64\n", c, s / m, n / m, u / m, t / m, (s + t) / m }'
if [ "$size" -gt "$LIMIT" ]; then
  echo "prepare: $C is over 60 MiB" >&2
  exit 1
fi

if [ "${1:-}" = "--check" ]; then
  # The carried node, decompressed, runs; the harness's dry run uses only carried files (the
  # runtime run.sh makes on the device), real sidecars from the bundled CLI included.
  out=$(mktemp -d)
  # shellcheck source=bench/gpu/runtime.sh
  . bench/gpu/runtime.sh
  (
    unset KVXFER_ADDON
    kvxfer_runtime "$ROOT/$C" "$out/rt" "$PY" || exit 1
    node -e 'console.log("prepare: carried node " + process.version + " runs")'
    node "$KVXFER_CLI" sidecar --help >/dev/null && echo "prepare: the bundled sidecar CLI runs"
    "$PY" bench/gpu/harness.py --dry-run --node "$out/rt/bin/node" --carry "$ROOT/$C" --out "$out/results"
  )
  echo "prepare: dry run wrote $(ls "$out/results" | tr '\n' ' ')"
  rm -rf "$out"
fi
