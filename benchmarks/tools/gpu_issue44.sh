#!/usr/bin/env bash
# Issue 44's GPU check as one command, for a lent GPU machine without network (nine minutes or less of work):
#
#   bash benchmarks/tools/gpu_issue44.sh            # from the repository root; figures printed, results under $OUT
#
# It installs the wheels carried in benchmarks/.wheels (downloaded beforehand where there is network with
# `bash benchmarks/tools/gpu_wheels.sh`; carry that folder), checks the CUDA paths (gpu_check.py, 60 s at most), then
# runs gpu_side_by_side.py on issue 32's work (362M policy, 135M critic and reward, batch 64 x 128 new tokens,
# 4 epochs x 4 minibatches, 6 iterations: TRL 1.12, lmppo critic, lmppo shared value head) and, within what is left
# of BUDGET seconds (default 440 for the side by side; about 520 s in all), TRL and lmppo with the 1.7B policy.
# Printed: episodes/s and their ratio to TRL's, GPU peak against TRL's, the update phase, decoding ms/step, the
# first iteration's compile time.
# `TINY=1` runs the same on tiny shapes (the CPU when there is no GPU), to test this script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/gpu_issue44}"
mkdir -p "$OUT"
if [ -z "${TINY:-}" ]; then
  eval "$(bash benchmarks/tools/gpu_wheels.sh install)"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT/src"
PY="${PYTHON:-python3}"
if [ -z "${TINY:-}" ]; then
  timeout 60 "$PY" benchmarks/speed/gpu_check.py 2>&1 | tail -n 20 | tee "$OUT/gpu_check.txt" || echo "gpu_check: failed or timed out (see above); the side by side runs anyway"
  SIDES="trl,critic,shared"
else
  SIDES="${TINY_SIDES:-critic,shared}"  # a CPU without TRL installed: lmppo's sides only
fi
"$PY" benchmarks/speed/gpu_side_by_side.py --sides "$SIDES" --then-1.7b --budget "${BUDGET:-440}" --work "$OUT/work" \
  ${TINY:+--tiny} "$@" 2>&1 | tee "$OUT/side_by_side.txt"
cp "$OUT"/work/results.json "$OUT/results-360m.json" 2>/dev/null || true
cp "$OUT"/work/1.7b/results.json "$OUT/results-1.7b.json" 2>/dev/null || true
