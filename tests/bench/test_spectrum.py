"""`logra bench spectrum`: the statistics against hand computations, and ΔW of real tiny runs
against the checkpoint and warm-start files read directly."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from logra import cli, weights_checksum
from logra.bench.spectrum import ENERGY, accumulated_updates, main, spectrum_stats, warm_start_path
from logra.rl.cli import main as train_main

torch.set_num_threads(1)

RANK = 4
# two updates of a 2-layer, 32-wide embedded policy; partial credit so that rewards (and
# therefore updates) are not all zero after the short warm start
TRAIN = ["--tiny.hidden_size", "32", "--tiny.intermediate_size", "64", "--tiny.num_layers", "2",
         "--tiny.sft_steps", "40", "--tiny.sft_batch_size", "32", "--tiny.sft_warmup_steps", "5",
         "--tiny.num_demonstrations", "512", "--partial_credit", "true", "--updates", "2",
         "--prompts_per_update", "8", "--responses_per_prompt", "4", "--eval_problems", "2", "--eval_samples", "4",
         "--eval_every", "0", "--kl.probe_responses", "2", "--logra.rank", str(RANK), "--threads", "1", "--quiet",
         "--train_pool", "0"]  # not the recipe's pool of 179 200 draws (~5 s to build)
# decoder-linear of a 2-layer Qwen2
TARGETS = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoGRA run (embedded default: one projection per layer, fitted to its inputs), one with
    a seeded projection and a LoRA run from the same cached warm start."""
    root = tmp_path_factory.mktemp("spectrum")
    cache = root / "cache"
    for name, extra in (("logra", []), ("lora", ["--optimizer", "lora", "--lr", "1e-2"]),
                        ("seeded", ["--logra.distribution", "rademacher"])):
        assert train_main([*TRAIN, *extra, "--run_dir", str(root / name), "--cache_dir", str(cache)]) == 0
    (entry,) = list(cache.iterdir())  # the one warm start the runs used
    return {"logra": root / "logra", "lora": root / "lora", "seeded": root / "seeded",
            "w0": entry / "model.safetensors", "root": root}


def _orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]


def test_statistics_of_a_known_spectrum():
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    delta = _orthogonal(6, g) @ torch.diag(sigma) @ _orthogonal(8, g)[:6]
    base = torch.randn(6, 8, generator=g)
    stats = spectrum_stats(delta, base)
    p = [3 / 6, 2 / 6, 1 / 6]
    assert stats["effective_rank"] == pytest.approx(math.exp(-sum(x * math.log(x) for x in p)), rel=1e-9)
    # energies 9, 4, 1 of 14: 9/14 = 0.64 < 0.9 <= 13/14 = 0.93
    assert stats["energy_rank"] == 2
    assert stats["relative_norm"] == pytest.approx(math.sqrt(14) / base.double().norm().item(), rel=1e-9)
    assert stats["min_dim"] == 6
    # k equal singular values: effective rank k
    flat = _orthogonal(6, g)[:, :3] @ _orthogonal(8, g)[:3]
    assert spectrum_stats(flat, base)["effective_rank"] == pytest.approx(3.0, rel=1e-9)
    assert spectrum_stats(flat, base)["energy_rank"] == 3  # 2/3 < 0.9 <= 3/3
    assert ENERGY == 0.9


def test_a_rank_k_product_has_a_small_energy_rank_and_a_zero_update_has_none():
    g = torch.Generator().manual_seed(1)
    low = torch.randn(40, 3, generator=g) @ torch.randn(3, 50, generator=g)
    stats = spectrum_stats(low, torch.ones(40, 50))
    assert stats["energy_rank"] <= 3 and stats["effective_rank"] <= 3 + 1e-6
    zero = spectrum_stats(torch.zeros(5, 7), torch.ones(5, 7))
    assert zero["energy_rank"] == 0 and zero["relative_norm"] == 0 and math.isnan(zero["effective_rank"])


def test_logra_update_is_read_back_exactly_and_has_rank_at_most_r(runs):
    config = json.loads((runs["logra"] / "config.json").read_text())
    assert config["optimizer"] == "logra" and config["logra"]["refresh"] is False
    assert config["logra"]["rank"] == RANK
    deltas = accumulated_updates(runs["logra"])
    assert set(deltas) == TARGETS
    final = load_file(runs["logra"] / "checkpoint" / "model.safetensors")
    initial = load_file(runs["w0"])
    for name, delta in deltas.items():
        expected = final[name].double() - initial[name].double()
        assert delta.dtype == torch.float64
        torch.testing.assert_close(delta, expected, rtol=0, atol=0)
        sigma = torch.linalg.svdvals(expected)
        assert sigma[0] > 0, name  # the run moved every target
        assert min(expected.shape) > RANK
        assert sigma[RANK] / sigma[0] < 1e-5, (name, (sigma[:RANK + 2] / sigma[0]).tolist())


def test_lora_update_is_scaled_b_times_a(runs):
    deltas = accumulated_updates(runs["lora"])
    assert set(deltas) == TARGETS
    saved = load_file(runs["lora"] / "checkpoint" / "model.safetensors")
    initial = load_file(runs["w0"])
    for name, delta in deltas.items():
        module = "base_model.model." + name.removesuffix(".weight")
        a, b = saved[f"{module}.lora_A.default.weight"].double(), saved[f"{module}.lora_B.default.weight"].double()
        assert a.shape[0] == RANK  # lora_rank 0: the LoGRA rank
        alpha = RANK  # build_optimizer: lora_alpha = r
        base_change = saved[f"{module}.base_layer.weight"].double() - initial[name].double()
        assert torch.equal(base_change, torch.zeros_like(base_change))  # the base is frozen
        expected = alpha / RANK * b @ a
        assert expected.abs().max() > 0, name
        torch.testing.assert_close(delta, expected, rtol=1e-12, atol=1e-15)
        assert torch.linalg.matrix_rank(delta) <= RANK


def test_a_run_records_the_checksum_of_the_weights_it_started_from(runs):
    for run in (runs["logra"], runs["lora"]):
        recorded = json.loads((run / "summary.json").read_text())["policy"]["checksum"]
        assert recorded == weights_checksum(load_file(runs["w0"]))
        assert recorded != weights_checksum(load_file(run / "checkpoint" / "model.safetensors"))  # it moved


def test_the_warm_start_key_is_recomputed_without_a_summary(runs, tmp_path):
    # the run records its cache entry; with summary.json gone the trainer's own key
    # functions must find the same one
    assert warm_start_path(runs["logra"]) == runs["w0"].parent
    bare = tmp_path / "bare"
    shutil.copytree(runs["logra"], bare, ignore=shutil.ignore_patterns("summary.json"))
    assert warm_start_path(bare) == runs["w0"].parent
    torch.testing.assert_close(accumulated_updates(bare), accumulated_updates(runs["logra"]), rtol=0, atol=0)


def test_command_prints_tables_cosines_and_writes_the_figure(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(runs["logra"]), str(runs["lora"]), "--label", "L", "R", "--reference", "L",
                 "--out-dir", str(out), "--json", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "| L | q_proj | 2 | 32 |" in text and "| R | down_proj | 2 | 32 |" in text
    assert "Cosine of ΔW with the reference (L)" in text and "| L | 1.000 | 1.000 |" in text
    assert (out / "spectrum.png").stat().st_size > 0
    data = json.loads((tmp_path / "s.json").read_text())
    a, b = accumulated_updates(runs["logra"]), accumulated_updates(runs["lora"])
    name = "model.layers.1.mlp.up_proj.weight"
    cosine = float((a[name] * b[name]).sum() / (a[name].norm() * b[name].norm()))
    assert data["runs"]["R"]["cosines"][name] == pytest.approx(cosine, rel=1e-9)
    assert abs(cosine) < 0.999  # two different updates
    kind = [c for n, c in data["runs"]["R"]["cosines"].items() if n.endswith("up_proj.weight")]
    assert data["runs"]["R"]["kinds"]["up_proj"]["cosine"] == pytest.approx(sum(kind) / 2, rel=1e-12)
    stats = data["runs"]["L"]["weights"][name]
    assert stats["energy_rank"] <= RANK and len(stats["singular_values"]) == 32
    # listed under `logra bench --help`, reachable through the dispatcher
    assert cli.main(["bench", "--help"]) == 0 and "spectrum" in capsys.readouterr().out


def test_a_logra_update_lies_inside_its_own_subspace_and_others_partly(runs, tmp_path, capsys):
    """The share of ‖ΔW‖² inside the fixed projection's row space: exactly 1 for the LoGRA run
    (every update is U·A with that A), less for LoRA (its A is learned)."""
    assert main([str(runs["logra"]), str(runs["lora"]), "--label", "L", "R", "--subspace", str(runs["logra"]),
                 "--out-dir", str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0
    assert "Share of ‖ΔW‖² inside the input subspace" in capsys.readouterr().out
    data = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert set(data["L"]["inside"]) == TARGETS
    assert all(x == pytest.approx(1.0, abs=1e-6) for x in data["L"]["inside"].values())
    assert all(0 < x < 0.99 for x in data["R"]["inside"].values())
    with pytest.raises(SystemExit, match="needs a LoGRA run with refresh=False"):
        main([str(runs["lora"]), "--subspace", str(runs["lora"]), "--out-dir", str(tmp_path)])
    # a seeded projection is rebuilt from the run's seed (the fitted one above came from the
    # default run's checkpoint): the seeded run's update lies inside it, the default run's does not
    assert main([str(runs["seeded"]), str(runs["logra"]), "--label", "S", "L", "--subspace", str(runs["seeded"]),
                 "--out-dir", str(tmp_path), "--json", str(tmp_path / "s2.json")]) == 0
    data = json.loads((tmp_path / "s2.json").read_text())["runs"]
    assert all(x == pytest.approx(1.0, abs=1e-6) for x in data["S"]["inside"].values())
    assert all(0 < x < 0.99 for x in data["L"]["inside"].values())


def test_refusals_are_one_line(runs, tmp_path):
    def refused(argv, match):
        with pytest.raises(SystemExit, match=match):
            main([*argv, "--out-dir", str(tmp_path)])

    empty = tmp_path / "empty"
    empty.mkdir()
    refused([str(empty)], "config.json is unreadable")
    (empty / "config.json").write_text("{")
    refused([str(empty)], "config.json is unreadable")
    shutil.copy(runs["logra"] / "config.json", empty / "config.json")
    refused([str(empty)], "no checkpoint/model.safetensors")

    # a checkpoint with no decoder weight, and one whose shapes do not fit W_0
    final = load_file(runs["logra"] / "checkpoint" / "model.safetensors")
    for name, tensors, match in (
            ("untargeted", {"model.norm.weight": final["model.norm.weight"]}, "none of the decoder layers"),
            ("reshaped", {**final, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, "shape")):
        run = tmp_path / name
        shutil.copytree(runs["logra"], run)
        save_file(tensors, run / "checkpoint" / "model.safetensors")
        refused([str(run)], match)

    # a cache entry that is not what the run started from (rebuilt since, or another
    # machine's): the run's recorded checksum refuses it
    other = tmp_path / "other"
    shutil.copytree(runs["logra"], other)
    cache = tmp_path / "cache" / runs["w0"].parent.name
    shutil.copytree(runs["w0"].parent, cache)
    w0 = load_file(runs["w0"])
    w0["model.layers.1.self_attn.v_proj.weight"] += 1e-3
    save_file(w0, cache / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "cache_dir": str(tmp_path / "cache")}))
    refused([str(other)], "does not hold the weights")
    refused([str(runs["logra"]), "--base", str(cache)], "does not hold the weights")
    partial = tmp_path / "partial.safetensors"
    save_file({n: t for n, t in load_file(runs["w0"]).items() if n != "model.norm.weight"}, partial)
    refused([str(runs["logra"]), "--base", str(partial)], "does not hold the weights")
    # without the record (a run of an older version) it reads alone, but cannot be paired
    # with a run that started elsewhere
    (other / "summary.json").unlink()
    assert main([str(other), "--out-dir", str(tmp_path)]) == 0
    refused([str(other), "--reference", str(runs["logra"])], "started from different weights")
    refused([str(runs["logra"]), "--base", str(tmp_path / "missing")], "do not exist")
