"""The RL loop end to end on a tiny model: updates, KL control, metrics, resume, CLI, bad input."""

from __future__ import annotations

import copy
import json
import math
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import conftest
from logra.config import LoGRAConfig
from logra.rl import KLControlConfig, RLConfig, RLTrainer, advantages, policy_loss
from logra.rl.cli import main as train_main
from logra.rl.tiny import byte_tokenizer


class VowelTask(conftest.VowelTask):
    """`conftest.VowelTask` whose grader crashes on responses that start with '!' (a crash
    is counted, not fatal)."""

    def _grade(self, problem, response: str) -> float:
        if response.startswith("!"):
            raise RuntimeError("grader crash")
        return super()._grade(problem, response)


def _policy(seed: int = 0):
    tok = byte_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg), tok


def _config(tmp_path, **kw) -> RLConfig:
    base = dict(task="basic_arithmetic", optimizer="logra", updates=3, prompts_per_update=4, responses_per_prompt=4,
                micro_batch=8, max_new_tokens=6, eval_every=0, eval_problems=8, checkpoint_every=2,
                run_dir=str(tmp_path / "run"), logra=LoGRAConfig(rank=8, update_ratio=1e-2),
                kl=KLControlConfig(budget=1e-3, budget_final=1e-4, schedule_steps=10))
    if kw.get("optimizer") in ("adamw", "lora"):
        base["lr"] = 1e-3
    base.update(kw)
    return RLConfig(**base)


def test_grpo_advantages_and_loss_reference():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4])
    adv = advantages(rewards, 3, "grpo", 0.0)
    r = rewards.view(2, 3)
    torch.testing.assert_close(adv.view(2, 3), (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4))
    assert torch.allclose(advantages(rewards, 3, "reinforce", 0.3), rewards - 0.3)
    logp = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.9]])).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5, 0.1], [0.1, 0.3]]))
    mask = torch.tensor([[1, 1], [0, 1]])
    a = torch.tensor([1.0, -1.0])
    cfg = RLConfig(algorithm="reinforce", is_cap=2.0)
    loss, _ = policy_loss(logp, old, a, mask, cfg)
    # ratios: 1, 2 (capped at 2), -, 3 → capped 2; weight · A · logp summed over the mask
    expected = -(1 * 1 * logp[0, 0] + 2 * 1 * logp[0, 1] + 2 * -1 * logp[1, 1])
    torch.testing.assert_close(loss, expected)
    cfg = RLConfig(algorithm="grpo", clip_eps=0.2)
    loss, _ = policy_loss(logp, old, a, mask, cfg)
    ratio = torch.exp(logp - old)
    ref = -(torch.minimum(ratio * a[:, None], ratio.clamp(0.8, 1.2) * a[:, None]) * mask).sum()
    torch.testing.assert_close(loss, ref)


@pytest.mark.parametrize("optimizer", ["logra", "adamw", "lora"])
def test_updates_change_policy_under_kl_control(tmp_path, optimizer):
    model, tok = _policy()
    names = {n for n, _ in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = RLTrainer(_config(tmp_path, optimizer=optimizer), model=model, tokenizer=tok, task=VowelTask(),
                        progress=False)
    records = [trainer.train_step() for _ in range(3)]
    for r in records:
        assert {"reward", "loss", "expected_kl", "alpha", "effective_budget", "realized_kl", "time_rollout",
                "time_train", "time_step", "truncation_rate", "clip_frac", "response_len"} <= set(r)
        assert 0 < r["alpha"] <= 3.0
        # the step was sized to the budget and the realised KL matches the prediction
        assert r["realized_kl"] == pytest.approx(r["expected_kl"], rel=0.25)
    for i, r in enumerate(records):  # each step sized to its own update's budget, not another's
        assert r["budget"] == pytest.approx(trainer.controller.budget_at(i), rel=1e-12)
        assert r["expected_kl"] == pytest.approx(min(r["effective_budget"], 9 * r["predicted_kl"]), rel=1e-9)
    after = dict(trainer.model.named_parameters())
    if optimizer == "logra":
        changed = {n for n in names if not torch.equal(before[n], after[n])}
        assert changed == set(trainer.optimizer.targets)  # 'freeze': only sketched weights move
        assert records[0]["delta_bytes"] == sum(8 * 2 * before[n].shape[0] for n in changed)


INPUTS = LoGRAConfig(rank=8, update_ratio=1e-2, distribution="inputs", refresh=False)
#: re-fitted at updates 2, 4, ...: a run resumed at update 2 resumes into a fit
WINDOWS = LoGRAConfig(rank=8, update_ratio=1e-2, distribution="inputs", refresh=True, refresh_every=2, beta1=0.9)


@pytest.mark.parametrize("options", [{}, {"optimizer": "adamw", "lr_schedule": "constant"}, {"logra": INPUTS},
                                     {"logra": WINDOWS, "algorithm": "reinforce"},  # every update moves it
                                     {"logra": INPUTS, "rollout_workers": 1}],
                         ids=["logra", "adamw", "logra-inputs", "logra-input-windows", "rollout-workers"])
def test_resume_continues_exactly(tmp_path, options):
    """A run stopped at update 2 and resumed ends bitwise where the uninterrupted one does
    (rollout workers, started with other weights, sample update 2 from the checkpoint's)."""
    full_model, tok = _policy()
    full = RLTrainer(_config(tmp_path / "a", updates=4, **options), model=full_model, tokenizer=tok,
                     task=VowelTask(), progress=False)
    full.train()
    half_model, _ = _policy()
    half = RLTrainer(_config(tmp_path / "b", updates=2, **options), model=half_model, tokenizer=tok,
                     task=VowelTask(), progress=False)
    half.train()
    resumed_model, _ = _policy(seed=99)  # different init: everything must come from the checkpoint
    resumed = RLTrainer(_config(tmp_path / "b", updates=4, **options), model=resumed_model, tokenizer=tok,
                        task=VowelTask(), progress=False)
    resumed.load_checkpoint()
    resumed.train()
    for (n, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    def train_rows(run: str) -> list[dict]:
        rows = [json.loads(line) for line in (tmp_path / run / "run" / "metrics.jsonl").read_text().splitlines()]
        # timings, memory and message sizes (a resumed stream's first delta carries fitted projections) differ
        return [{k: v for k, v in r.items() if not k.startswith("time") and "bytes" not in k and "rss" not in k}
                for r in rows if r["kind"] == "train"]

    assert [r["update"] for r in train_rows("b")] == [0, 1, 2, 3]
    # the same rollouts, rewards, losses and KL terms (mismatch_kl: sampled from the policy trained)
    assert train_rows("b") == train_rows("a")


class _RecordingTask(VowelTask):
    """Records every problem the trainer grades, in order."""

    def __init__(self) -> None:
        self.graded: list = []

    def score(self, problem, response: str) -> float:
        self.graded.append(problem)
        return super().score(problem, response)


@pytest.mark.parametrize(("train_pool", "size"), [(0, 2000), (6, 6)], ids=["default", "pool-6"])
def test_each_updates_prompts_are_sampled_from_the_configured_training_pool(tmp_path, train_pool, size):
    model, tok = _policy()
    task = _RecordingTask()
    cfg = _config(tmp_path, train_pool=train_pool, seed=3)
    trainer = RLTrainer(cfg, model=model, tokenizer=tok, task=task, progress=False)
    for _ in range(3):
        trainer.train_step()
    pool = task.problems("train", size, seed=3)
    # the default's draw is the one every earlier run made (exact resume, unchanged bits)
    expected = [p for u in range(3) for p in random.Random(3 * 1_000_003 + u).sample(pool, 4) for _ in range(4)]
    assert [p.prompt for p in task.graded] == [p.prompt for p in expected]
    with pytest.raises(ValueError, match="train_pool"):
        _config(tmp_path, train_pool=3)  # fewer than one update's prompts


def test_grader_failures_are_counted(tmp_path):
    class Crashy(VowelTask):
        def _grade(self, problem, response):
            raise RuntimeError("boom")

    model, tok = _policy()
    task = Crashy()
    trainer = RLTrainer(_config(tmp_path), model=model, tokenizer=tok, task=task, progress=False)
    record = trainer.train_step()
    assert record["reward"] == 0 and record["reward_failures"] == 16


def test_cli_trains_a_local_model_and_resumes(tmp_path, capsys):
    model, tok = _policy()
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    run = tmp_path / "cli-run"
    common = ["--model", str(tmp_path / "policy"), "--task", "basic_arithmetic", "--extract", "full",
              "--instruction", "", "--prompts_per_update", "2", "--responses_per_prompt", "2",
              "--max_new_tokens", "4", "--eval_problems", "4", "--eval_every", "0", "--logra.rank", "8",
              "--run_dir", str(run), "--quiet"]
    assert train_main(common + ["--updates", "1"]) == 0
    assert (run / "checkpoint" / "model.safetensors").exists() and (run / "learning.png").exists()
    assert train_main(["--resume", str(run), "--updates", "2", "--quiet"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows if r["kind"] == "train"] == [0, 1]
    with pytest.raises(SystemExit, match="different config"):
        train_main(["--resume", str(run), "--logra.rank", "4", "--quiet"])


def test_bad_input_is_refused_before_work(tmp_path):
    with pytest.raises(SystemExit, match="did you mean 'updates'"):
        train_main(["--updatez", "3"])
    with pytest.raises(SystemExit, match="logra.rank"):
        train_main(["--logra.rnak", "3"])
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("kl:\n  budgett: 1.0\n")
    with pytest.raises(SystemExit, match="kl.budget"):
        train_main(["--config", str(cfg_file)])
    with pytest.raises(SystemExit, match="word_ladder"):
        train_main(["--task", "word_ladderr", "--run_dir", str(tmp_path / "x")])
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(SystemExit, match="not a loadable causal language model"):
        train_main(["--model", str(tmp_path / "notamodel"), "--run_dir", str(tmp_path / "y")])
    with pytest.raises(SystemExit, match="no checkpoint"):
        train_main(["--resume", str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match="responses_per_prompt"):
        RLConfig(algorithm="grpo", responses_per_prompt=1)
    with pytest.raises(ValueError, match="lr_schedule"):
        RLConfig(optimizer="adamw", lr_schedule="linear")
    with pytest.raises(ValueError, match="no learning-rate schedule"):
        RLConfig(optimizer="logra", lr_schedule="constant")
    # a baseline's setting under an optimizer that ignores it
    for options, option in [({"lr": 3e-4}, "lr"), ({"adam_beta1": 0.0}, "adam_beta1"), ({"lora_rank": 8}, "lora_rank"),
                            ({"optimizer": "adamw", "lora_rank": 8}, "lora_rank")]:
        with pytest.raises(ValueError, match=f"RLConfig.{option}=.* applies to optimizer"):
            RLConfig(**options)
    RLConfig(optimizer="lora", lr=3e-4, adam_beta1=0.0, lora_rank=8)


def _dp_rank(rank: int, world: int, store: str, root: str, optimizer: str) -> None:
    import torch.distributed as dist

    from logra import weights_checksum
    from logra.parallel import init_local

    init_local(rank, world, store)
    try:
        model, tok = _policy()
        inputs = optimizer.startswith("logra-input")
        windows = optimizer == "logra-input-windows"  # re-fitted at update 2: every rank to the same prompts
        cfg = _config(__import__("pathlib").Path(root), updates=3 if windows else 2,
                      optimizer="logra" if inputs else optimizer,
                      **({"logra": WINDOWS if windows else INPUTS} if inputs else {}))
        trainer = RLTrainer(cfg, model=model, tokenizer=tok, task=VowelTask(), progress=False)
        trainer.train()
        digest = weights_checksum(trainer.model)
        (__import__("pathlib").Path(root) / f"digest{rank}").write_text(digest)
        if inputs:
            torch.save(trainer.optimizer.projector.fitted, __import__("pathlib").Path(root) / f"fitted{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["logra", "lora", "logra-inputs", "logra-input-windows"])
def test_data_parallel_two_ranks_stay_identical(tmp_path, optimizer):
    """Two ranks split the prompts, all-reduce one sketch buffer (LoRA: the adapters'
    gradients) and apply the same step. Spawned ranks start from unrelated torch RNG states,
    so LoRA's adapters must be drawn from the run's seed to match. Fitted projections
    (``distribution='inputs'``) are fitted on every rank to all ranks' prompts: bitwise
    those of one process."""
    from logra.parallel import spawn_local

    if optimizer == "lora":
        pytest.importorskip("peft")
    assert spawn_local(_dp_rank, 2, args=(str(tmp_path), optimizer), timeout=300) == [0, 0]
    assert (tmp_path / "digest0").read_text() == (tmp_path / "digest1").read_text()
    model, _ = _policy()
    from logra import weights_checksum

    assert weights_checksum(model) != (tmp_path / "digest0").read_text()  # the policy moved
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows if r["kind"] == "train"] == list(range(3 if "windows" in optimizer else 2))
    assert (tmp_path / "run" / "checkpoint" / "rng-rank1.pt").exists()
    if optimizer == "logra-inputs":
        alone = RLTrainer(_config(tmp_path / "alone", logra=INPUTS), model=_policy()[0], tokenizer=_policy()[1],
                          task=VowelTask(), progress=False)
        alone.fit_projections()
        for rank in range(2):
            fitted = torch.load(tmp_path / f"fitted{rank}.pt")
            assert fitted.keys() == alone.optimizer.projector.fitted.keys()
            assert all(torch.equal(a, alone.optimizer.projector.fitted[k]) for k, a in fitted.items())


def test_each_window_is_fitted_to_the_prompts_of_its_first_update(tmp_path):
    """``distribution='inputs'`` with refresh windows: the trainer fits before updates 0, 2, 4,
    each time on the (unpadded) prompts that update trains on."""
    model, tok = _policy()
    trainer = RLTrainer(_config(tmp_path, updates=5, logra=WINDOWS), model=model, tokenizer=tok, task=VowelTask(),
                        progress=False)
    fit, seen = trainer.optimizer.fit_projections, []

    def recording(batches):
        batches = list(batches)
        rows = [(ids, mask) for b in batches for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)]
        seen.append((trainer.optimizer.num_updates, [tok.decode(ids[mask.bool()]) for ids, mask in rows]))
        return fit(batches)

    trainer.optimizer.fit_projections = recording
    trainer.train()
    assert [update for update, _ in seen] == [0, 2, 4]
    for update, prompts in seen:
        assert prompts == [p.prompt for p in trainer._train_problems(update, every_rank=True)]
    # a loop of its own that steps the optimizer (as `logra bench diagnostics` does) and calls
    # `fit_projections` before each backward: fitted on the optimizer's update, not the trainer's
    model, tok = _policy()
    trainer = RLTrainer(_config(tmp_path / "own", logra=WINDOWS), model=model, tokenizer=tok, task=VowelTask(),
                        progress=False)
    fit, seen = trainer.optimizer.fit_projections, []
    trainer.optimizer.fit_projections = recording
    for i in range(3):
        trainer.fit_projections()
        trainer.model(**conftest.token_batch(len(tok), seed=i)).loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
    assert [update for update, _ in seen] == [0, 2]
    assert seen[1][1] == [p.prompt for p in trainer._train_problems(2, every_rank=True)]


def test_yaml_example_config_runs(tmp_path):
    """examples/train_tiny.yaml is a valid config and runs (shortened by flags)."""
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "train_tiny.yaml"
    argv = ["--config", str(example), "--updates", "1", "--tiny.sft_steps", "3", "--tiny.num_demonstrations", "64",
            "--eval_problems", "4", "--prompts_per_update", "2", "--responses_per_prompt", "2",
            "--kl.probe_responses", "2", "--run_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache"),
            "--quiet", "--train_pool", "0"]  # not the recipe's pool of 179 200 draws (~5 s to build)
    assert train_main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["updates"] == 1


@pytest.mark.parametrize("logra", [LoGRAConfig(rank=8, update_ratio=1e-2), INPUTS, WINDOWS],
                         ids=["seeded", "inputs", "input-windows"])
def test_rollouts_on_workers_with_verified_deltas(tmp_path, logra):
    """Two rollout workers generate the training batches and stay bitwise equal to the trainer
    (with fitted projections, which the first delta carries, and with windows the first of
    each window)."""
    model, tok = _policy()
    cfg = _config(tmp_path, updates=3, rollout_workers=2, logra=logra)
    trainer = RLTrainer(cfg, model=model, tokenizer=tok, task=VowelTask(), progress=False)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["rollout_workers_live"] for r in train] == [2, 2, 2]
    assert all(r["sync_bytes"] > 0 for r in train)
    assert [r["resyncs"] for r in train] == [0, 0, 0]  # every update arrived as a delta, none as full weights
    # rollouts came from workers holding the trainer's policy: sampling and training log-probs agree
    assert all(r["mismatch_kl"] < 1e-6 for r in train)
    sync = [r for r in rows if r["kind"] == "sync"][-1]
    assert set(sync["workers"].values()) == {sync["trainer"]}
    with pytest.raises(ValueError, match="rollout_workers"):
        RLConfig(rollout_workers=1, optimizer="adamw")


class _RecordingTrainer(RLTrainer):
    """An `RLTrainer` that keeps the rollout of every update (``rollouts``)."""

    def __init__(self, *args, **kwargs):
        self.rollouts = []
        super().__init__(*args, **kwargs)

    def _rollout(self, problems):
        problems, rollout = super()._rollout(problems)
        self.rollouts.append(rollout)
        return problems, rollout


def test_rollout_workers_sample_the_configured_nucleus(tmp_path):
    """``top_p`` reaches the rollout workers: every token of the first update's responses lies
    in the nucleus of the starting policy (its tokens ranked above hold < top_p of the mass),
    and the recorded log-probs are the full tempered distribution's."""
    model, tok = _policy()
    start = copy.deepcopy(model).eval()
    cfg = _config(tmp_path, updates=1, rollout_workers=1, top_p=0.1, temperature=0.8)
    trainer = _RecordingTrainer(cfg, model=model, tokenizer=tok, task=VowelTask(), progress=False)
    trainer.train()
    r = trainer.rollouts[0]
    with torch.no_grad():
        logp = (start(input_ids=r.input_ids, attention_mask=r.attention_mask).logits[:, :-1] / 0.8).log_softmax(-1)
    tokens, mask = r.input_ids[:, 1:, None], r.response_mask[:, 1:].bool()
    probs, picked = logp.exp(), logp.exp().gather(-1, tokens)
    mass_above = (probs * (probs > picked)).sum(-1)[mask]
    assert mass_above.numel() >= 16 and mass_above.max() < 0.1
    torch.testing.assert_close(r.logprobs[:, 1:][mask], logp.gather(-1, tokens)[..., 0][mask], rtol=1e-4, atol=1e-4)


def test_logged_entropy_estimates_the_sampling_policys_per_token_entropy(tmp_path):
    """``entropy`` (the mean −log π of the sampled tokens) against the exact entropy of the
    starting policy's tempered distribution at every response position of the same rollout:
    they differ by a mean of zero-mean terms, within four of its standard errors."""
    model, tok = _policy()
    start = copy.deepcopy(model).eval()
    cfg = _config(tmp_path, updates=1, prompts_per_update=16, micro_batch=64, temperature=0.8, seed=1)
    trainer = _RecordingTrainer(cfg, model=model, tokenizer=tok, task=VowelTask(), progress=False)
    logged = trainer.train_step()["entropy"]
    r = trainer.rollouts[0]
    with torch.no_grad():
        logp = (start(input_ids=r.input_ids, attention_mask=r.attention_mask).logits[:, :-1].double() / 0.8)
        logp = logp.log_softmax(-1)
    mask = r.response_mask[:, 1:].bool()
    exact = -(logp.exp() * logp).sum(-1)[mask]  # H at each response position
    surprise = -logp.gather(-1, r.input_ids[:, 1:, None])[..., 0][mask]
    noise = surprise - exact
    assert mask.sum() >= 100
    assert abs(logged - float(exact.mean())) <= 4 * float(noise.std() / noise.numel() ** 0.5) + 1e-6
    assert logged == pytest.approx(float(surprise.mean()), rel=1e-5)


@pytest.mark.parametrize("non_target", ["freeze", "sketch"])
def test_chunked_logprobs_equal_full_logits_and_give_the_same_sketches(non_target):
    """Log-probs through the head chunk by chunk (checkpointed) = log-softmax of the full logits,
    and the sketches their backward fills equal those of the full-logits loss."""
    from logra import LoGRAOptimizer
    from logra.rl.rollout import token_logprobs

    torch.manual_seed(0)
    ids = torch.randint(3, 200, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    sketches, reference = [], None
    for chunk in (None, 7):
        model, _ = _policy()
        opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, non_target=non_target))
        if chunk is None:  # the reference: full logits, log-softmax, gather
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            logp = torch.nn.functional.pad(ref, (1, 0))
        else:
            logp = token_logprobs(model, ids, mask, temperature=0.7, chunk=chunk)
            torch.testing.assert_close(logp, reference, rtol=1e-5, atol=1e-6)
        reference = logp.detach()
        (logp * mask).sum().backward()
        sketches.append({n: s.clone() for n, s in opt.sketches().items()})
    assert sketches[0].keys() == sketches[1].keys()
    for name, full in sketches[0].items():  # equal up to float rounding: relative Frobenius error
        assert float(torch.linalg.vector_norm(sketches[1][name] - full)) <= 1e-5 * float(torch.linalg.vector_norm(full))


def test_rollout_logprobs_are_the_tempered_policys_at_every_response_token():
    """The log-probs a rollout records (step by step, left-padded prompts of several lengths)
    equal log-softmax(logits / T) of a full forward pass over each unpadded sequence."""
    from logra.rl.rollout import generate_rollouts

    model, tok = _policy()
    torch.manual_seed(3)
    rollout = generate_rollouts(model, tok, ["1 + 2 =", "10 + 20 + 30 =", "7 ="] * 3, temperature=0.7,
                                max_new_tokens=5, batch_size=4)
    checked = 0
    for i in range(len(rollout)):
        n = int(rollout.attention_mask[i].sum())
        ids = rollout.input_ids[i, :n][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
        resp = rollout.response_mask[i, 1:n].bool()
        torch.testing.assert_close(rollout.logprobs[i, 1:n][resp], expected[resp], rtol=1e-5, atol=1e-5)
        checked += int(resp.sum())
    assert checked > len(rollout)  # more than one token per response was compared


def test_logprobs_of_a_model_that_transforms_its_logits_are_the_models():
    """Gemma 2 soft-caps its logits after the head: the log-probs must be those of its logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from logra.rl.rollout import token_logprobs

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                       max_position_embeddings=32)
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(1, 64, (2, 9))
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(model, ids, mask, chunk=5)[:, 1:], expected, rtol=1e-5, atol=1e-6)


def test_reference_policy_is_the_initial_plain_model(tmp_path):
    """With a reference-KL penalty the reference is a frozen copy of the initial policy, without sketches."""
    model, tok = _policy()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = RLTrainer(_config(tmp_path, ref_kl_coef=0.1, updates=1), model=model, tokenizer=tok, task=VowelTask(),
                        progress=False)
    record = trainer.train_step()
    assert math.isfinite(record["loss"])
    ref = trainer.reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in initial.items())
    assert any(not torch.equal(trainer.model.state_dict()[k], v) for k, v in initial.items())
    assert not any(hasattr(m, "_logra_target") for m in trainer.reference.modules())
    assert all(not p.requires_grad for p in trainer.reference.parameters())


@pytest.mark.parametrize("optimizer", ["adamw", "lora"])
@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_baseline_learning_rate_follows_its_schedule(tmp_path, optimizer, schedule):
    if optimizer == "lora":
        pytest.importorskip("peft")
    from logra.rl.build import build_optimizer

    updates, lr = 6, 3e-3
    model, _ = _policy()
    _, opt, scheduler = build_optimizer(_config(tmp_path, optimizer=optimizer, lr=lr, updates=updates,
                                                lr_schedule=schedule), model)
    seen = []
    for _ in range(updates + 1):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    expected = [lr if schedule == "constant" else lr * 0.5 * (1 + math.cos(math.pi * k / updates))
                for k in range(updates + 1)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert (seen[-1] == 0.0) == (schedule == "cosine")


def test_lora_adapters_are_drawn_from_the_run_seed(tmp_path):
    """One command, one start: LoRA's adapters depend on ``seed`` only, not on the state torch's
    global generator happens to be in (torch seeds it afresh in every process)."""
    pytest.importorskip("peft")
    from logra.rl.build import build_optimizer

    def adapters(seed: int, global_seed: int) -> dict[str, torch.Tensor]:
        policy = _policy()[0]
        torch.manual_seed(global_seed)  # another process's generator
        model = build_optimizer(_config(tmp_path, optimizer="lora", seed=seed), policy)[0]
        after = torch.rand(1)  # the global generator is left where it was
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(1))
        return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n}

    first, other_process, other_seed = adapters(0, 1), adapters(0, 2), adapters(1, 1)
    assert first and first.keys() == other_process.keys()
    assert all(torch.equal(first[n], other_process[n]) for n in first)
    assert not any(torch.equal(first[n], other_seed[n]) for n in first)


def test_dense_step_on_a_model_loaded_by_from_pretrained(tmp_path):
    """transformers 5.x loads with hub kernels on and re-kernelizes on every train/eval switch,
    reading the device from the parameters; the KL guard's probe of a dense step (every
    parameter swapped out) must not switch modes there."""
    from transformers import AutoModelForCausalLM

    model, tok = _policy()
    model.save_pretrained(tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32)
    start = {n: p.detach().clone() for n, p in loaded.named_parameters()}
    trainer = RLTrainer(_config(tmp_path, optimizer="adamw", updates=1), model=loaded, tokenizer=tok,
                        task=VowelTask(), progress=False)
    trainer.train()
    assert any(not torch.equal(start[n], p) for n, p in trainer.model.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if r["kind"] == "train"]
    assert math.isfinite(step["guard_kl"]) and step["guard_kl"] > 0
