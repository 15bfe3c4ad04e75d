"""Data parallelism equals one process over random `LoGRAConfig` options (the property of
``tests/test_properties.py`` that needs two processes)."""

from __future__ import annotations

import random
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_distributed import PRELOAD, _assert_close, _dp_train, _reference

from logra.parallel import init_local, spawn_local
from test_properties import random_config

CASES = [3, 8, 11]  # 8 fits its projections to the inputs


def _config(case: int):
    return random_config(random.Random(1000 + case))


def _rank_main(rank: int, world: int, store: str, out: str, case: int) -> None:
    torch.set_num_threads(1)
    init_local(rank, world, store, backend="gloo")
    try:
        state = _dp_train(rank, world, _config(case), {})
        torch.save(state, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES)
def test_data_parallel_matches_one_process_for_random_options(tmp_path, case):
    codes = spawn_local(_rank_main, 2, (str(tmp_path), case), timeout=180, start_method="forkserver",
                        preload=[*PRELOAD, "test_properties", "test_properties_dp"])
    errors = [f.read_text() for f in sorted(tmp_path.glob("error*.txt"))]
    assert codes == [0, 0], f"{_config(case)}: exit codes {codes}\n" + "\n".join(errors)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref = _reference(_config(case))
    for r in ranks:
        _assert_close(r, ref)
