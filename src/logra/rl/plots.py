"""PNG plots of a run's metrics (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._optional import require

require("matplotlib").use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(records: list[dict[str, Any]], run_dir: Path) -> list[Path]:
    """Write reward/Pass@1, KL and memory curves of ``records`` (metrics.jsonl rows)."""
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    paths = []

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x, y = [r["update"] for r in train], [r["reward"] for r in train]
    ax[0].plot(x, y, alpha=0.3, lw=0.8, label="train reward")
    w = max(1, len(y) // 40)
    if len(y) > w:
        smooth = [sum(y[i - w: i]) / w for i in range(w, len(y) + 1)]
        ax[0].plot(x[w - 1:], smooth, lw=2, label=f"moving mean ({w} updates)")
    ax[0].set_xlabel("update"), ax[0].set_ylabel("mean reward"), ax[0].legend()
    if evals:
        x = [r["update"] for r in evals]
        p1 = [r["pass@1"] for r in evals]
        se = [r["pass@1_stderr"] for r in evals]
        ax[1].errorbar(x, p1, yerr=se, marker="o", capsize=3, label="Pass@1")
        ax[1].plot(x, [r["pass@4"] for r in evals], marker="s", label="Pass@4")
        ax[1].set_xlabel("update"), ax[1].set_ylabel("held-out"), ax[1].legend()
    fig.tight_layout()
    paths.append(run_dir / "learning.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if train:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
        u = [r["update"] for r in train]
        ax[0].semilogy(u, [r.get("expected_kl", float("nan")) for r in train], label="predicted KL (after α)")
        ax[0].semilogy(u, [max(r["realized_kl"], 1e-12) for r in train], label="realised KL")
        ax[0].semilogy(u, [r.get("effective_budget", float("nan")) for r in train], "--", label="budget")
        ax[0].set_xlabel("update"), ax[0].legend()
        ax[1].plot(u, [r["alpha"] for r in train], label="α")
        ax[1].set_xlabel("update"), ax[1].set_ylabel("step scale α")
        fig.tight_layout()
        paths.append(run_dir / "kl.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        key = "peak_mem_gib" if "peak_mem_gib" in train[0] else "peak_rss_gib"
        fig, ax = plt.subplots(figsize=(5, 3.6))
        ax.plot(u, [r[key] for r in train])
        ax.set_xlabel("update"), ax.set_ylabel(key.replace("_gib", " (GiB)"))
        fig.tight_layout()
        paths.append(run_dir / "memory.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
