"""`logra bench diagnostics` and `logra bench learn`: reconstruction maths, gradient recording, tables, plots.

References are independent of the code under test: dense autograd on an unsketched copy
for the recorded gradients, the exact moments of Rademacher/Gaussian projections
(``E[AᵀA] = I``, ``E[(AᵀA)²] = (n + r ∓ 1)/r · I``) checked by Monte Carlo, and hand
computations for the verdict.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import VowelTask, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer
from logra.bench import diagnostics, learn
from logra.bench.diagnostics import ProjectionVariant, cosines, predicted_cosines, reconstruction_stats
from logra.rl import KLControlConfig, RLConfig, RLTrainer
from logra.rl.tiny import byte_tokenizer

RADEMACHER_FIXED = ProjectionVariant("fixed", "rademacher", False)
RADEMACHER = ProjectionVariant("refreshed", "rademacher", True)
GAUSSIAN = ProjectionVariant("gaussian", "gaussian", True)


class _CharTask(VowelTask):
    name = "chars"


def _factory():
    tok = byte_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return Qwen2ForCausalLM(cfg), tok, _CharTask()


_TINY_RL = ["--prompts_per_update", "4", "--responses_per_prompt", "4", "--micro_batch", "8", "--max_new_tokens", "6",
            "--logra.rank", "8", "--logra.update_ratio", "0.01", "--kl.budget", "1e-3", "--kl.budget_final", "1e-4"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models and thousands of tiny matmuls: intra-op threads only add synchronisation,
    which stalls badly on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------- gradient recording
def test_recorded_gradient_is_dense_autograd_gradient_and_sketch_is_its_projection():
    model = tiny_qwen2(seed=3)
    reference = copy.deepcopy(model)
    batch = token_batch(97, batch=3, length=12, seed=1)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8))
    recorder = diagnostics.DenseGradientRecorder(model, opt.config.target_modules)
    for _ in range(2):  # two micro-batches accumulate, as in the trainer
        model(**batch).loss.backward()
        reference(**batch).loss.backward()
    with torch.no_grad():  # no-grad passes (generation, probes) must not record
        model(**batch)
    grads = recorder.pop()
    recorder.remove()
    dense = dict(reference.named_parameters())
    assert set(grads) == set(opt.targets) and len(grads) == 2 * 7
    for name, g in grads.items():
        torch.testing.assert_close(g, dense[name].grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(opt.sketches()[name], g @ opt.projection(name).T, rtol=1e-4, atol=1e-6)
    assert all(float(g.abs().sum()) == 0 for g in recorder.grads.values())  # pop zeroed the buffers


# ----------------------------------------------------------------------- reconstruction maths
def _gradient(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.{k}.weight": torch.randn(out, n, generator=g)
            for i, (k, out, n) in enumerate(sizes)}


@pytest.mark.parametrize("variant,c", [(RADEMACHER, -1.0), (GAUSSIAN, 1.0)])
def test_single_update_moments_match_the_analytic_expectation(variant, c):
    """E⟨G, G AᵀA⟩ = ‖G‖² and E‖G AᵀA‖² = ‖G‖²(n + r + c)/r, by Monte Carlo over projection seeds."""
    grads = [_gradient([("up_proj", 6, 24), ("down_proj", 5, 40)], seed=0)]
    ranks = [2, 8]
    samples = np.stack([reconstruction_stats(grads, ranks, variant, seed)[0] for seed in range(300)])  # [K, L, R, 3]
    for li, g in enumerate(grads[0].values()):
        n, sq = g.shape[1], float(g.square().sum())
        for ri, r in enumerate(ranks):
            dot, norm_g, norm_r = samples[:, li, ri, 0], samples[:, li, ri, 1], samples[:, li, ri, 2]
            assert np.allclose(norm_g, sq)
            se = dot.std(ddof=1) / math.sqrt(len(dot))
            assert abs(dot.mean() - sq) < 4 * se
            expected = sq * (n + r + c) / r
            se = norm_r.std(ddof=1) / math.sqrt(len(norm_r))
            assert abs(norm_r.mean() - expected) < 4 * se, (r, norm_r.mean(), expected)
            # and the prediction function says the same ratio of expectations
            pred = predicted_cosines(grads, ranks, variant)[0, li, ri]
            assert pred == pytest.approx(math.sqrt(sq / expected), rel=1e-9)


def test_fixed_projection_keeps_the_error_refreshed_projections_average_it_out():
    g = _gradient([("q_proj", 8, 32)], seed=1)
    same = [g] * 8  # a constant gradient: Σ G_t A_tᵀA_t / T → G only if the A_t differ
    ranks = [1, 4, 16]
    fixed = cosines(reconstruction_stats(same, ranks, RADEMACHER_FIXED, seed=5))[:, 0, :]
    # Σ_t G AᵀA = T·G AᵀA: the accumulated cosine is exactly that of one update
    assert np.allclose(fixed, fixed[0], rtol=0, atol=1e-12)
    runs = np.stack([cosines(reconstruction_stats(same, ranks, RADEMACHER, seed=s))[:, 0, :] for s in range(60)])
    mean = runs.mean(0)  # [T, R]
    # update 0 draws the same projection for fixed and refreshed (projection index 0)
    fixed_s0 = cosines(reconstruction_stats(same[:1], ranks, RADEMACHER_FIXED, seed=0))[0, 0]
    assert np.allclose(runs[0, 0], fixed_s0)
    assert np.all(np.diff(mean[[0, 1, 3, 7]], axis=0) > 0)  # more updates → closer to ΣG
    assert np.all(np.diff(mean, axis=1) > 0)  # higher rank → closer to ΣG
    pred = predicted_cosines(same, ranks, RADEMACHER)[:, 0, :]
    n = 32  # constant G: cos ≈ 1/sqrt(1 + (n - 1)/(r T))
    for t in range(8):
        for ri, r in enumerate(ranks):
            assert pred[t, ri] == pytest.approx(1 / math.sqrt(1 + (n - 1) / (r * (t + 1))), rel=1e-9)
    # ratio of expectations vs expectation of the ratio: close for these sizes
    assert np.max(np.abs(mean - pred)) < 0.06
    assert mean[-1, -1] > 0.85 and fixed[-1, -1] < 0.7  # prediction 0.897 vs one draw's ≈ sqrt(16/47) = 0.58


def test_coherence_is_one_for_orthogonal_and_t_for_identical_gradients():
    name = "model.layers.0.mlp.up_proj.weight"
    eye = torch.eye(4)
    orthogonal = [{name: eye[i: i + 1]} for i in range(4)]  # four orthogonal 1×4 gradients
    layers = {"0": [name]}
    assert diagnostics.coherence(orthogonal, layers) == pytest.approx([1.0])
    assert diagnostics.coherence([orthogonal[0]] * 5, layers) == pytest.approx([5.0])
    assert diagnostics.coherence([orthogonal[0], {name: -eye[0:1]}], layers) == pytest.approx([0.0])


def test_layers_group_targets_by_transformer_layer():
    names = ["model.layers.10.mlp.up_proj.weight", "model.layers.2.self_attn.q_proj.weight",
             "model.layers.2.mlp.down_proj.weight", "lm_head.weight"]
    groups = diagnostics.group_by_layer(names)
    assert list(groups) == ["2", "10", "lm_head.weight"]
    assert groups["2"] == names[1:3]


# ----------------------------------------------------------------------- the parts end to end
def _png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    return data


def test_cosine_part_on_a_tiny_rl_run(tmp_path, capsys):
    out = tmp_path / "diag"
    argv = ["--parts", "cosine", "--out-dir", str(out), "--cosine-updates", "3", "--cosine-ranks", "1,4,16,32",
            *_TINY_RL]
    assert diagnostics.main(argv, model_factory=_factory) == 0
    printed = capsys.readouterr().out
    assert "REDUCED RUN" in printed and "cosine-updates 3 (full: 16)" in printed
    rows = [line for line in printed.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r.split("|")[1]) for r in rows] == [1, 4, 16, 32]
    err = float(re.search(r"relative error of at most ([0-9.e+-]+)", printed).group(1))
    assert err < 1e-4
    data = json.loads((out / "cosine" / "cosine.json").read_text())
    assert data["updates"] == 3 and data["layers"] == ["0", "1"] and len(data["coherence"]) == 2
    fixed = np.array(data["measured"]["fixed Rademacher"])
    refreshed = np.array(data["measured"]["refreshed Rademacher"])
    assert fixed.shape == (3, 2, 4)
    assert np.allclose(fixed[0], refreshed[0])  # both use projection index 0 at the first update
    assert np.all((refreshed > 0) & (refreshed <= 1))
    assert refreshed[-1, :, -1].mean() > refreshed[-1, :, 0].mean()  # rank 32 beats rank 1
    for name in ("heatmap_fixed_vs_refreshed.png", "heatmap_rademacher_vs_gaussian.png", "cosine_vs_updates.png"):
        _png(out / "cosine" / name)


def test_cosine_part_with_supervised_gradients(tmp_path, capsys):
    out = tmp_path / "diag"
    argv = ["--parts", "cosine", "--cosine-loss", "sft", "--out-dir", str(out), "--cosine-updates", "2",
            "--cosine-ranks", "2,32", *_TINY_RL]
    assert diagnostics.main(argv, model_factory=_factory) == 0
    printed = capsys.readouterr().out
    assert "SFT gradients" in printed and "supervised next-token loss" in printed
    assert float(re.search(r"relative error of at most ([0-9.e+-]+)", printed).group(1)) < 1e-4
    data = json.loads((out / "cosine-sft" / "cosine.json").read_text())
    assert data["loss"] == "sft" and np.array(data["measured"]["fixed Rademacher"]).shape == (2, 2, 2)


def test_rank_and_kl_parts_tables_and_plots(tmp_path, capsys):
    out = tmp_path / "diag"
    argv = ["--parts", "rank,kl", "--out-dir", str(out), "--updates", "1", "--kl-updates", "1", "--eval-problems", "4",
            "--eval-every", "1", "--seeds", "1", "--ranks", "4,8", *_TINY_RL]
    assert diagnostics.main(argv, model_factory=_factory) == 0
    printed = capsys.readouterr().out
    assert printed.count("REDUCED RUN") == 2
    table_rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    for label in ("rank 4", "rank 8", "cosine budget", "constant budget", "no KL control"):
        assert label in table_rows, label
    none = [json.loads(x) for x in (out / "kl" / "none-s0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["alpha"] for r in none if r["kind"] == "train"] == [1.0]
    assert table_rows["no KL control"].split("|")[10].strip() == "-"  # no prediction without control
    const = json.loads((out / "kl" / "constant-s0" / "config.json").read_text())
    assert const["kl"]["schedule"] == "constant" and const["logra"]["rank"] == 8
    assert json.loads((out / "rank" / "r4-s0" / "config.json").read_text())["logra"]["rank"] == 4
    _png(out / "rank" / "pass_vs_update.png")
    _png(out / "kl" / "pass_vs_update.png")


def _tiny_run(tmp_path, optimizer, seed):
    model, tok, task = _factory()
    cfg = RLConfig(optimizer=optimizer, seed=seed, updates=1, prompts_per_update=4, responses_per_prompt=4,
                   micro_batch=8, max_new_tokens=6, eval_every=1, eval_problems=4, checkpoint_every=0,
                   run_dir=str(tmp_path / f"{optimizer}-s{seed}"), logra=LoGRAConfig(rank=8, update_ratio=1e-2),
                   kl=KLControlConfig(budget=1e-3, budget_final=1e-4, schedule_steps=10),
                   **({"lr": 1e-3} if optimizer in ("adamw", "lora") else {}))
    RLTrainer(cfg, model=model, tokenizer=tok, task=task, progress=False).train()
    return learn.read_run(cfg.run_dir, optimizer, seed)


def test_learn_table_verdict_and_plot_on_tiny_runs(tmp_path):
    groups = {"LoGRA": [_tiny_run(tmp_path, "logra", s) for s in (0, 1)],
              "Dense AdamW": [_tiny_run(tmp_path, "adamw", s) for s in (0, 1)]}
    table = learn.format_table(groups, {"LoGRA": "update_ratio", "Dense AdamW": "0.001"})
    lines = table.splitlines()
    assert lines[0].startswith("| method | n | lr | peak RSS (GiB) | updates/h")
    logra_row = [c.strip() for c in lines[2].split("|")[1:-1]]
    runs = groups["LoGRA"]
    peaks = [100 * r.peak_pass1 for r in runs]
    assert logra_row[0] == "LoGRA" and logra_row[1] == "2"
    assert logra_row[6] == f"{np.mean(peaks):.1f} ± {np.std(peaks, ddof=1):.1f}"
    rss = [max(json.loads(x)["peak_rss_gib"] for x in (r.run_dir / "metrics.jsonl").read_text().splitlines()
               if '"train"' in x) for r in runs]
    assert logra_row[3] == f"{np.mean(rss):.3f} ± {np.std(rss, ddof=1):.3f}"
    # every run evaluated before and after its one update; peaks include update 0
    assert all([e["update"] for e in r.evals] == [0, 1] for rs in groups.values() for r in rs)
    passed, line = learn.verdict(groups["LoGRA"], groups["Dense AdamW"])
    assert line.startswith("PASS" if passed else "FAIL")
    png = learn.plot_curves(groups, tmp_path / "learning.png", "tiny")
    _png(png)


def _fake(label, peaks, stderr=0.01):
    return [learn.RunResult(label, s, None, [{"update": 0, "pass@1": 0.1, "pass@1_stderr": stderr, "pass@4": 0.2},
                                              {"update": 5, "pass@1": p, "pass@1_stderr": stderr, "pass@4": 0.9}])
            for s, p in enumerate(peaks)]


def test_verdict_noise_definition():
    # seeds: SE of the difference = sqrt(s_a²/n_a + s_b²/n_b) with sample stds
    a, b = _fake("a", [0.50, 0.60]), _fake("b", [0.70, 0.80])
    se = math.sqrt(np.var([0.5, 0.6], ddof=1) / 2 + np.var([0.7, 0.8], ddof=1) / 2)
    passed, line = learn.verdict(a, b)
    assert not passed and f"{2 * se:.3f}" in line and "-0.200" in line
    passed, _ = learn.verdict(_fake("a", [0.62, 0.70]), b)  # -0.09 > -2 × 0.0707
    assert passed
    passed, line = learn.verdict(_fake("a", [0.9, 0.95]), b)
    assert passed and "above" in line
    # one seed each: the peak evaluation's standard error stands in
    passed, line = learn.verdict(_fake("a", [0.60], stderr=0.03), _fake("b", [0.70], stderr=0.04))
    assert passed and f"{2 * 0.05:.3f}" in line


_TINY_EMBEDDED = ["--tiny.hidden_size", "16", "--tiny.intermediate_size", "32", "--tiny.num_layers", "1",
                  "--tiny.num_heads", "2", "--tiny.num_kv_heads", "1", "--tiny.sft_steps", "2",
                  "--tiny.sft_batch_size", "8", "--tiny.num_demonstrations", "16",
                  "--prompts_per_update", "4", "--responses_per_prompt", "4", "--micro_batch", "16",
                  "--logra.rank", "4"]


def test_learn_main_runs_each_method_and_seed_in_its_own_process(tmp_path, capsys):
    # one `logra train` subprocess (the sweep's run is reused as AdamW's seed-0 run) keeps this fast
    out = tmp_path / "learn"
    argv = ["--methods", "adamw", "--seeds", "1", "--updates", "1", "--eval-problems", "4", "--eval-every", "1",
            "--lr-sweep", "1e-3", "--out-dir", str(out), "--out", str(tmp_path / "learn.json"),
            "--cache_dir", str(tmp_path / "cache"), *_TINY_EMBEDDED]
    assert learn.main(argv) == 0
    printed = capsys.readouterr().out
    assert "REDUCED RUN" in printed and "Learning-rate sweep" in printed and "| 0.001 (chosen) |" in printed
    assert "Extra `logra train` flags for every run: `--cache_dir" in printed
    assert "verdict not evaluated" in printed and "- Dense AdamW: final − start Pass@1" in printed
    payload = json.loads((tmp_path / "learn.json").read_text())
    assert payload["lrs"]["adamw"] == "0.001"
    run_dir = Path(payload["runs"]["Dense AdamW"][0]["run_dir"])
    assert run_dir == out / "lr-sweep" / "adamw-lr0.001-s0"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["optimizer"] == "adamw" and config["lr"] == 1e-3 and config["updates"] == 1
    assert config["tiny"]["hidden_size"] == 16 and config["cache_dir"] == str(tmp_path / "cache")
    assert json.loads((run_dir / "bench_args.json").read_text())["seconds"] > 0
    _png(out / "learning.png")
