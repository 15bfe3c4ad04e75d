"""LoGRA's first moment and input-channel column scales under data parallelism: equal to
one process, one all-reduce per update."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import PRELOAD, _assert_close, _dp_train, _reference

from logra import LoGRAConfig
from logra.parallel import init_local, spawn_local

# ---------------------------------------------------------------- data parallelism
CONFIGS = {
    "momentum": LoGRAConfig(rank=4, beta1=0.9, refresh_every=2),
    # the summed input statistics ride in the sketch buffer's all-reduce
    "column_scale": LoGRAConfig(rank=4, beta1=0.9, refresh_every=2, column_scale="input"),
    "element_adam": LoGRAConfig(rank=4, beta1=0.9, refresh_every=2, optimizer="adam", trust_ratio="element",
                                share_projections=True),
}


def _rank_main(rank: int, world: int, store: str, out: str, name: str) -> None:
    torch.set_num_threads(1)
    out = Path(out)
    init_local(rank, world, store, backend="gloo")
    try:
        counts: dict[str, int] = {}
        state = _dp_train(rank, world, CONFIGS[name], counts)
        torch.save({"state": state, "counts": counts}, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_data_parallel_matches_single_process(tmp_path, name):
    codes = spawn_local(_rank_main, 2, (str(tmp_path), name), timeout=120, start_method="forkserver",
                        preload=[*PRELOAD, "test_momentum_dp"])
    errors = [f.read_text() for f in sorted(tmp_path.glob("error*.txt"))]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(errors)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = _reference(CONFIGS[name])
    for r in ranks:
        _assert_close(r["state"], ref)
        assert set(r["counts"].values()) == {1}  # still one all-reduce (of the sketches) per update
    for name, w in ranks[0]["state"].items():
        assert torch.equal(w, ranks[1]["state"][name])
