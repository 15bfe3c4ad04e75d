"""`logra bench compare --quick`: every method gets a row, a broken peer is reported, PNGs exist.

Reference byte counts are computed here from the --quick model shape alone (layer
sizes of a Qwen2 decoder), not from the optimizers' own tensors.
"""

from __future__ import annotations

import json
import os

from matplotlib.image import imread

from logra.bench import compare

# The `tiny` preset, spelled out so the references below are independent of the code.
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB, RANK = 64, 2, 4, 2, 128, 256, 16
KV = KV_HEADS * HIDDEN // HEADS
# (in, out) of q, k, v, o, gate, up, down in one decoder layer.
TARGETS = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTER), (HIDDEN, INTER),
           (INTER, HIDDEN)]


def _n_params() -> int:
    per_layer = sum(i * o for i, o in TARGETS) + HIDDEN + 2 * KV + 2 * HIDDEN  # + q/k/v biases, two norms
    return LAYERS * per_layer + 2 * VOCAB * HIDDEN + HIDDEN


def _apollo_state_bytes() -> int:
    """APOLLO's fp32 state with proj_type 'std': for W [out, in] a random projection on the
    smaller side ([r, in] if out >= in, else [out, r]) and Adam moments of the projected
    gradient; plain Adam moments for every other parameter."""
    low_rank = 0
    for i, o in TARGETS:
        proj = RANK * i if o >= i else o * RANK
        projected = o * RANK if o >= i else RANK * i
        low_rank += proj + 2 * projected
    other = _n_params() - LAYERS * sum(i * o for i, o in TARGETS)
    return 4 * (LAYERS * low_rank + 2 * other)


def test_quick_compare_rows_errors_pngs_and_lora_gradients(tmp_path, capsys, monkeypatch):
    # A peer whose import fails: a galore_torch that raises on import shadows the installed
    # package in the worker processes (they inherit PYTHONPATH).
    shadow = tmp_path / "shadow"
    (shadow / "galore_torch").mkdir(parents=True)
    (shadow / "galore_torch" / "__init__.py").write_text(
        'raise ImportError("galore_torch deliberately broken by test_compare")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p))

    out = tmp_path / "out"
    methods = ["adamw", "logra-freeze", "lora", "apollo", "galore"]
    assert compare.main(["--quick", "--methods", ",".join(methods), "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out

    rows = [line for line in printed.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    labels = [r.split("|")[1].strip() for r in rows]
    assert labels == ["adamw", "logra-freeze r16", "lora r16", "apollo r16", "galore r16"]
    galore_row = rows[-1]
    assert "FAILED" in galore_row and "ImportError" in galore_row and "deliberately broken" in galore_row
    assert all("FAILED" not in r for r in rows[:-1])
    assert "4 of 5 runs measured; failed: galore r16." in printed

    for name in ("memory_bars.png", "memory_vs_size.png"):
        image = imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert (out / "compare.md").read_text().strip() in printed

    results = {r["method"]: r for r in json.loads((out / "compare.json").read_text())["results"]}
    assert set(results) == set(methods)
    assert "ImportError" in results["galore"]["error"]

    n = _n_params()
    for name in ("adamw", "logra-freeze", "lora", "apollo"):
        r = results[name]
        assert r["params"] == n
        assert r["tracked_peak"] == sum(r["peak_by_category"].values())
        assert r["tracked_peak"] == max(r["tracked_step_peaks"])
        assert r["rss_peak"] >= r["tracked_peak"] > 0
        assert len(r["step_times"]) == 1 and r["step_time_median"] > 0
    # The base model's fp32 weights plus LoRA's A [r, in] and B [out, r] per target.
    adapters = LAYERS * sum(RANK * (i + o) for i, o in TARGETS)
    assert results["lora"]["trainable_params"] == adapters
    assert results["lora"]["at_optimizer_step"]["gradients"] == 4 * adapters
    assert results["lora"]["peak_by_category"]["parameters"] == 4 * (n + adapters)
    assert results["adamw"]["at_optimizer_step"]["gradients"] == 4 * n
    sketch_rows = LAYERS * sum(o for _, o in TARGETS)
    assert results["logra-freeze"]["at_optimizer_step"]["gradients"] == 4 * RANK * sketch_rows
    # APOLLO trains every parameter: dense fp32 gradients, low-rank state (projections included).
    assert results["apollo"]["at_optimizer_step"]["gradients"] == 4 * n
    assert results["apollo"]["at_optimizer_step"]["optimizer"] >= _apollo_state_bytes()
    assert results["logra-freeze"]["tracked_peak"] < results["lora"]["tracked_peak"] < results["adamw"]["tracked_peak"]
