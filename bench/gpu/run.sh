#!/usr/bin/env bash
# kvxfer's GPU device check, on the GPU machine (CUDA driver, Python 3.12 with torch; no Node, no
# UCX, no internet). Needs bench/gpu/carry/ from bench/gpu/prepare.sh (name it in the run's
# carry). Writes results.json, results.md and log.txt into $OUT (or ./gpu-results). Ends within
# 8 minutes: the harness gets 450 s.
#
#   bash bench/gpu/run.sh              # parts a, b, c, c-sidecars
#   PARTS=a bash bench/gpu/run.sh      # one part
#   DRY_RUN=1 PYTHON=.venv/bin/python OUT=/tmp/x bash bench/gpu/run.sh   # this script, here: host memory
#   UCX_TLS=^cma bash bench/gpu/run.sh # UCX's own variables reach every agent and sidecar
set -uo pipefail
cd "$(dirname "$0")/../.."
C=$PWD/bench/gpu/carry
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
[ -f "$C/node.xz" ] || { echo "run.sh: $C/node.xz is missing: run bench/gpu/prepare.sh here and carry bench/gpu/carry" | tee "$OUT/log.txt"; exit 1; }
# shellcheck source=bench/gpu/runtime.sh
. bench/gpu/runtime.sh
PY=${PYTHON:-python3}
kvxfer_runtime "$C" /tmp/kvxfer-rt "$PY" >"$OUT/log.txt" 2>&1
rt=$?
cat "$OUT/log.txt"
[ "$rt" = 0 ] || exit 1
NODE=/tmp/kvxfer-rt/bin/node
export PYTHONUNBUFFERED=1
{
  echo "== $(date -u) $(uname -r)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$NODE" -e 'console.log("node", process.version)'
  echo "UCX's cuda module needs: $(ldd "$C/ucx/lib/ucx/libuct_cuda.so.0" | grep -E 'libcuda|libnvidia-ml|not found' | tr -s ' \t' ' ' | tr '\n' ';')"
  KVXFER_NATIVE="$C/dist/src/native/index.js" "$NODE" --input-type=module -e '
    const { ucxInfo } = await import(process.env.KVXFER_NATIVE);
    const u = ucxInfo(); console.log("UCX", u.version, "memory types:", u.memoryTypes.join(","), "transports:", u.transports.join(" "));'
  timeout 450 "$PY" bench/gpu/harness.py ${DRY_RUN:+--dry-run} --node "$NODE" --carry "$C" --out "$OUT" \
    --parts "${PARTS:-a,b,c,c-sidecars}"
  rc=$?
  echo "== harness exit $rc"
  echo "$rc" >/tmp/kvxfer-gpu-rc
} 2>&1 | tee -a "$OUT/log.txt"
exit "$(cat /tmp/kvxfer-gpu-rc 2>/dev/null || echo 1)"
