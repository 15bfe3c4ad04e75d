"""`logra bench memory --quick`: one worker process per method, figures that match the shapes.

The reference byte counts are computed here from the model shape alone (Σ out of the
sketched layers, parameter count of a Qwen2 layer), not from the optimizer's own tensors.
"""

from __future__ import annotations

import json

import pytest

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

    main_table = printed.split("### LoGRA's step by part")[0]
    rows = [line for line in main_table.splitlines() if line.startswith("| ")]
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
    # as Rademacher sign bits.
    in_sum = LAYERS * (6 * HIDDEN + INTER)
    assert freeze["projection_bytes"] == RANK * in_sum // 8
    assert freeze["peak_by_category"]["optimizer"] >= _target_rows() * 4 + RANK * in_sum // 8

    sk = results["logra-sketch"]
    sketch_bytes_emb = (_target_rows() + 2 * VOCAB) * RANK * 4  # + embedding and lm_head sketches
    dense = sk["trainable_params"]
    assert dense == sk["dense_params"] == LAYERS * (2 * HIDDEN + HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS) + HIDDEN
    # Norms and q/k/v biases keep dense fp32 gradients; whether they exist at the peak
    # depends on where in the step the peak falls.
    assert sketch_bytes_emb <= sk["peak_by_category"]["gradients"] <= sketch_bytes_emb + 4 * dense

    assert freeze["tracked_peak"] < adamw["tracked_peak"]

    # One profiled step per LoGRA row: every named part ran, and they are parts of the step.
    assert adamw["step_parts"] is None and "step by part" in printed
    for r in (freeze, sk):
        # the step's own transients: at least the directions D (one fp32 value per sketch entry)
        assert r["step_transient_bytes"] >= freeze["sketch_buffer_bytes"]
        parts = r["step_parts"]
        assert all(parts[p] > 0 for p in memory.STEP_PARTS), parts
        assert sum(parts[p] for p in memory.STEP_PARTS) < parts["step"]


def test_input_projections_are_fitted_before_the_first_step_and_kept_in_fp32(tmp_path, capsys):
    """``--logra-input-projection``: one fp32 ``[r, in]`` per layer input (q/k/v and gate/up
    share one), and the fit's own peak holds the exact float64 moment of every input at once."""
    out = tmp_path / "memory.json"
    assert memory.main(["--quick", "--repeats", "1", "--memory-repeats", "1", "--methods", "logra-freeze",
                        "--logra-input-projection", "--out", str(out)]) == 0
    assert "Fitting the projections to the inputs" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    assert r["projection_bytes"] == RANK * 4 * LAYERS * (3 * HIDDEN + INTER)
    assert r["fit"]["seconds"] > 0 and r["fit"]["tracked_peak"] >= 8 * LAYERS * (3 * HIDDEN ** 2 + INTER ** 2)


def test_token_sweep_runs_every_point_and_summarises(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert memory.main(["--quick", "--tokens", "32,64", "--methods", "adamw,logra-freeze", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    sweep = json.loads(out.read_text())["sweep"]
    assert [(p["tokens"], p["seq"]) for p in sweep] == [(32, 16), (64, 32)]
    for point in sweep:
        adamw, logra = point["results"]
        assert (adamw["method"], logra["method"]) == ("adamw", "logra-freeze")
        assert logra["step_parts"]["logra.sketch"] > 0
    # every point is its own measurement: AdamW's peak grows with the tokens (activations)
    assert sweep[1]["results"][0]["tracked_peak"] > sweep[0]["results"][0]["tracked_peak"]
    summary = printed.split("## Token sweep")[1]
    assert [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ")][1:] == ["32", "64"]


def test_token_sweep_rejects_a_count_that_does_not_split_over_the_batch(capsys):
    with pytest.raises(SystemExit):
        memory.main(["--quick", "--tokens", "33"])
    assert "multiple of --batch" in capsys.readouterr().err


def test_chunked_logits_loss_is_the_models_loss_and_is_tracked():
    """``--logits-chunk``: the same mean next-token NLL, and MemTracker follows an output head
    called once per chunk (each a top-level forward) through the backward pass."""
    import torch

    from logra.memory import track_memory

    args = memory._resolve(memory.build_parser().parse_args(["--quick", "--seq", "24"]))
    model = memory.build_model(args)
    batch = memory.make_batch(args)
    full, chunked = memory.make_loss(model, batch), memory.make_loss(model, batch, logits_chunk=5)
    torch.testing.assert_close(chunked(), full(), rtol=1e-5, atol=1e-6)
    with track_memory(model) as report:
        chunked().backward()
    assert report.peak_by_category["activations"] > 0 and report.peak_total > 0


def test_checkpointing_recomputes_the_forward_and_keeps_the_gradient():
    """``--checkpointing`` turns on HF activation checkpointing under whichever name the installed
    transformers gives the method (``activation_checkpointing_enable`` is absent before its 5.2x
    series, where the benchmark used to stop with AttributeError): each decoder layer's MLP
    runs again in the backward pass, and the gradient is the one without checkpointing."""
    import torch

    args = memory._resolve(memory.build_parser().parse_args(["--quick", "--seq", "16"]))
    plain = memory.build_model(args)
    args.checkpointing = True
    ckpt = memory.build_model(args)  # same seed: the same weights
    batch = memory.make_batch(args)
    calls = []
    ckpt.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    memory.make_loss(plain, batch)().backward()
    memory.make_loss(ckpt, batch)().backward()
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
