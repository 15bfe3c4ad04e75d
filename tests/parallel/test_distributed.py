"""Data-parallel and row-sharded LoGRA over gloo (2 local processes) vs one process."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import fit_if_needed, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer, apply_delta
from logra.parallel import (
    ProjectionMismatchError,
    RankMismatchError,
    RowShardedLoGRA,
    allreduce_bytes,
    allreduce_sketches,
    count_loss_tokens,
    global_token_count,
    init_local,
    spawn_local,
    verify_projections,
    verify_weights,
)
from logra.projection import stable_name

UPDATES = 5
GLOBAL_BATCH = 4
CONFIGS = {
    "freeze": LoGRAConfig(rank=4),
    "adamw": LoGRAConfig(rank=4, non_target="adamw", non_target_lr=1e-3),
    "lr_mode": LoGRAConfig(rank=4, update_ratio=None, lr=1e-2, weight_decay=0.1, optimizer="sgd"),
    # per-layer trust ratios need each full weight's norm: row sharding supplies them reduced over
    # ranks (equal up to float rounding, so fp32 factors: a bf16 rounding would flip on it)
    "layer": LoGRAConfig(rank=4, trust_ratio="layer", update_ratio=1e-3, factor_dtype="float32"),
    "element": LoGRAConfig(rank=4, trust_ratio="element", update_ratio=1e-3, beta1=0.9, refresh_every=2,
                           factor_dtype="float32"),
    # projections fitted to the inputs, through the sharded model's forward
    "inputs": LoGRAConfig(rank=4, distribution="inputs", refresh=False),
    # re-fitted at updates 2 and 4 (every rank on the same batch), the first moment carried
    "input_windows": LoGRAConfig(rank=4, distribution="inputs", refresh_every=2, beta1=0.9),
}
PRELOAD = ["torch", "torch.distributed", "transformers.models.qwen2.modeling_qwen2", "logra", "logra.parallel",
           "conftest", "test_distributed"]


def _batches(step: int) -> dict[str, torch.Tensor]:
    return token_batch(97, batch=GLOBAL_BATCH, length=12, seed=100 + step)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {stable_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _reference(config: LoGRAConfig) -> dict[str, torch.Tensor]:
    """One process, the whole global batch per update."""
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, config)
    for step in range(UPDATES):
        fit_if_needed(model, opt)  # before the first update, and each refresh window's
        batch = _batches(step)
        n = count_loss_tokens(batch["labels"])
        model(**batch, num_items_in_batch=n).loss.backward()
        opt.step()
        opt.zero_grad()
    return _state(model)


# ------------------------------------------------------------------ rank processes
def _dp_train(rank: int, world: int, config: LoGRAConfig, counts: dict[str, int]) -> dict[str, torch.Tensor]:
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, config)
    fit_if_needed(model, opt)  # every rank fits on the same batch
    verify_projections(opt)
    per_rank = GLOBAL_BATCH // world
    for step in range(UPDATES):
        fit_if_needed(model, opt)
        batch = _batches(step)
        mine = {k: v[rank * per_rank: (rank + 1) * per_rank] for k, v in batch.items()}
        n = global_token_count(count_loss_tokens(mine["labels"]))
        for i in range(per_rank):  # micro-batches of one sequence: accumulation across them too
            micro = {k: v[i: i + 1] for k, v in mine.items()}
            model(**micro, num_items_in_batch=n).loss.backward()
        calls = 0
        real = dist.all_reduce

        def counting(*a, _real=real, **k):
            nonlocal calls
            calls += 1
            return _real(*a, **k)

        dist.all_reduce = counting
        try:
            allreduce_sketches(opt)
        finally:
            dist.all_reduce = real
        counts[f"collectives_{step}"] = calls
        opt.step()
        opt.zero_grad()
    return _state(model)


def _fsdp_train(rank: int, world: int, name: str, out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    config = CONFIGS[name]
    model = tiny_qwen2()
    for p in model.parameters():
        p.requires_grad_(False)  # paper default (non_target='freeze'): frozen before sharding
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = LoGRAOptimizer(model, config)
    sharded = RowShardedLoGRA(opt)
    fit_if_needed(model, opt)
    verify_projections(opt)
    shard_rows = {n: sharded.rows(n) for n in opt.targets}
    receiver = tiny_qwen2()  # a plain copy that only sees the published deltas
    per_rank = GLOBAL_BATCH // world
    for step in range(UPDATES):
        fit_if_needed(model, opt)
        batch = _batches(step)
        mine = {k: v[rank * per_rank: (rank + 1) * per_rank] for k, v in batch.items()}
        n = global_token_count(count_loss_tokens(mine["labels"]))
        model(**mine, num_items_in_batch=n).loss.backward()
        allreduce_sketches(opt)
        delta = sharded.step()
        apply_delta(receiver, delta, config)
        opt.zero_grad()
    full = {stable_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}
    torch.save({"receiver": _state(receiver), "rows": {k: (s.start, s.stop) for k, s in shard_rows.items()}},
               out / f"fsdp_extra_{name}_{rank}.pt")
    return full


def _mismatch(rank: int, which: str) -> str:
    cfg = LoGRAConfig(rank=4, seed=43 if (which == "seed" and rank == 1) else 42)
    opt = LoGRAOptimizer(tiny_qwen2(), cfg)
    if which == "layer" and rank == 1:
        opt.sketch_target(opt.targets[2]).stored_projection.neg_()  # one layer's differs on rank 1 only
    try:
        verify_projections(opt)
    except ProjectionMismatchError as e:
        return str(e)
    return ""


def _weights_mismatch(rank: int) -> str:
    """verify_weights on equal models, then with one parameter differing on rank 1 only."""
    model = tiny_qwen2()
    verify_weights(model)  # equal: no error
    if rank == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-6
    try:
        verify_weights(model)
    except RankMismatchError as e:
        return str(e)
    return ""


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    out = Path(out)
    init_local(rank, world, store, backend="gloo")
    try:
        results: dict[str, object] = {}
        counts: dict[str, int] = {}
        for name in ("freeze", "adamw"):
            results[f"dp_{name}"] = _dp_train(rank, world, CONFIGS[name], counts)
            results[f"counts_{name}"] = dict(counts)
        for name in ("freeze", "lr_mode", "layer", "element", "inputs", "input_windows"):
            results[f"fsdp_{name}"] = _fsdp_train(rank, world, name, out)
        results["mismatch_seed"] = _mismatch(rank, "seed")
        results["mismatch_layer"] = _mismatch(rank, "layer")
        results["mismatch_weights"] = _weights_mismatch(rank)
        torch.save(results, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist")
    codes = spawn_local(_rank_main, 2, (str(out),), timeout=120, start_method="forkserver", preload=PRELOAD)
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(errors)
    return [torch.load(out / f"rank{r}.pt") | {"dir": out} for r in range(2)]


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-7) -> None:
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("mode", ["freeze", "adamw"])
def test_data_parallel_matches_single_process(ranks, mode):
    ref = _reference(CONFIGS[mode])
    start = _state(tiny_qwen2())
    # k_proj biases have an exactly-zero gradient in exact arithmetic (softmax is invariant
    # to a per-query constant); AdamW normalises their float noise into steps of size ~lr,
    # so with AdamW they agree to an absolute 1e-6 (lr 1e-3), not to rounding.
    atol = 1e-6 if mode == "adamw" else 1e-7
    for r in ranks:
        _assert_close(r[f"dp_{mode}"], ref, atol)
    # Training moved the weights (else the comparison would be vacuous); the ranks agree bitwise.
    changed = [n for n in ref if not torch.equal(ref[n], start[n])]
    assert any("q_proj" in n for n in changed)
    assert (mode == "adamw") == any("norm" in n for n in changed)
    for name, w in ranks[0][f"dp_{mode}"].items():
        assert torch.equal(w, ranks[1][f"dp_{mode}"][name])


@pytest.mark.parametrize("mode", ["freeze", "adamw"])
def test_one_collective_per_update(ranks, mode):
    counts = ranks[0][f"counts_{mode}"]
    assert [counts[f"collectives_{s}"] for s in range(UPDATES)] == [1 if mode == "freeze" else 2] * UPDATES


@pytest.mark.parametrize("mode", ["freeze", "lr_mode", "layer", "element", "inputs", "input_windows"])
def test_row_sharded_fsdp2_matches_single_process(ranks, mode):
    ref = _reference(CONFIGS[mode])
    for r in ranks:
        _assert_close(r[f"fsdp_{mode}"], ref)
    out = ranks[0]["dir"]
    extras = [torch.load(out / f"fsdp_extra_{mode}_{r}.pt") for r in range(2)]
    # Each rank held half of the rows; the published full deltas rebuild the same weights.
    assert extras[0]["rows"]["model.layers.0.mlp.up_proj.weight"] == (0, 36)
    assert extras[1]["rows"]["model.layers.0.mlp.up_proj.weight"] == (36, 72)
    _assert_close(extras[0]["receiver"], ranks[0][f"fsdp_{mode}"])


def test_verify_projections_names_first_differing_layer(ranks):
    model = tiny_qwen2()
    targets = LoGRAOptimizer(model, LoGRAConfig(rank=4)).targets
    for r in ranks:
        assert "rank 1 has sync=" in r["mismatch_seed"] and "'seed': 43" in r["mismatch_seed"]
        assert repr(targets[2]) in r["mismatch_layer"] and "first differing layer" in r["mismatch_layer"]
        assert repr(targets[0]) not in r["mismatch_layer"]


def test_verify_weights_names_first_differing_parameter(ranks):
    for r in ranks:  # every rank raises the same error, so none is left waiting in a collective
        assert r["mismatch_weights"].startswith("rank 1 starts from other weights than rank 0")
        assert "'model.layers.1.mlp.up_proj.weight'" in r["mismatch_weights"]


def test_allreduce_bytes():
    model = tiny_qwen2()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4))
    sketch, dense = allreduce_bytes(opt)
    weights = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    assert sketch == sum(w.shape[0] for w in weights) * 4 * 4
    assert dense == sum(w.numel() for w in weights) * 4
    opt = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4, non_target="adamw"))
    extra = sum(p.numel() for p in opt.dense_parameters()) * 4
    assert allreduce_bytes(opt) == (sketch + extra, dense + extra)


def test_single_process_helpers_are_noops():
    assert not dist.is_initialized()
    assert global_token_count(17) == 17
    opt = LoGRAOptimizer(tiny_qwen2(), LoGRAConfig(rank=4))
    opt.sketch_buffer.fill_(1.0)
    allreduce_sketches(opt)
    verify_projections(opt)
    assert torch.equal(opt.sketch_buffer, torch.ones_like(opt.sketch_buffer))
    assert count_loss_tokens(torch.tensor([[5, 6, -100, 7]])) == 2
