#!/bin/bash
# Ground truth on a lent GPU machine, in one call: the expert GEMM sweep, then real against
# predicted iteration time and peak memory for today's layer kinds (benchmarks/device/h100_validation.py).
#
#   bash benchmarks/device/ground_truth.sh OUT_DIR [PLANS [ITERATIONS]]
#
# Expects megatron-core's wheel in .whl/ (see h100_validation.py's docstring) and python3 with torch,
# pandas, PyYAML, scipy, matplotlib and tqdm, as the lent machine's image has. Everything it writes
# goes to OUT_DIR: run.log, grouped_gemm.csv, validation.csv, profiles.json. Each plan runs in its
# own process with a time limit, and rows are written as they finish, so a call stopped at its
# limit keeps what it measured.
set -u
out=${1:?usage: ground_truth.sh OUT_DIR [PLANS [ITERATIONS]]}
plans=${2:-qwen3-0.6b_mb1_none,mla-0.5b_mb1_none,ci-gpt-126m_mb4_none,llama3.2-1b_mb1_selective,qwen3-0.6b_mb2_full}
iterations=${3:-5}
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
start=$(date +%s)
[ -n "${SKIP_GEMMS:-}" ] || timeout 90 python3 -m benchmarks.device.grouped_gemm_sweep --out "$out/grouped_gemm.csv"
echo "grouped GEMM sweep: $(( $(date +%s) - start )) s"
timeout ${VALIDATION_TIMEOUT:-480} python3 -m benchmarks.device.h100_validation --plans "$plans" --iterations "$iterations" --plan-timeout 110 \
    --db /tmp/profiles.sqlite --out "$out/validation.csv" --export "$out/profiles.json"
echo "all: $(( $(date +%s) - start )) s"
