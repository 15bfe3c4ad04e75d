"""LoGRA inside TRL's real GRPOTrainer: what trains, what TRL logs, checkpoints, refusals.

One tiny random Qwen2 (byte tokenizer) is saved once and loaded by path, as a user
would. The runs are shared by the tests through module fixtures:

- ``logra_run``: 3 GRPO steps with LoGRA (2 micro-batches per step), a checkpoint at
  step 2, and the first step's sketches recorded just before ``optimizer.step()``;
- ``adamw_run``: 1 GRPO step with TRL's own AdamW, its dense gradients recorded at the
  same point. Same seed and weights, so the first window's batches are identical.
"""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from logra import KLController, LoGRAConfig, LoGRAError  # noqa: E402
from logra.integrations import KLControlledLoGRA  # noqa: E402
from logra.integrations import trl as trl_integration  # noqa: E402
from logra.integrations.trl import LoGRAGRPOTrainer  # noqa: E402
from logra.kl import KLControlConfig  # noqa: E402
from logra.rl.tiny import byte_tokenizer  # noqa: E402

BUDGET = 1e-6  # constant and far below the full step's KL, so α < α_max is exercised
TRL_KEYS = {"loss", "grad_norm", "learning_rate", "reward", "reward_std", "entropy", "rewards/digits/mean",
            "completions/mean_length", "num_tokens", "step_time"}
LOGRA_KEYS = {"logra/predicted_kl", "logra/alpha", "logra/budget", "logra/sketch_norm", "logra/realized_kl",
              "logra/update_norm", "logra/expected_kl"}


def digits(completions: list[str], **_) -> list[float]:
    """A dense reward (fraction of digit bytes), so a random policy gets non-zero advantages."""
    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]


def _dataset() -> Dataset:
    return Dataset.from_list([{"prompt": f"{i} + {i % 7} ="} for i in range(64)])


def _args(out: Path, **overrides) -> GRPOConfig:
    kw = dict(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=6, logging_steps=1, bf16=False, use_cpu=True, report_to=[],
        disable_tqdm=True, save_strategy="no", seed=0, max_grad_norm=0.0,
    )
    kw.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return GRPOConfig(**kw)


def _logra_trainer(model_dir: Path, out: Path, **overrides) -> LoGRAGRPOTrainer:
    return LoGRAGRPOTrainer(
        model=str(model_dir), reward_funcs=digits, args=_args(out, **overrides), train_dataset=_dataset(),
        logra_config=LoGRAConfig(rank=8, update_ratio=1e-2),
        kl_controller=KLController(budget=BUDGET, schedule="constant"),
    )


class _FirstStep(TrainerCallback):
    """Records, at the first optimizer step, LoGRA's sketches or the dense target gradients."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer, self.record = trainer, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if state.global_step != 0:
            return
        opt = getattr(self.trainer, "logra_optimizer", None)
        if opt is not None:
            self.record = {n: (s.clone(), opt.projection(n).clone()) for n, s in opt.sketches().items()}
        else:
            self.record = {n: p.grad.clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None}


def save_tiny_model(path: Path) -> Path:
    """Save the tiny random Qwen2 and its byte tokenizer at ``path`` (loaded by path, as a user would)."""
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )
    Qwen2ForCausalLM(cfg).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def initial_weights(model_dir) -> dict[str, torch.Tensor]:
    return Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()


@pytest.fixture(scope="module")
def logra_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("logra_run")
    trainer = _logra_trainer(model_dir, out, save_strategy="steps", save_steps=2)
    recorder = _FirstStep(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, recorder.record, out


@pytest.fixture(scope="module")
def adamw_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("adamw_run")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digits, args=_args(out, max_steps=1),
                          train_dataset=_dataset())
    recorder = _FirstStep(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    return trainer, recorder.record


def test_sketch_is_the_projected_trl_gradient(logra_run, adamw_run):
    """Over TRL's accumulation window, LoGRA's sketch equals (dense gradient of TRL's loss) · Aᵀ."""
    _, sketches, _ = logra_run
    _, grads = adamw_run
    assert sketches and set(sketches) <= set(grads)
    for name, (sketch, projection) in sketches.items():
        expected = grads[name] @ projection.T
        scale = expected.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(sketch, expected, rtol=1e-4, atol=1e-5 * float(scale), msg=name)


def test_targets_train_frozen_stay(logra_run, initial_weights):
    trainer, _, _ = logra_run
    # HF steps accelerate's wrapper, which must delegate to the controlled LoGRA step.
    assert isinstance(trainer.optimizer, AcceleratedOptimizer)
    assert trainer.optimizer.optimizer is trainer.logra_optimizer
    targets = set(trainer.logra_optimizer.targets)
    final = trainer.model.state_dict()
    assert len(targets) == 14  # 7 projections x 2 layers
    for name, before in initial_weights.items():
        if name not in final:  # the tied lm_head is the embedding
            continue
        if name in targets:
            assert not torch.equal(final[name], before), f"target {name} did not change"
        else:
            assert torch.equal(final[name], before), f"frozen {name} changed"
    assert trainer.logra_optimizer.num_updates == 3


def test_logs_keep_trl_metrics_and_add_logra(logra_run, adamw_run):
    trainer, _, _ = logra_run
    steps = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    adamw_first = next(h for h in adamw_run[0].state.log_history if "reward" in h)
    assert TRL_KEYS <= set(adamw_first)
    for h in steps:
        assert TRL_KEYS | LOGRA_KEYS <= set(h), sorted(TRL_KEYS | LOGRA_KEYS - set(h))
        # TRL's grad_norm is the sketched-gradient norm LoGRA reports (HF cannot see .grad of sketched weights).
        assert h["grad_norm"] == pytest.approx(h["logra/sketch_norm"], rel=1e-6)
    # Same weights and seed before step 1: TRL's generations, rewards and loss are unchanged by LoGRA.
    first = steps[0]
    for key in ("reward", "reward_std", "completions/mean_length", "num_tokens"):
        assert first[key] == adamw_first[key], key
    assert first["entropy"] == pytest.approx(adamw_first["entropy"], rel=1e-5)
    assert first["loss"] == pytest.approx(adamw_first["loss"], abs=1e-6)


def test_kl_control_meets_the_budget(logra_run):
    """Each TRL step is scaled to the budget: the KL measured after the step matches it."""
    trainer, _, _ = logra_run
    for h in (h for h in trainer.state.log_history if "logra/alpha" in h):
        assert h["logra/budget"] == BUDGET
        assert h["logra/alpha"] < 3.0
        assert h["logra/alpha"] == pytest.approx(math.sqrt(BUDGET / h["logra/predicted_kl"]), rel=1e-9)
        assert h["logra/realized_kl"] == pytest.approx(BUDGET, rel=0.05)


def test_resume_from_trl_checkpoint_is_bitwise(logra_run, model_dir, tmp_path):
    """Resuming at step 2 reproduces the uninterrupted step 3 exactly.

    Bitwise, not within a tolerance: the checkpoint holds the fp32 weights exactly
    (safetensors), the LoGRA state exactly (optimizer.pt), the projections are rebuilt
    from the same seeds, HF restores the RNG (so generation samples the same tokens)
    and the data order, and the CPU kernels are deterministic.
    """
    uninterrupted, _, out = logra_run
    checkpoint = out / "checkpoint-2"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert state["num_updates"] == 2 and state["kl_controller"]["budget"] == BUDGET

    resumed = _logra_trainer(model_dir, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.logra_optimizer.num_updates == 3
    assert resumed.kl_controller.state_dict() == uninterrupted.kl_controller.state_dict()
    expected, got = uninterrupted.model.state_dict(), resumed.model.state_dict()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name

    # Control: the same resume without the LoGRA state (no optimizer.pt) ends elsewhere.
    stripped = tmp_path / "no_optimizer_state"
    shutil.copytree(checkpoint, stripped)
    (stripped / "optimizer.pt").unlink()
    fresh = _logra_trainer(model_dir, tmp_path / "fresh")
    fresh.train(resume_from_checkpoint=str(stripped))
    assert fresh.logra_optimizer.num_updates == 1
    assert any(not torch.equal(fresh.model.state_dict()[n], expected[n]) for n in resumed.logra_optimizer.targets)


def test_non_target_adamw_trains_the_rest(model_dir, initial_weights, tmp_path):
    """non_target='adamw': norms and embeddings move too, and TRL's grad_norm includes their gradients."""
    trainer = LoGRAGRPOTrainer(
        model=str(model_dir), reward_funcs=digits, args=_args(tmp_path, max_steps=1), train_dataset=_dataset(),
        logra_config=LoGRAConfig(rank=8, non_target="adamw", non_target_lr=1e-3), kl_control=False,
    )
    trainer.train()
    final = trainer.model.state_dict()
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert not torch.equal(final[name], initial_weights[name]), name
    h = next(h for h in trainer.state.log_history if "reward" in h)
    assert h["logra/alpha"] == 1.0 and "logra/predicted_kl" not in h
    assert h["grad_norm"] > 0 and h["grad_norm"] == pytest.approx(h["logra/sketch_norm"], rel=1e-6)


def test_trl_clipping_moved_to_logra_with_a_warning(model_dir, tmp_path):
    args = _args(tmp_path, max_grad_norm=1.0, learning_rate=1e-4)
    with pytest.warns(UserWarning) as caught:
        LoGRAGRPOTrainer(model=str(model_dir), reward_funcs=digits, args=args, train_dataset=_dataset())
    text = " ".join(str(w.message) for w in caught)
    assert "LoGRAConfig(max_grad_norm=" in text and "learning_rate=0.0001 is not used" in text
    assert args.max_grad_norm == 0.0


@pytest.mark.parametrize(
    "case", ["use_vllm", "fp16", "optimizer", "peft", "non_target_sketch", "inputs", "deepspeed", "fsdp", "sharded",
             "kl_schedule_by_epochs"])
def test_conflicting_settings_are_refused(case, model_dir, tmp_path, monkeypatch):
    """Each refusal says what to do instead. Plain DDP is supported (test_trl_ddp.py); sharding is not."""
    kwargs = dict(model=str(model_dir), reward_funcs=digits, train_dataset=_dataset())
    args = _args(tmp_path)
    expect = {
        "use_vllm": "use_vllm=False", "fp16": "bf16=True", "optimizer": "logra_config=LoGRAConfig",
        "peft": "drop peft_config", "non_target_sketch": "non_target='freeze'", "inputs": "fit_projections",
        "deepspeed": "plain data parallel",
        "fsdp": "plain data parallel", "sharded": "plain data parallelism (DDP) only",
        "kl_schedule_by_epochs": "set kl_config.schedule_steps",
    }[case]
    if case == "use_vllm":  # server mode; colocate runs (test_trl_vllm.py)
        args.use_vllm, args.vllm_mode = True, "server"
    elif case == "fp16":
        args.fp16 = True
    elif case == "optimizer":
        kwargs["optimizers"] = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), None)
    elif case == "peft":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, target_modules=["q_proj"])
    elif case == "non_target_sketch":
        kwargs["logra_config"] = LoGRAConfig(rank=8, non_target="sketch")
    elif case == "inputs":
        kwargs["logra_config"] = LoGRAConfig(rank=8, distribution="inputs", refresh=False)
    elif case == "deepspeed":
        args.deepspeed = {"zero_optimization": {"stage": 2}}
    elif case == "fsdp":
        args.fsdp = ["full_shard"]
    elif case == "kl_schedule_by_epochs":  # schedule_steps=0 means max_steps, and there is none
        args.max_steps = -1
        kwargs["kl_config"] = KLControlConfig(schedule_steps=0)
    else:  # several processes, but accelerate shards (e.g. an FSDP or tensor-parallel accelerate config)
        monkeypatch.setattr(LoGRAGRPOTrainer, "_data_parallel", property(lambda self: True))
        monkeypatch.setattr(trl_integration, "_plain_data_parallel", lambda accelerator: False)
    with pytest.raises(ValueError, match="LoGRA") as info:
        LoGRAGRPOTrainer(args=args, **kwargs)
    assert expect in str(info.value)


def test_kl_controlled_step_needs_a_probe(model_dir):
    """Outside TRL: a controlled step without a probe batch refuses instead of stepping blind."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    opt = KLControlledLoGRA(model, LoGRAConfig(rank=8), KLController())
    ids = torch.randint(0, 256, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LoGRAError, match="set_probe"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    response = torch.zeros_like(ids)
    response[:, 5:] = 1
    opt.set_probe(ids, None, response)
    opt.step()
    assert opt.num_updates == 1 and opt.last_delta is not None and 0 < opt.last_stats["alpha"] <= 3.0
