"""`LoGRAGRPOTrainer` under accelerate's data parallelism: 2 CPU processes (gloo) vs one.

Two ranks are spawned once (`logra.parallel.spawn_local`, a fork server that has already
imported TRL, a ``FileStore`` rendezvous: no ports). They set torchrun's environment
variables, so accelerate's own state finds the process group and runs as under
``accelerate launch`` on CPU (``DistributedType.MULTI_CPU``). Each rank trains
``STEPS`` GRPO steps with ``per_device_train_batch_size = GLOBAL // 2``; the reference is
one process with ``GLOBAL`` per device: the same global batch (TRL's sampler is seeded
alike and accelerate deals its batches out to the ranks in order).

Sampling would differ between the layouts (each rank draws from its own RNG), so the
completions come from a ``rollout_func`` that is a fixed function of the prompt and the
completion's index in its group: diverse within a group (non-zero advantages), identical
in both layouts. Everything after generation — rewards, advantages, TRL's loss, the
backward into the sketches, the reduction, the KL probe and the step — is TRL's and
LoGRA's real path. ``probe_responses`` covers a whole micro-batch, so the ranks' pooled
probes are exactly the single process's probe.
"""

from __future__ import annotations

import os
import random
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import torch.distributed as dist  # noqa: E402
from test_trl import BUDGET, _args, _dataset, digits, save_tiny_model  # noqa: E402

from logra import KLController, LoGRAConfig  # noqa: E402
from logra.integrations.trl import LoGRAGRPOTrainer  # noqa: E402
from logra.parallel import init_local, spawn_local  # noqa: E402

STEPS = 3
GLOBAL = 8  # completions per optimizer step: 2 prompts x 4 generations
WORLD = 2
MODES = ("freeze", "adamw")
STATS = ("reward", "grad_norm", "logra/sketch_norm", "logra/predicted_kl", "logra/alpha", "logra/realized_kl",
         "logra/update_norm")
PRELOAD = ["torch", "torch.distributed", "transformers", "datasets", "trl", "logra", "logra.parallel",
           "logra.integrations.trl", "test_trl", "test_trl_ddp"]


def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
    """Completions fixed by (prompt, index among equal prompts): the same under any process layout."""
    tok = trainer.processing_class
    seen: Counter[str] = Counter()
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        rng = random.Random(f"{prompt}|{seen[prompt]}")
        seen[prompt] += 1
        text = "".join(rng.choice("0123456789abcdef ") for _ in range(rng.randint(2, 6)))
        prompt_ids.append(tok(prompt, add_special_tokens=False)["input_ids"])
        completion_ids.append(tok(text, add_special_tokens=False)["input_ids"])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(c) for c in completion_ids]}


@contextmanager
def _count_sketch_allreduces(trainer: LoGRAGRPOTrainer, steps: list[int]) -> Iterator[None]:
    """Record the global step of every all-reduce of the sketch buffer."""
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        opt = trainer.logra_optimizer
        if opt is not None and tensor.data_ptr() == opt.sketch_buffer.data_ptr():
            steps.append(trainer.state.global_step)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = real


def _train(model_dir: Path, out: Path, world: int, non_target: str) -> dict[str, Any]:
    """``STEPS`` GRPO steps on this rank's share of the global batch; the final weights, TRL's
    logged step statistics and the global steps at which the sketch buffer was all-reduced."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL
    per_device = GLOBAL // world
    backend = {"ddp_backend": "gloo"} if world > 1 else {}
    trainer = LoGRAGRPOTrainer(
        model=str(model_dir), reward_funcs=digits, train_dataset=_dataset(), rollout_func=rollout,
        args=_args(out, max_steps=STEPS, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                   num_generations=4, **backend),
        logra_config=LoGRAConfig(rank=8, update_ratio=1e-2, non_target=non_target, non_target_lr=1e-3),
        kl_controller=KLController(budget=BUDGET, schedule="constant"), probe_responses=per_device,
    )
    reductions: list[int] = []
    with _count_sketch_allreduces(trainer, reductions):
        trainer.train()
    logs = [{k: h[k] for k in STATS} for h in trainer.state.log_history if "reward" in h]
    return {"weights": {k: v.clone() for k, v in trainer.model.state_dict().items()}, "logs": logs,
            "reductions": reductions, "targets": trainer.logra_optimizer.targets,
            "world": trainer.accelerator.num_processes, "type": trainer.accelerator.distributed_type.value,
            "wrapped": type(trainer.model_wrapped).__name__}


def _rank_main(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    # What torchrun / accelerate launch would set; the group itself comes from the FileStore.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    init_local(rank, world, store, backend="gloo")
    try:
        results = {mode: _train(Path(model_dir), Path(out) / f"{mode}{rank}", world, mode)
                   for mode in MODES}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_ddp")
    codes = spawn_local(_rank_main, WORLD, (str(model_dir), str(out)), timeout=300, start_method="forkserver",
                        preload=PRELOAD)
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    assert codes == [0] * WORLD, f"exit codes {codes}\n" + "\n".join(errors)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("trl_single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank; tiny matrices gain nothing from threads on a busy machine
    try:
        return {mode: _train(model_dir, out / mode, 1, mode) for mode in MODES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", MODES)
def test_ranks_run_under_accelerate_ddp_unwrapped(ranks, mode):
    """accelerate runs multi-CPU with 2 processes; the model is not wrapped in DDP (LoGRA reduces)."""
    for r in ranks:
        assert r[mode]["world"] == WORLD and r[mode]["type"] == "MULTI_CPU"
        assert r[mode]["wrapped"] == "Qwen2ForCausalLM"


@pytest.mark.parametrize("mode", MODES)
def test_one_sketch_allreduce_per_optimizer_step(ranks, mode):
    for r in ranks:
        assert r[mode]["reductions"] == list(range(STEPS))


@pytest.mark.parametrize("mode", MODES)
def test_ranks_stay_bitwise_identical(ranks, mode):
    first, second = ranks[0][mode], ranks[1][mode]
    assert first["logs"] == second["logs"]  # the same α, KL and norms on both ranks
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name


@pytest.mark.parametrize("mode", MODES)
def test_ranks_equal_one_process_on_the_global_batch(ranks, single, model_dir, mode):
    from transformers import Qwen2ForCausalLM

    initial = Qwen2ForCausalLM.from_pretrained(model_dir).state_dict()
    got, want = ranks[0][mode], single[mode]
    assert len(got["logs"]) == len(want["logs"]) == STEPS
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"], strict=True)):
        assert g["reward"] == w["reward"], step  # the same completions: the same global batch
        for key in STATS[1:]:  # averaged sketches (not summed: sketch_norm), pooled probe (alpha, KLs)
            assert g[key] == pytest.approx(w[key], rel=1e-5), (step, key)
    moved = 0
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, rtol=1e-5, atol=1e-7, msg=name)
        if name in initial and not torch.equal(value, initial[name]):
            moved += 1
            step_got, step_want = got["weights"][name] - initial[name], value - initial[name]
            torch.testing.assert_close(step_got, step_want, rtol=1e-3, atol=1e-3 * float(step_want.abs().max()),
                                       msg=name)
    trained = len(want["targets"]) if mode == "freeze" else len(want["targets"]) + 1
    assert moved >= trained  # targets (and, with 'adamw', the other parameters) trained
