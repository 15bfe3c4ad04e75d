"""`logra bench memory --quick`: one worker process per method, figures that match the shapes.

The reference byte counts are computed here from the model shape alone (Σ out of the
sketched layers, parameter count of a Qwen2 layer), not from the optimizer's own tensors.
"""

from __future__ import annotations

import json

from logra.bench import memory

# The --quick shape of the benchmark, spelled out so the references below are independent.
HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB, RANK = 64, 2, 4, 2, 128, 256, 16


def _qwen2_params() -> int:
    kv = KV_HEADS * HIDDEN // HEADS
    attn = HIDDEN * HIDDEN + HIDDEN + 2 * (HIDDEN * kv + kv) + HIDDEN * HIDDEN  # q/k/v carry biases
    mlp = 3 * HIDDEN * INTER
    layer = attn + mlp + 2 * HIDDEN  # two RMSNorms
    return LAYERS * layer + 2 * VOCAB * HIDDEN + HIDDEN  # untied embedding/lm_head, final norm


def _target_rows() -> int:
    kv = KV_HEADS * HIDDEN // HEADS
    return LAYERS * (HIDDEN + 2 * kv + HIDDEN + 2 * INTER + HIDDEN)  # q, k, v, o, gate, up, down


def test_quick_benchmark_table_and_gradient_bytes(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out

    rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == list(memory.METHODS)
    assert "PASS" in printed or "FAIL" in printed
    assert "step time" in printed and "peak memory" in printed

    results = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(memory.METHODS)
    n_params = _qwen2_params()
    for r in results.values():
        assert r["params"] == n_params
        assert r["peak_by_category"]["parameters"] == 4 * n_params  # fp32 weights, all of them
        assert r["tracked_peak"] == sum(r["peak_by_category"].values())
        assert r["rss_peak"] >= r["tracked_peak"] > 0
        assert len(r["step_times"]) == 1 and r["step_time_median"] > 0

    adamw = results["adamw"]
    assert adamw["trainable_params"] == n_params
    assert adamw["peak_by_category"]["gradients"] == 4 * n_params
    # exp_avg and exp_avg_sq exist during every measured step (created at the warm-up step).
    assert adamw["peak_by_category"]["optimizer"] >= 2 * 4 * n_params

    freeze = results["logra-freeze"]
    sketch_bytes = _target_rows() * RANK * 4
    assert freeze["trainable_params"] == 0
    assert freeze["peak_by_category"]["gradients"] == sketch_bytes
    # State: one fp32 second moment per row plus one [r, in] projection per target, stored
    # as int8 Rademacher signs.
    in_sum = LAYERS * (6 * HIDDEN + INTER)
    assert freeze["projection_bytes"] == RANK * in_sum
    assert freeze["peak_by_category"]["optimizer"] >= _target_rows() * 4 + RANK * in_sum

    sk = results["logra-sketch"]
    sketch_bytes_emb = (_target_rows() + 2 * VOCAB) * RANK * 4  # + embedding and lm_head sketches
    dense = sk["trainable_params"]
    assert dense == sk["dense_params"] == LAYERS * (2 * HIDDEN + HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS) + HIDDEN
    # Norms and q/k/v biases keep dense fp32 gradients; whether they exist at the peak
    # depends on where in the step the peak falls.
    assert sketch_bytes_emb <= sk["peak_by_category"]["gradients"] <= sketch_bytes_emb + 4 * dense

    assert freeze["tracked_peak"] < adamw["tracked_peak"]
