#!/usr/bin/env bash
# kvxfer's GPU device check, on the GPU machine (CUDA driver, Python 3.12 with torch; no Node, no
# UCX, no internet). Needs bench/gpu/carry/ from bench/gpu/prepare.sh (name it in the run's
# carry). Writes results.json, results.md and log.txt into $OUT (or ./gpu-results). Ends within
# 8 minutes: the harness gets 450 s.
#
#   bash bench/gpu/run.sh              # parts a, b, c
#   PARTS=a bash bench/gpu/run.sh      # one part
set -uo pipefail
cd "$(dirname "$0")/../.."
C=$PWD/bench/gpu/carry
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
[ -f "$C/node.xz" ] || { echo "run.sh: $C/node.xz is missing: run bench/gpu/prepare.sh here and carry bench/gpu/carry" | tee "$OUT/log.txt"; exit 1; }
NODE=/tmp/kvxfer-node
xz -dc "$C/node.xz" >"$NODE" && chmod +x "$NODE"
export LD_LIBRARY_PATH="$C/ucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$C/py${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "== $(date -u) $(uname -r)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$NODE" -e 'console.log("node", process.version)'
  KVXFER_NATIVE="$C/dist/src/native/index.js" "$NODE" --input-type=module -e '
    const { ucxInfo } = await import(process.env.KVXFER_NATIVE);
    const u = ucxInfo(); console.log("UCX", u.version, "memory types:", u.memoryTypes.join(","), "transports:", u.transports.join(" "));'
  timeout 450 python3 bench/gpu/harness.py --node "$NODE" --carry "$C" --out "$OUT" --parts "${PARTS:-a,b,c}"
  rc=$?
  echo "== harness exit $rc"
  echo "$rc" >/tmp/kvxfer-gpu-rc
} 2>&1 | tee "$OUT/log.txt"
exit "$(cat /tmp/kvxfer-gpu-rc 2>/dev/null || echo 1)"
