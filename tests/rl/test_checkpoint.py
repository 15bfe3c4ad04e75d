"""Checkpoints (issue 20, item 5): atomic, verified on load, a damaged one refused in one line
naming the file, a finished run resumed again adds nothing; and a real `logra train` killed with
SIGKILL at random points ends, after `--resume`, with the weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import logra
from logra.errors import CheckpointError
from logra.rl.checkpoint import load_checkpoint, verify_checkpoint
from logra.rl.cli import main as train_main

# the embedded recipe on a shrunken tiny policy; a checkpoint after every update
TINY = ["--prompts_per_update", "2", "--responses_per_prompt", "2", "--eval_problems", "2", "--eval_every", "0",
        "--kl.probe_responses", "2", "--logra.rank", "4", "--threads", "1", "--quiet",
        "--tiny.sft_steps", "3", "--tiny.sft_batch_size", "4", "--tiny.num_demonstrations", "16",
        "--tiny.hidden_size", "32", "--tiny.intermediate_size", "64", "--tiny.num_layers", "2",
        "--train_pool", "0"]  # not the recipe's pool of 179 200 draws (~5 s to build)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 3-update run (kept pristine: tests damage copies)."""
    root = tmp_path_factory.mktemp("finished")
    cwd = os.getcwd()
    os.chdir(root)  # some reasoning-gym generators write scratch files to the working directory
    try:
        assert train_main([*TINY, "--updates", "3", "--checkpoint_every", "1", "--run_dir", str(root / "run"),
                           "--cache_dir", str(root / "cache")]) == 0
    finally:
        os.chdir(cwd)
    return root / "run"


@pytest.fixture
def run(finished, tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def _resume_refused(run: Path, name: str) -> str:
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as e:
        train_main(["--resume", str(run), "--quiet"])
    message = str(e.value)
    assert "\n" not in message and f"checkpoint/{name}" in message and "nothing was loaded" in message, message
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing changed
    return message


@pytest.mark.parametrize("name", ["state.pt", "model.safetensors", "config.json"])
def test_truncated_checkpoint_file_is_refused_in_one_line(run, name):
    file = run / "checkpoint" / name
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    assert "truncated" in _resume_refused(run, name)


@pytest.mark.parametrize("name", ["state.pt", "model.safetensors", "config.json"])
def test_missing_checkpoint_file_is_refused_in_one_line(run, name):
    (run / "checkpoint" / name).unlink()
    assert "is missing" in _resume_refused(run, name)


def test_weights_changed_on_disk_are_refused(run):
    """One projection scaled by 1.5: same size, other bytes; it used to resume silently."""
    file = run / "checkpoint" / "model.safetensors"
    tensors = load_file(file)
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, file, metadata=metadata)
    manifest = json.loads((run / "checkpoint" / "manifest.json").read_text())
    assert file.stat().st_size == manifest["files"]["model.safetensors"]["bytes"]  # only the digest tells
    assert "has changed since it was written" in _resume_refused(run, "model.safetensors")


def test_damaged_state_is_refused_before_the_model_changes(run):
    """In-process: a refused checkpoint leaves the model's weights and the RNG as they were."""
    from logra.rl.tiny import TinyPolicyConfig, build_tiny_policy

    model, _ = build_tiny_policy(TinyPolicyConfig(hidden_size=32, intermediate_size=64, num_layers=2))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    state = run / "checkpoint" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: size unchanged
    state.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"state.pt has changed since it was written") as e:
        load_checkpoint(run, model)
    assert e.value.path == state
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_resume_over_another_warm_start_keeps_the_record_and_refuses_a_kl_reference(tmp_path, monkeypatch):
    """The cache entry rebuilt between start and resume (here: one weight changed): the
    checkpoint still holds every weight, so a run without a KL reference resumes and its
    summary still names the weights it started from; one whose KL penalty takes the starting
    policy as its reference is refused before anything is loaded."""
    monkeypatch.chdir(tmp_path)
    runs = {"plain": [], "reference": ["--ref_kl_coef", "0.1"]}
    for name, extra in runs.items():
        assert train_main([*TINY, *extra, "--updates", "2", "--run_dir", str(tmp_path / name),
                           "--cache_dir", str(tmp_path / "cache")]) == 0
    started = json.loads((tmp_path / "plain" / "summary.json").read_text())["policy"]["checksum"]
    (entry,) = (tmp_path / "cache").iterdir()
    weights = load_file(entry / "model.safetensors")
    weights["model.norm.weight"] += 1.0
    save_file(weights, entry / "model.safetensors", metadata={"format": "pt"})

    assert train_main(["--resume", str(tmp_path / "plain"), "--updates", "3", "--quiet"]) == 0
    policy = json.loads((tmp_path / "plain" / "summary.json").read_text())["policy"]
    assert policy["checksum"] == started != logra.weights_checksum(weights)
    assert "started from weights" in _resume_refused(tmp_path / "reference", "state.pt")


def test_second_resume_of_a_finished_run_adds_no_evaluation(run):
    rows = _rows(run)
    assert [r["update"] for r in rows if r["kind"] == "eval"] == [0, 3]
    for _ in range(2):
        assert train_main(["--resume", str(run), "--quiet"]) == 0
        assert _rows(run) == rows


def test_a_kill_between_the_two_renames_leaves_the_previous_checkpoint(run):
    """The state a kill inside the swap leaves: `checkpoint.old` complete, `checkpoint.tmp` half
    written, no `checkpoint`. Resume continues from `checkpoint.old`; the next save tidies up."""
    ckpt = run / "checkpoint"
    os.replace(ckpt, run / "checkpoint.old")
    (run / "checkpoint.tmp").mkdir()
    (run / "checkpoint.tmp" / "model.safetensors").write_bytes(b"half")
    assert train_main(["--resume", str(run), "--updates", "4", "--quiet"]) == 0
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    assert verify_checkpoint(ckpt)["update"] == 4
    assert [r["update"] for r in _rows(run) if r["kind"] == "train"] == [0, 1, 2, 3]


def test_a_checkpoint_without_manifest_still_loads_with_a_warning(run):
    """Checkpoints written before manifests existed stay resumable."""
    (run / "checkpoint" / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="has no manifest.json"):
        assert train_main(["--resume", str(run), "--updates", "4", "--quiet"]) == 0
    assert [r["update"] for r in _rows(run) if r["kind"] == "train"] == [0, 1, 2, 3]


# ---------------------------------------------------------------- SIGKILL at random points
UPDATES = 20


def _train(run: Path, cache: Path, resume: bool) -> subprocess.Popen:
    """`logra train` in its own process, as a user runs it (20 updates, a checkpoint after each)."""
    argv = ["--resume", str(run)] if resume else [*TINY, "--updates", str(UPDATES), "--checkpoint_every", "1",
                                                  "--run_dir", str(run), "--cache_dir", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(Path(logra.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    with (run.parent / "stderr.txt").open("w") as err:  # a file, not a pipe: nothing can block on it
        return subprocess.Popen([sys.executable, "-m", "logra.cli", "train", *argv], cwd=run.parent, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def _checkpoint_state(run: Path) -> frozenset:
    """Names, sizes and modification times of every checkpoint folder and file of ``run``."""
    seen = set()
    try:
        for folder in run.glob("checkpoint*"):
            seen.add(folder.name)
            for f in folder.iterdir() if folder.is_dir() else ():
                st = f.stat()
                seen.add((folder.name, f.name, st.st_size, st.st_mtime_ns))
    except FileNotFoundError:  # removed while listed: a change as well
        seen.add("changing")
    return frozenset(seen)


def _kill_at(proc: subprocess.Popen, run: Path, point: float | tuple[str, float]) -> bool:
    """SIGKILL ``proc`` ``point`` seconds after its next logged update or, for ``('write', s)``,
    ``s`` seconds after its checkpoint files start to change (mid-write). False if it finished first."""
    metrics = run / "metrics.jsonl"
    lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    before = _checkpoint_state(run)
    deadline = None
    while proc.poll() is None:
        if deadline is not None:
            if time.monotonic() >= deadline:
                break
        elif isinstance(point, tuple):
            if _checkpoint_state(run) != before:
                deadline = time.monotonic() + point[1]
        elif metrics.exists() and len(metrics.read_text().splitlines()) > lines:
            deadline = time.monotonic() + point
        time.sleep(0.0005)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _killed_run_matches_uninterrupted(tmp_path: Path, points: list[float | tuple[str, float]]) -> int:
    """Run uninterrupted, then again killed at each of ``points`` (resuming after each kill);
    the final weights and the logged updates must be the same. Returns the kills that landed."""
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    ref.mkdir()
    proc = _train(ref / "run", cache, resume=False)
    assert proc.wait(timeout=600) == 0, (ref / "stderr.txt").read_text()
    run = tmp_path / "killed" / "run"
    run.parent.mkdir()
    landed = 0
    for point in [*points, None]:
        resume = (run / "checkpoint").exists() or (run / "checkpoint.old").exists()
        if not resume and run.exists():  # killed before its first checkpoint: start again, as a user would
            shutil.rmtree(run)
        proc = _train(run, cache, resume)
        if point is not None and _kill_at(proc, run, point):
            landed += 1
            continue
        assert proc.wait(timeout=600) == 0, (run.parent / "stderr.txt").read_text()
        break
    expected = load_file(ref / "run" / "checkpoint" / "model.safetensors")
    got = load_file(run / "checkpoint" / "model.safetensors")
    assert expected.keys() == got.keys()
    assert [n for n in expected if not torch.equal(expected[n], got[n])] == []
    keys = ("kind", "update", "reward", "loss", "alpha", "realized_kl")
    assert ([{k: r.get(k) for k in keys} for r in _rows(run)]
            == [{k: r.get(k) for k in keys} for r in _rows(ref / "run")])
    return landed


def test_sigkill_then_resume_is_bitwise(tmp_path):
    """Two kills: one while a checkpoint is being written, one at a random point of an update."""
    rng = random.Random(0)
    landed = _killed_run_matches_uninterrupted(tmp_path, [("write", rng.uniform(0, 0.005)), rng.uniform(0, 0.3)])
    assert landed == 2


@pytest.mark.slow
def test_sigkill_at_many_random_points_then_resume_is_bitwise(tmp_path):
    """40 kill points: 25 at random times within updates, 15 while a checkpoint is written."""
    rng = random.Random(20)
    points: list[float | tuple[str, float]] = ([rng.uniform(0, 0.4) for _ in range(25)]
                                               + [("write", rng.uniform(0, 0.01)) for _ in range(15)])
    rng.shuffle(points)
    landed = _killed_run_matches_uninterrupted(tmp_path, points)
    print(f"kill points tried: {len(points)}, landed before the run finished: {landed}")
    assert landed >= len(points) // 2


def test_a_new_run_refuses_a_folder_that_holds_another_run(tmp_path, monkeypatch):
    """Without --resume, a second run in the same --run_dir used to append to the first one's
    metrics: its summary took the first run's start evaluation (here, 4 problems) as its own
    and the plots drew both runs. It is refused in one line, the folder left as it was, and
    the first run still resumes."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    common = [*TINY, "--run_dir", str(run), "--cache_dir", str(tmp_path / "cache")]
    assert train_main([*common, "--updates", "1", "--eval_problems", "4", "--checkpoint_every", "1"]) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(SystemExit, match=r"already holds another run's records.*--resume"):
        train_main([*common, "--updates", "2"])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert train_main(["--resume", str(run), "--updates", "2", "--quiet"]) == 0
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert [(e["update"], e["problems"]) for e in evals] == [(0, 4), (1, 4), (2, 4)]
