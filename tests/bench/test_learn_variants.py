"""`logra bench learn --variant`: rows of extra `logra train` flags and the paired table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from logra.bench import learn
from logra.rl.cli import _parser, build_config


def _fake_run(run_dir: Path, start: float, final: float, alpha: float = 0.5, checksum: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "eval", "update": 0, "pass@1": start, "pass@1_stderr": 0.01, "pass@4": start},
            {"kind": "train", "update": 0, "alpha": alpha, "realized_kl": 1e-3, "reward": 0.3, "time_update": 1.0,
             "peak_rss_gib": 0.5},
            {"kind": "eval", "update": 1, "pass@1": final, "pass@1_stderr": 0.01, "pass@4": final}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"policy": {"checksum": checksum}} if checksum else {}))
    (run_dir / "config.json").write_text(json.dumps({
        "task": "chain_sum", "algorithm": "grpo", "prompts_per_update": 32, "responses_per_prompt": 8,
        "eval_samples": 8, "logra": {"rank": 48, "update_ratio": 3e-3},
        "kl": {"budget": 1e-3, "budget_final": 1e-4, "schedule": "cosine"}}))


def test_paired_rows_are_per_seed_differences(tmp_path):
    base = {0: (0.30, 0.34), 1: (0.32, 0.35), 2: (0.31, 0.33)}
    mom = {0: (0.30, 0.38), 1: (0.32, 0.36), 2: (0.31, 0.37)}
    groups = {}
    for label, table in (("LoGRA", base), ("momentum", mom)):
        runs = []
        for seed, (a, b) in table.items():
            _fake_run(tmp_path / f"{label}-s{seed}", a, b)
            runs.append(learn.read_run(tmp_path / f"{label}-s{seed}", label, seed))
        groups[label] = runs
    rows = {r["label"]: r for r in learn.paired_rows(groups, "LoGRA")}
    diffs = [0.04, 0.01, 0.04]
    assert rows["momentum"]["diff"] == pytest.approx(sum(diffs) / 3)
    sd = math.sqrt(sum((d - 0.03) ** 2 for d in diffs) / 2)
    assert rows["momentum"]["diff_se"] == pytest.approx(sd / math.sqrt(3))
    assert rows["LoGRA"]["gain"] == pytest.approx((0.04 + 0.03 + 0.02) / 3)
    assert "diff" not in rows["LoGRA"]
    table = learn.format_paired_table(list(rows.values()), "LoGRA")
    assert "+3.0 ±" in table and "momentum" in table


def test_runs_of_one_seed_from_different_starting_weights_are_not_paired(tmp_path):
    """One cache key gives other warm starts on other machines or thread counts: the recorded
    checksums of the starting weights decide, and runs of older versions (none recorded) pass."""
    def group(label, checksums):
        runs = []
        for seed, checksum in enumerate(checksums):
            _fake_run(tmp_path / f"{label}-s{seed}", 0.3, 0.35, checksum=checksum)
            runs.append(learn.read_run(tmp_path / f"{label}-s{seed}", label, seed))
        return runs

    reference = group("LoGRA", ["aa" * 16, "aa" * 16, None])
    assert learn.paired_rows({"LoGRA": reference, "same": group("same", ["aa" * 16, None, "bb" * 16])}, "LoGRA")
    with pytest.raises(ValueError, match="seed 1.*started from different weights"):
        learn.paired_rows({"LoGRA": reference, "other": group("other", ["aa" * 16, "bb" * 16, None])}, "LoGRA")


def test_variant_rows_run_their_flags(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_train(run_dir, args, reuse=False):
        calls.append(list(args))
        _fake_run(Path(run_dir), 0.3, 0.35 if "--logra.beta1" in args else 0.33)
        return run_dir

    monkeypatch.setattr(learn, "run_train", fake_train)
    monkeypatch.setattr(learn, "plot_curves", lambda *a, **k: tmp_path / "x.png")
    code = learn.main(["--methods", "logra", "--variant", "mom=--logra.beta1 0.9 --logra.refresh_every 10",
                       "--seeds", "2", "--updates", "3", "--out-dir", str(tmp_path), "--eval-every", "3"])
    assert code == 0
    mom = [c for c in calls if "--logra.beta1" in c]
    assert len(mom) == 2 and mom[0][:6] == ["--seed", "0", "--logra.beta1", "0.9", "--logra.refresh_every", "10"]
    out = capsys.readouterr().out
    assert "| mom | 0,1 |" in out and "+2.0 ± 0.0" in out


def test_report_only_runs_nothing_and_skips_missing(tmp_path, monkeypatch, capsys):
    def no_train(*a, **k):
        raise AssertionError("--report-only must not run anything")

    monkeypatch.setattr(learn, "run_train", no_train)
    monkeypatch.setattr(learn, "plot_curves", lambda *a, **k: tmp_path / "x.png")
    common = ["--updates", "3", "--eval_problems", "500", "--eval_every", "3", "--checkpoint_every", "0",
              "--threads", "1"]
    for seed in (0, 1):
        _fake_run(tmp_path / f"logra-s{seed}", 0.3, 0.33)
        (tmp_path / f"logra-s{seed}" / "bench_args.json").write_text(json.dumps(
            {"args": learn._train_args("logra", seed, "0.0001", common)}))
    _fake_run(tmp_path / "mom-s0", 0.3, 0.36)
    (tmp_path / "mom-s0" / "bench_args.json").write_text(json.dumps(
        {"args": ["--seed", "0", "--logra.beta1", "0.9", *common]}))
    code = learn.main(["--methods", "logra,adamw", "--variant", "mom=--logra.beta1 0.9", "--seeds", "3",
                       "--updates", "3", "--eval-every", "3", "--out-dir", str(tmp_path), "--report-only"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| LoGRA | 0,1 |" in out and "| mom | 0 |" in out and "+3.0 ± 1.4 (n=1)" not in out
    assert "+3.0 ±" in out  # mom vs LoGRA on seed 0


def test_flags_passed_through_go_to_the_runs_that_read_them():
    """A baseline's flag given to ``logra bench learn`` reaches AdamW / LoRA and is left out of
    the runs whose config would refuse it (LoGRA has no Adam beta1, only LoRA a LoRA rank)."""
    common = ["--updates", "4", "--adam_beta1", "0", "--lora_rank=16", "--lr_schedule", "constant", "--threads", "1"]
    assert learn._train_args("logra", 0, "1e-3", common) == [
        "--optimizer", "logra", "--seed", "0", "--updates", "4", "--threads", "1"]
    assert learn._train_args("adamw", 1, "1e-3", common) == [
        "--optimizer", "adamw", "--seed", "1", "--lr", "1e-3", "--updates", "4", "--adam_beta1", "0",
        "--lr_schedule", "constant", "--threads", "1"]
    assert learn._train_args("lora", 2, "1e-2", common)[6:] == common
    for method in ("logra", "adamw", "lora"):  # each run's arguments build a config it accepts
        args = vars(_parser().parse_args(learn._train_args(method, 0, "1e-3", common)))
        build_config({k: v for k, v in args.items() if k not in ("config", "resume", "quiet", "recipe")}, "embedded")
