"""Held-out evaluation (Pass@1 / Pass@4 with the unbiased estimator) and the run's summary."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..tasks import Problem, Task, is_correct, pass_at_k
from .config import RLConfig
from .rollout import generate_rollouts

logger = logging.getLogger(__name__)


def distinct_problems(task: Task, n: int, seed: int, split: str = "eval") -> list[Problem]:
    """``n`` problems of ``split`` with distinct prompts (fewer, with a warning, if the split is smaller).

    ``split='train'`` gives questions the policy trains on (small problem spaces repeat
    them), to set its Pass@1 on seen questions beside the held-out one.
    """
    seen: dict[str, Problem] = {}
    draws = n
    while len(seen) < n and draws <= 64 * n:
        try:
            pool = task.problems(split, draws, seed=seed)
        except RuntimeError:
            break
        for p in pool:
            seen.setdefault(p.prompt, p)
        draws *= 2
    chosen = list(seen.values())[:n]
    if len(chosen) < n:
        logger.warning("the %s split holds only %d distinct problems (asked %d)", split, len(chosen), n)
    return chosen


@torch.no_grad()
def evaluate(model: nn.Module, tokenizer: Any, task: Task, problems: list[Problem], samples: int,
             config: RLConfig, update: int) -> dict[str, Any]:
    """Pass@1 / Pass@4 (unbiased estimator over ``samples`` per problem) and mean reward.

    Samples at the training temperature from a fixed seed, so every evaluation of a run
    sees the same problems and random numbers (gains between evaluations are paired).
    The RNG state of the CPU and of the model's CUDA device is restored afterwards.
    """
    n, k = len(problems), samples
    device = next(model.parameters()).device
    expanded = [p for p in problems for _ in range(k)]
    # the training stream's RNG (CPU and this CUDA device) is left where it was
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(config.seed + 7)
        rollout = generate_rollouts(model, tokenizer, [p.prompt for p in expanded], temperature=config.temperature,
                                    top_p=config.top_p, max_new_tokens=config.max_new_tokens,
                                    batch_size=max(config.micro_batch, 64))
    scores = [task.score(p, t) for p, t in zip(expanded, rollout.responses, strict=True)]
    rewards = torch.tensor(scores, dtype=torch.float32).view(n, k)
    correct = [sum(is_correct(r) for r in row) for row in rewards.tolist()]
    p1 = [pass_at_k(k, c, 1) for c in correct]
    mean1 = sum(p1) / n
    stderr = math.sqrt(sum((x - mean1) ** 2 for x in p1) / max(n - 1, 1) / n)
    return {
        "kind": "eval", "update": update, "pass@1": mean1, "pass@1_stderr": stderr,
        "pass@4": sum(pass_at_k(k, c, 4) for c in correct) / n, "reward": float(rewards.mean()),
        "problems": n, "samples": k, "correct": correct,
    }


def summarize(records: list[dict[str, Any]], policy: dict[str, Any]) -> dict[str, Any]:
    """The run's summary from its metrics: Pass@1 gain with unpaired and paired standard errors.

    ``policy`` says where the starting policy came from (for the embedded policy: its
    warm-start cache entry), so runs can be compared only when they started alike.
    """
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    first, last = evals[0], evals[-1]
    gain = last["pass@1"] - first["pass@1"]
    se = math.sqrt(first["pass@1_stderr"] ** 2 + last["pass@1_stderr"] ** 2)
    # the same problems are evaluated each time: the paired standard error of the gain
    n, k = first["problems"], first["samples"]
    diffs = [(b - a) / k for a, b in zip(first["correct"], last["correct"], strict=True)]
    paired = math.sqrt(sum((d - gain) ** 2 for d in diffs) / max(n - 1, 1) / n)
    summary = {
        "updates": train[-1]["update"] + 1 if train else 0, "policy": policy,
        "pass@1_start": first["pass@1"], "pass@1_end": last["pass@1"],
        "pass@1_gain": gain, "gain_in_stderr": gain / se if se > 0 else 0.0,
        "gain_in_paired_stderr": gain / paired if paired > 0 else 0.0,
        "pass@4_start": first["pass@4"], "pass@4_end": last["pass@4"],
        "peak_pass@1": max(e["pass@1"] for e in evals), "peak_pass@4": max(e["pass@4"] for e in evals),
        "mean_update_s": sum(r["time_update"] for r in train) / max(len(train), 1),
        "updates_per_hour": 3600 * len(train) / max(sum(r["time_update"] for r in train), 1e-9),
    }
    mem_key = "peak_mem_gib" if train and "peak_mem_gib" in train[-1] else "peak_rss_gib"
    if train:
        summary[mem_key] = max(r[mem_key] for r in train)
    return summary


def start_checksum(run_dir: str | Path) -> str | None:
    """`weights_checksum` of the policy a finished run started from, as its ``summary.json``
    records it (None for an unfinished run or one of a version that did not record it)."""
    try:
        return str(json.loads((Path(run_dir) / "summary.json").read_text())["policy"]["checksum"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def format_summary(summary: dict[str, Any], config: RLConfig) -> str:
    """A short markdown table of a finished run."""
    rows = [
        ("optimizer", config.optimizer), ("updates", summary["updates"]),
        ("starting policy", _policy_line(summary.get("policy", {}))),
        ("Pass@1 start → end", f"{summary['pass@1_start']:.3f} → {summary['pass@1_end']:.3f}"),
        ("Pass@1 gain", f"{summary['pass@1_gain']:+.3f} ({summary['gain_in_stderr']:.1f} standard errors unpaired, "
                        f"{summary['gain_in_paired_stderr']:.1f} paired)"),
        ("Pass@4 start → end", f"{summary['pass@4_start']:.3f} → {summary['pass@4_end']:.3f}"),
        ("peak Pass@1 / Pass@4", f"{summary['peak_pass@1']:.3f} / {summary['peak_pass@4']:.3f}"),
        ("updates / hour", f"{summary['updates_per_hour']:.0f}"),
    ]
    for key in ("peak_mem_gib", "peak_rss_gib"):
        if key in summary:
            rows.append((key.replace("_gib", " (GiB)"), f"{summary[key]:.2f}"))
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def _policy_line(policy: dict[str, Any]) -> str:
    checksum = f", weights {policy['checksum'][:12]}" if "checksum" in policy else ""
    if "key" in policy:
        how = "shipped with logra" if policy.get("shipped") else "trained now"
        if policy.get("cache_hit"):
            how = f"cache hit, {how}"
        return f"embedded warm start {policy['key']} ({how}, {policy.get('path', '')}{checksum})"
    return f"{policy.get('source', 'given')}{checksum}"
