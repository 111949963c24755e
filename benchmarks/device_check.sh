#!/usr/bin/env bash
# The GPU check, for the machine `device` lends (one H200, Python 3.12 with torch 2.11; no network): run from
# the repository root, with megatron-core's wheel carried in .whl/ (see docs/megatron.md, "GPU checks").
#   run(command="bash benchmarks/device_check.sh", carry=[".whl"], timeout_s=330)
# One line per section ("SECTION name: ..."), each with a time budget (device_check.py's SECTIONS); a section
# that no longer fits the time left is skipped and reported. QURL_DEVICE_BUDGET_S (default 240 s) bounds the
# sections: with the setup the run stays under 5 minutes, leaving a 15-minute slot room for a rerun.
# `bash benchmarks/device_check.sh --dry-run` (any machine) prints which sections the budget would run;
# QURL_DEVICE_SECTIONS=a,b runs only those sections (a rerun of the ones that failed; rollout-fp4: the FP4 MoE
# kernels against BF16 fused MoE alone).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" QURL_CACHE_DIR=/tmp/qurl-cache
if [[ "${1:-}" == "--dry-run" ]]; then
  exec python3 benchmarks/device_check.py --dry-run --budget-s "${QURL_DEVICE_BUDGET_S:-240}" \
    --only "${QURL_DEVICE_SECTIONS:-}"
fi
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "SECTION setup: FAIL (wheels)"; exit 1; }
  export PYTHONPATH="$PWD:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/SECTION gpu: /'
python3 -c 'import torch, megatron.core; print(f"SECTION setup: torch {torch.__version__}, megatron-core {megatron.core.__version__}")' \
  || { echo "SECTION setup: FAIL (imports)"; exit 1; }
python3 benchmarks/device_check.py --budget-s "${QURL_DEVICE_BUDGET_S:-240}" --only "${QURL_DEVICE_SECTIONS:-}"
