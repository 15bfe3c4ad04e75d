#!/usr/bin/env bash
# =====================================================================================
#  scripts/gpu_check.sh -- the GPU checks of issue 13, part 4, as ONE script.
#
#  STATUS: WRITTEN, NEVER RUN. Nothing below has executed on a GPU or against a real
#  vLLM install; the vLLM snippet follows vLLM's RLHF examples (worker extension class
#  + LLM.collective_rpc) from its documentation and may need fixing on first contact.
#
#  What it does, each step under its own `timeout` (seconds, overridable by env):
#    1. install       pip install -e .[test]                                  T_INSTALL
#    2. cuda_tests    the suite's CUDA tests (pytest -m cuda if that marker is
#                     registered, else -k cuda; e.g. test_fused_bitwise_cuda)   T_TESTS
#    3. bench_memory  logra bench memory --device cuda (default ~330M shape)    T_BENCH
#    4. bench_memory_ckpt   the same with --checkpointing                      T_BENCH
#       bench_tokens_N      2k/8k/16k tokens per step, checkpointing, bf16, with
#                           and without shared projections                    T_BENCH
#    5. vllm_install  pip install vllm (may replace torch: runs last)         T_VLLM_INSTALL
#    6. vllm_deltas   a tiny local Qwen2 inside vLLM receiving 20 LoGRA deltas
#                     through collective_rpc: per-update checksum verification
#                     against a bf16 HF rollout copy, a refused gap and stale
#                     update, a verified resync, vLLM's own full reload checked
#                     against logra's layout, mismatch KL (vLLM log-probs vs the
#                     fp32 trainer) and sync time delta vs full reload.         T_VLLM
#  A failing step does not stop the later ones. Logs and a summary go to $OUT (the
#  device tool's output folder) or ./gpu_check_out.
#
#  Usage:  bash scripts/gpu_check.sh            (from anywhere; cds to the repo root)
#  Env:    PYTHON (default python3), SKIP="vllm_install vllm_deltas" to skip steps,
#          VLLM_TP (default 1), VLLM_STRATEGY (full|slice, default full).
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

# ---------------------------------------------------------------- 5-6. vLLM
step vllm_install "$T_VLLM_INSTALL" "$PY" -m pip install -q vllm
"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 \
    | tee -a "$OUT_DIR/vllm_install.log"

CHECK_DIR=$(mktemp -d)
# The worker extension must be importable by vLLM's worker processes: its own module.
cat > "$CHECK_DIR/logra_vllm_ext.py" <<'PYEOF'
"""vLLM worker extension: the rollout side of LoGRA delta sync (one instance per TP rank)."""
import time

import torch

from logra import LoGRAConfig, PolicyDelta
from logra.errors import DeltaMismatchError
from logra.parallel import decode_full_weights
from logra.parallel.vllm import FusedLayout, FusedReceiver, LayoutError


class LoGRAWorkerExtension:
    """Mixed into vLLM's worker class via LLM(worker_extension_cls=...)."""

    def _tp(self):
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def logra_init(self, config: dict, strategy: str, step: int) -> dict:
        rank, size = self._tp()
        model_config = getattr(self, "model_config", None) or self.vllm_config.model_config
        layout = FusedLayout.from_hf_config(model_config.hf_config, tp_size=size, tp_rank=rank)
        params = dict(self.model_runner.model.named_parameters())
        self.logra = FusedReceiver(params, layout, LoGRAConfig(**config), step=step, strategy=strategy)
        return {"rank": rank, "tp": size, "params": {n: [list(p.shape), str(p.dtype)] for n, p in params.items()},
                "checksum": self.logra.checksum()}

    def logra_apply(self, data: bytes, checksums: list) -> dict:
        rank, _ = self._tp()
        delta = PolicyDelta.from_bytes(data)
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            self.logra.apply(delta, checksum=checksums[rank] if checksums else None)
            status = "applied"
        except DeltaMismatchError as e:
            status = f"refused: {type(e).__name__}: {e}"
        torch.cuda.synchronize()
        return {"rank": rank, "step": self.logra.step, "status": status, "apply_s": time.perf_counter() - t}

    def logra_resync(self, data: bytes, step: int, checksums: list) -> dict:
        """logra's own full resync: HF-named safetensors bytes into the fused tensors."""
        rank, _ = self._tp()
        torch.cuda.synchronize()
        t = time.perf_counter()
        device = next(iter(self.logra.params.values())).device
        state = {n: x.to(device) for n, x in decode_full_weights(data).items()}
        try:
            self.logra.resync(state, step, checksum=checksums[rank] if checksums else None)
            status = "resynced"
        except (DeltaMismatchError, LayoutError) as e:
            status = f"failed: {type(e).__name__}: {e}"
        torch.cuda.synchronize()
        return {"rank": rank, "step": self.logra.step, "status": status, "load_s": time.perf_counter() - t}

    def logra_vllm_reload(self, data: bytes, step: int) -> dict:
        """The usual RLHF full reload through vLLM's own loader (model.load_weights, HF names)."""
        rank, _ = self._tp()
        torch.cuda.synchronize()
        t = time.perf_counter()
        device = next(iter(self.logra.params.values())).device
        self.model_runner.model.load_weights(weights=[(n, x.to(device)) for n, x in decode_full_weights(data).items()])
        torch.cuda.synchronize()
        self.logra.step, self.logra.needs_resync = step, False
        return {"rank": rank, "load_s": time.perf_counter() - t, "checksum": self.logra.checksum()}

    def logra_checksum(self) -> str:
        return self.logra.checksum()
PYEOF

cat > "$CHECK_DIR/vllm_deltas.py" <<'PYEOF'
"""A tiny local Qwen2 in vLLM receiving 20 LoGRA deltas; prints markdown tables, writes JSON."""
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra import LoGRAConfig, LoGRAOptimizer, apply_delta
from logra.projection import stable_name
from logra.parallel import encode_full_weights
from logra.parallel.vllm import FusedLayout, expected_fused_checksum

N_DELTAS, TP = 20, int(os.environ.get("VLLM_TP", "1"))
STRATEGY = os.environ.get("VLLM_STRATEGY", "full")
OUT = Path(os.environ["CHECK_OUT"])
KL_AT = (0, 10, 20)
results = {"tp": TP, "strategy": STRATEGY, "updates": [], "kl": [], "events": []}
problems = []


def state(model):
    return {stable_name(n): p.detach() for n, p in model.named_parameters()}


def batch(vocab, seed, b=4, t=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, t), generator=g).cuda()
    return {"input_ids": ids, "labels": ids}


def main():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    trainer = Qwen2ForCausalLM(cfg).float().cuda()            # fp32 trainer
    rollout = copy.deepcopy(trainer).to(torch.bfloat16)       # bf16 HF rollout copy: the bitwise reference
    model_dir = OUT / "tiny-qwen2"
    rollout.save_pretrained(model_dir)                        # vLLM loads exactly these bf16 bits
    lcfg = LoGRAConfig(rank=16, update_ratio=1e-3)
    opt = LoGRAOptimizer(trainer, lcfg)
    layouts = [FusedLayout.from_hf_config(cfg, tp_size=TP, tp_rank=r) for r in range(TP)]

    from vllm import LLM, SamplingParams  # noqa: E402

    llm = LLM(model=str(model_dir), dtype="bfloat16", tensor_parallel_size=TP, skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=False,  # cached KV from old weights would be stale
              gpu_memory_utilization=0.25, max_model_len=512, seed=0,
              worker_extension_cls="logra_vllm_ext.LoGRAWorkerExtension")
    rpc = llm.collective_rpc

    init = rpc("logra_init", args=(lcfg.to_dict(), STRATEGY, 0))
    for r in init:
        want = expected_fused_checksum(state(rollout), layouts[r["rank"]])
        ok = r["checksum"] == want
        results["events"].append(f"init rank {r['rank']}: {len(r['params'])} params, checksum vs layout: {ok}")
        if not ok:
            problems.append(f"rank {r['rank']}: vLLM's loaded weights differ from fuse_state_dict (layout wrong?)")
            print(json.dumps(r["params"], indent=1)[:4000])

    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(1, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(16)]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=32, logprobs=0, seed=1234, ignore_eos=True,
                              detokenize=False)

    @torch.no_grad()
    def token_logprobs(model, prompt, response):
        ids = torch.tensor([prompt + response], device="cuda")
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device="cuda")[:, None])[:, 0]

    def mismatch(step):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
        lv, lt, lr = [], [], []
        for p, o in zip(prompts, outs):
            toks = list(o.outputs[0].token_ids)
            lv.append(torch.tensor([o.outputs[0].logprobs[j][t].logprob for j, t in enumerate(toks)], device="cuda"))
            lt.append(token_logprobs(trainer, p, toks))
            lr.append(token_logprobs(rollout, p, toks))
        lv, lt, lr = torch.cat(lv), torch.cat(lt), torch.cat(lr)
        d = lt - lv  # log p_trainer - log p_vllm on tokens sampled by vLLM
        row = {"step": step, "tokens": int(lv.numel()), "kl_k1": float((-d).mean()),
               "kl_k3": float((d.exp() - 1 - d).mean()), "max_abs_logprob_diff": float(d.abs().max()),
               "max_abs_diff_vs_bf16_hf": float((lr - lv).abs().max())}
        results["kl"].append(row)

    mismatch(0)
    for i in range(N_DELTAS):
        trainer(**batch(cfg.vocab_size, i)).loss.backward()
        delta = opt.apply(opt.propose())
        opt.zero_grad()
        apply_delta(rollout, delta, lcfg)
        t0 = time.perf_counter()
        data = delta.to_bytes()
        names = layouts[0].fused_names(delta.factors)
        sums = [expected_fused_checksum(state(rollout), lay, names) for lay in layouts]
        t1 = time.perf_counter()
        reply = rpc("logra_apply", args=(data, sums))
        t2 = time.perf_counter()
        results["updates"].append({"step": delta.step, "bytes": delta.nbytes, "wire_bytes": len(data),
                                   "encode_and_checksum_s": t1 - t0, "rpc_s": t2 - t1,
                                   "apply_s": max(r["apply_s"] for r in reply), "status": [r["status"] for r in reply]})
        if any(r["status"] != "applied" for r in reply):
            problems.append(f"update {delta.step}: {[r['status'] for r in reply]}")
        if i == 9:  # the same update again (stale), then one from the future (gap): both refused
            stale = rpc("logra_apply", args=(data, sums))
            future = copy.copy(delta)
            future.step = delta.step + 2
            gap = rpc("logra_apply", args=(future.to_bytes(), None))
            for what, rep in (("stale", stale), ("gap", gap)):
                refused = all(r["status"].startswith("refused: DeltaGapError") for r in rep)
                results["events"].append(f"{what} update refused: {refused} ({rep[0]['status'][:120]})")
                if not refused:
                    problems.append(f"{what} update was not refused")
        if i + 1 in KL_AT:
            mismatch(i + 1)

    # Full weights: logra's verified resync vs vLLM's own loader (the usual RLHF full reload).
    full = encode_full_weights(rollout)
    want_all = [expected_fused_checksum(state(rollout), lay) for lay in layouts]
    timing = {"resync_rpc_s": [], "vllm_reload_rpc_s": []}
    for _ in range(3):
        t = time.perf_counter()
        rep = rpc("logra_resync", args=(full, N_DELTAS, want_all))
        timing["resync_rpc_s"].append(time.perf_counter() - t)
        if any(r["status"] != "resynced" for r in rep):
            problems.append(f"resync: {[r['status'] for r in rep]}")
        t = time.perf_counter()
        rep = rpc("logra_vllm_reload", args=(full, N_DELTAS))
        timing["vllm_reload_rpc_s"].append(time.perf_counter() - t)
        same = [r["checksum"] == want_all[r["rank"]] for r in rep]
        if not all(same):
            problems.append("vLLM's own load_weights gives other bits than logra's fused layout")
    results["events"].append(f"vLLM load_weights == fuse_state_dict after 20 updates: {all(same)}")
    results["full_bytes"] = len(full)
    results["timing"] = {k: statistics.median(v) for k, v in timing.items()}

    u = results["updates"]
    print("\n### vLLM receiving LoGRA deltas (tiny Qwen2: hidden 512, 4 layers, vocab 8192; "
          f"tp={TP}, strategy={STRATEGY}, rank {lcfg.rank}, bf16 engine)\n")
    print("| sync | bytes per update | median wall per update (s) | median apply on workers (s) |")
    print("|---|---:|---:|---:|")
    print(f"| delta (collective_rpc, checksum verified) | {statistics.median(x['bytes'] for x in u):,.0f} "
          f"(wire {statistics.median(x['wire_bytes'] for x in u):,.0f}) | "
          f"{statistics.median(x['rpc_s'] for x in u):.4f} | {statistics.median(x['apply_s'] for x in u):.4f} |")
    print(f"| full reload, vLLM load_weights | {len(full):,} | {results['timing']['vllm_reload_rpc_s']:.4f} | |")
    print(f"| full resync, logra (verified) | {len(full):,} | {results['timing']['resync_rpc_s']:.4f} | |")
    print(f"\ntrainer-side encode + per-rank checksum per update (median): "
          f"{statistics.median(x['encode_and_checksum_s'] for x in u):.4f} s\n")
    print("| after update | tokens | mismatch KL k1 | k3 | max abs log-prob diff vs fp32 trainer | vs bf16 HF copy |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results["kl"]:
        print(f"| {r['step']} | {r['tokens']} | {r['kl_k1']:.3e} | {r['kl_k3']:.3e} | {r['max_abs_logprob_diff']:.3e} "
              f"| {r['max_abs_diff_vs_bf16_hf']:.3e} |")
    print()
    for e in results["events"]:
        print("-", e)
    results["problems"] = problems
    (OUT / "vllm_deltas.json").write_text(json.dumps(results, indent=1))
    print("\nPROBLEMS:" if problems else "\nall vLLM delta checks passed", *problems, sep="\n- ")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":  # vLLM may spawn workers that re-import this module
    main()
PYEOF

export CHECK_OUT="$OUT_DIR" PYTHONPATH="$CHECK_DIR${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TP="${VLLM_TP:-1}" VLLM_STRATEGY="${VLLM_STRATEGY:-full}"
step vllm_deltas "$T_VLLM" "$PY" "$CHECK_DIR/vllm_deltas.py"
rm -rf "$OUT_DIR/tiny-qwen2"  # the checkpoint is not worth bringing back

# ---------------------------------------------------------------- summary
{
    echo "================ summary ($(date -u +%FT%TZ)) ================"
    printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT_DIR/summary.txt"
