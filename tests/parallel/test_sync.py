"""Trainer → rollout-worker policy sync over gloo: deltas, gaps, resyncs, handshake, dead workers."""

from __future__ import annotations

import json
import os
import signal
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import fit_if_needed, tiny_llama, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer, PolicyDelta, apply_delta, policy_step, weights_checksum
from logra.parallel import (
    HandshakeError,
    NoWorkersLeftError,
    PolicyIdentity,
    PolicyPublisher,
    RolloutWorker,
    SyncTestHooks,
    decode_full_weights,
    encode_full_weights,
    init_local,
    load_full_weights,
    spawn_local,
)
from logra.projection import stable_name

PRELOAD = ["torch", "torch.distributed", "transformers.models.qwen2.modeling_qwen2", "logra", "logra.parallel",
           "conftest", "test_sync"]
FAULTY = LoGRAConfig(rank=4, non_target="sketch", non_target_lr=1e-3)  # embeddings sketched, norms/biases AdamW
FROZEN = LoGRAConfig(rank=4)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {stable_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _train_step(model, opt, step: int) -> PolicyDelta:
    model(**token_batch(model.config.vocab_size, seed=1000 + step)).loss.backward()
    delta = opt.apply(opt.propose())
    opt.zero_grad()
    return delta


def _guard(out: Path, rank: int, fn) -> None:
    """Run ``fn`` in a rank process; leave a traceback file behind on failure."""
    torch.set_num_threads(1)
    try:
        fn()
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(rank: int, config: LoGRAConfig, out: Path, model=None, die_after: int | None = None) -> None:
    model = model if model is not None else tiny_qwen2()
    worker = RolloutWorker(model, config, trainer_rank=0, timeout=60)
    try:
        worker.connect()
    except HandshakeError as e:
        (out / f"refused{rank}.json").write_text(json.dumps({"message": str(e), "field": e.field}))
        return
    while worker.receive() != "shutdown":
        if die_after is not None and worker.step > die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no goodbye, no cleanup
    torch.save({"state": _state(model), "step": worker.step, "events": worker.events}, out / f"worker{rank}.pt")


# ------------------------------------------------------------------ 30 updates, faults injected
def _faults_main(rank: int, world: int, store: str, out: str) -> None:
    out = Path(out)

    def body() -> None:
        init_local(rank, world, store, backend="gloo")
        if rank != 0:
            # Worker 2 starts from other random weights: the handshake must fix that with a full sync.
            _serve(rank, FAULTY, out, model=tiny_qwen2(seed=0 if rank == 1 else 5))
            return
        model = tiny_qwen2()
        opt = LoGRAOptimizer(model, FAULTY)
        hooks = SyncTestHooks(drop={1: {7}}, corrupt={2: {12}}, delay={2: {20}})
        pub = PolicyPublisher(model, FAULTY, [1, 2], optimizer=opt, timeout=60, test_hooks=hooks)
        reports = []
        for step in range(30):
            delta = _train_step(model, opt, step)
            reports.append(pub.publish(delta, mode="full" if step == 25 else "delta"))
        prompts = [[5, 9, 11], [7, 3], [12, 14, 15, 16], [8]]
        rollouts = pub.generate(prompts, max_new_tokens=6, temperature=1.0, seed=3)
        nucleus = pub.generate(prompts * 2, max_new_tokens=6, temperature=0.7, seed=3, top_p=0.3)
        model.eval()
        teacher, ranks = [], []
        with torch.no_grad():
            for r, t in [(r, 1.0) for r in rollouts] + [(r, 0.7) for r in nucleus]:
                ids = torch.tensor([r.prompt_ids + r.response_ids])
                logp = (model(input_ids=ids).logits[0] / t).log_softmax(-1)
                n = len(r.prompt_ids)
                teacher.append(logp[n - 1: -1].gather(1, ids[0, n:, None])[:, 0].tolist())
                # each sampled token's place in the nucleus order: the mass of the tokens above it
                probs = logp[n - 1: -1].exp()
                picked = probs.gather(1, ids[0, n:, None])
                ranks.extend((probs * (probs > picked)).sum(1).tolist())
        result = {
            "outcomes": [(r.step, r.mode, r.outcome, r.payload_bytes) for r in reports],
            "worker_checksums": pub.checksums(),
            "trainer_checksum": weights_checksum(model),
            "resyncs": {r: w.resyncs for r, w in pub.workers.items()},
            "rollouts": [(r.worker, r.policy_step, r.response_ids, r.logprobs) for r in rollouts + nucleus],
            "teacher": teacher,
            "mass_above": ranks,
            "state": _state(model),
            "dense_names": pub.dense_names,
        }
        pub.close()
        torch.save(result, out / "trainer.pt")

    _guard(out, rank, body)


@pytest.fixture(scope="module")
def faults_run(tmp_path_factory) -> tuple[dict, list[dict]]:
    out = tmp_path_factory.mktemp("sync_faults")
    codes = spawn_local(_faults_main, 3, (str(out),), timeout=90, start_method="forkserver", preload=PRELOAD)
    errors = "\n".join(f.read_text() for f in sorted(out.glob("error*.txt")))
    assert codes == [0, 0, 0], f"exit codes {codes}\n{errors}"
    return torch.load(out / "trainer.pt"), [torch.load(out / f"worker{r}.pt") for r in (1, 2)]


def test_thirty_updates_workers_bitwise_identical(faults_run):
    trainer, workers = faults_run
    for w in workers:
        assert w["step"] == 30
        assert set(w["state"]) == set(trainer["state"])
        for name, value in trainer["state"].items():
            assert torch.equal(w["state"][name], value), name
    assert trainer["worker_checksums"] == {1: trainer["trainer_checksum"], 2: trainer["trainer_checksum"]}
    # Weights really moved, densely trained parameters included (they ride along with the deltas).
    start = _state(tiny_qwen2())
    assert not torch.equal(trainer["state"]["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(trainer["state"]["model.norm.weight"], start["model.norm.weight"])
    assert "model.norm.weight" in trainer["dense_names"]


def test_dropped_delta_is_detected_and_resynced(faults_run):
    trainer, workers = faults_run
    outcomes = {step: outcome for step, _, outcome, _ in trainer["outcomes"]}
    assert outcomes[7][1] == "dropped (test hook)"
    assert outcomes[8][1].startswith("resynced: gap: holds the policy after 7 updates, got update 8")
    assert any(e.startswith("update 8: resync (gap") for e in workers[0]["events"])
    # Every other update reached worker 1 as a low-rank delta.
    assert all(outcomes[s][1] == "applied" for s in range(30) if s not in (7, 8, 25))


def test_corrupted_and_reordered_deltas_are_resynced(faults_run):
    trainer, workers = faults_run
    outcomes = {step: outcome for step, _, outcome, _ in trainer["outcomes"]}
    assert outcomes[12][2].startswith("resynced: checksum mismatch after update 12")
    assert outcomes[20][2] == "delayed (test hook)"
    # Update 21 arrives before the held-back 20: a gap, then the late 20 is applied, then the resync.
    assert outcomes[21][2].startswith("resynced: gap: holds the policy after 20 updates, got update 21")
    # Worker 2 started with other weights: a full sync at handshake, then 12 and 21.
    assert trainer["resyncs"] == {1: 1, 2: 3}


def test_full_mode_and_delta_sizes(faults_run):
    trainer, _ = faults_run
    by_step = {step: (mode, outcome, nbytes) for step, mode, outcome, nbytes in trainer["outcomes"]}
    mode, outcome, full_bytes = by_step[25]
    assert mode == "full" and outcome == {1: "resynced", 2: "resynced"}
    delta_bytes = by_step[24][2]
    assert delta_bytes < full_bytes / 4


def test_generate_through_workers(faults_run):
    trainer, _ = faults_run
    workers = {w for w, *_ in trainer["rollouts"]}
    assert workers == {1, 2}
    for (_, step, response, logprobs), teacher in zip(trainer["rollouts"], trainer["teacher"], strict=True):
        assert step == 30 and 1 <= len(response) <= 6
        # the full tempered distribution's log-probs, also where sampling was truncated (top_p)
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(teacher), rtol=1e-4, atol=1e-4)
    # top_p 0.3: every sampled token lies in the nucleus, the smallest set of tokens holding
    # 0.3 of the mass (the tokens ranked above it hold less than 0.3)
    nucleus_tokens = trainer["mass_above"][sum(len(r[2]) for r in trainer["rollouts"][:4]):]
    assert len(nucleus_tokens) >= 8 and max(nucleus_tokens) < 0.3


# ------------------------------------------------------------------ refusal and dead workers
def _lifecycle_main(rank: int, world: int, store: str, out: str) -> None:
    out = Path(out)

    def body() -> None:
        init_local(rank, world, store, backend="gloo")
        if rank == 1:
            _serve(rank, FROZEN, out, die_after=3)
        elif rank == 2:
            _serve(rank, FROZEN, out, die_after=8)
        elif rank == 3:
            _serve(rank, LoGRAConfig(rank=8), out)  # other LoGRA rank: must be refused
        if rank != 0:
            return
        model = tiny_qwen2()
        opt = LoGRAOptimizer(model, FROZEN)
        pub = PolicyPublisher(model, FROZEN, [1, 2, 3], optimizer=opt, timeout=30)
        result = {"refused": pub.refused, "live_after_handshake": pub.live, "outcomes": {}}
        for step in range(20):
            delta = _train_step(model, opt, step)
            before = _state(model)
            try:
                result["outcomes"][step] = pub.publish(delta).outcome
            except NoWorkersLeftError as e:
                result["stopped_at"] = step
                result["stop_message"] = str(e)
                result["state_kept"] = all(torch.equal(v, _state(model)[k]) for k, v in before.items())
                result["num_updates"] = opt.num_updates
                break
            if step == 6:
                result["checksums_at_6"] = (pub.checksums(), weights_checksum(model))
        result["lost"] = pub.lost
        # The trainer is unharmed: it can keep training without workers.
        _train_step(model, opt, 99)
        result["num_updates_after"] = opt.num_updates
        torch.save(result, out / "trainer.pt")

    _guard(out, rank, body)


def test_handshake_refusal_and_dead_workers(tmp_path):
    codes = spawn_local(_lifecycle_main, 4, (str(tmp_path),), timeout=90, start_method="forkserver", preload=PRELOAD)
    errors = "\n".join(f.read_text() for f in sorted(tmp_path.glob("error*.txt")))
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL, 0], f"exit codes {codes}\n{errors}"
    result = torch.load(tmp_path / "trainer.pt")
    refusal = json.loads((tmp_path / "refused3.json").read_text())
    assert refusal["field"] == "config.rank"
    assert "'rank' differs: trainer has 4, worker has 8" in refusal["message"]
    assert result["refused"] == {3: "LoGRA config field 'rank' differs: trainer has 4, worker has 8"}
    assert result["live_after_handshake"] == [1, 2]
    # Worker 1 dies after update 3; updates 4.. go on with worker 2 alone, which stays exact.
    assert set(result["outcomes"][3]) == {1, 2}
    assert result["outcomes"][4][1].startswith("lost:") and result["outcomes"][4][2] == "applied"
    assert result["outcomes"][6] == {2: "applied"}
    worker_sums, trainer_sum = result["checksums_at_6"]
    assert worker_sums == {2: trainer_sum}
    # Worker 2 dies after update 8: the next publish stops the run cleanly, trainer state intact.
    assert result["stopped_at"] == 9
    assert "no rollout worker left after update 9" in result["stop_message"]
    assert result["state_kept"] and result["num_updates"] == 10 and result["num_updates_after"] == 11
    assert set(result["lost"]) == {1, 2}


# ------------------------------------------------------------------ fitted projections and resyncs
FITTED = LoGRAConfig(rank=4, distribution="inputs", refresh=False)


def _fitted_main(rank: int, world: int, store: str, out: str) -> None:
    out = Path(out)

    def body() -> None:
        init_local(rank, world, store, backend="gloo")
        if rank != 0:
            _serve(rank, FITTED, out)
            return
        model = tiny_qwen2()
        opt = LoGRAOptimizer(model, FITTED)
        fit_if_needed(model, opt)
        # The first delta, the only one that carries the fitted projections, never reaches the worker.
        pub = PolicyPublisher(model, FITTED, [1], optimizer=opt, timeout=60, test_hooks=SyncTestHooks(drop={1: {0}}))
        outcomes = [pub.publish(_train_step(model, opt, step)).outcome[1] for step in range(6)]
        torch.save({"outcomes": outcomes, "resyncs": pub.workers[1].resyncs, "state": _state(model)},
                   out / "trainer.pt")
        pub.close()

    _guard(out, rank, body)


def test_a_resync_hands_a_worker_the_fitted_projections_it_missed(tmp_path):
    """A worker that lost the stream's first delta is resynced with the weights and the fitted
    projections, so later updates arrive as deltas again (not one full resync per update)."""
    codes = spawn_local(_fitted_main, 2, (str(tmp_path),), timeout=90, start_method="forkserver", preload=PRELOAD)
    errors = "\n".join(f.read_text() for f in sorted(tmp_path.glob("error*.txt")))
    assert codes == [0, 0], f"exit codes {codes}\n{errors}"
    trainer, worker = torch.load(tmp_path / "trainer.pt"), torch.load(tmp_path / "worker1.pt")
    assert trainer["outcomes"][:2] == ["dropped (test hook)",
                                       "resynced: gap: holds the policy after 0 updates, got update 1"]
    assert trainer["outcomes"][2:] == ["applied"] * 4 and trainer["resyncs"] == 1
    assert worker["step"] == 6 and all(torch.equal(worker["state"][n], v) for n, v in trainer["state"].items())


# ------------------------------------------------------------------ in-process pieces
def test_identity_mismatch_names_the_field():
    trainer = PolicyIdentity.of(tiny_qwen2(), FROZEN)
    assert trainer.mismatch(PolicyIdentity.of(tiny_qwen2(seed=3), FROZEN)) is None  # weights: resync, not refusal
    field, msg = trainer.mismatch(PolicyIdentity.of(tiny_qwen2(), LoGRAConfig(rank=4, seed=7)))
    assert field == "config.seed" and "trainer has 42, worker has 7" in msg
    field, msg = trainer.mismatch(PolicyIdentity.of(tiny_qwen2(layers=3), FROZEN))
    assert field == "parameter names" and "'model.layers.2." in msg and "worker's model but not the trainer's" in msg
    field, msg = trainer.mismatch(PolicyIdentity.of(tiny_llama(), FROZEN))
    assert field == "parameter names"
    field, msg = trainer.mismatch(PolicyIdentity.of(tiny_qwen2(vocab=101), FROZEN))
    assert field == "shape of model.embed_tokens.weight" and "[97, 32]" in msg and "[101, 32]" in msg
    field, msg = trainer.mismatch(PolicyIdentity.of(tiny_qwen2().to(torch.bfloat16), FROZEN))
    assert field.startswith("dtype of ") and "bfloat16" in msg
    # Round trip through the wire format.
    assert PolicyIdentity.from_dict(json.loads(json.dumps(trainer.to_dict()))) == trainer


def test_full_weights_roundtrip_and_delta_checksum():
    src, dst = tiny_qwen2(tie=True), tiny_qwen2(tie=True, seed=9)
    load_full_weights(dst, decode_full_weights(encode_full_weights(src)))
    assert weights_checksum(dst) == weights_checksum(src)
    opt = LoGRAOptimizer(src, FROZEN)
    delta = _train_step(src, opt, 0)
    apply_delta(dst, delta, FROZEN)
    assert policy_step(dst) == 1
    assert weights_checksum(dst, sorted(delta.factors)) == weights_checksum(src, sorted(delta.factors))
