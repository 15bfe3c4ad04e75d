"""`logra train` as a new user runs it: recipes, each task kind, one-line errors, the help text."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from transformers import Qwen2Config

from conftest import save_local_model
from logra import cli
from logra.errors import MissingExtraError
from logra.rl import RLConfig, build_task, rank_for_width, recipe_config
from logra.rl.cli import _parser, build_config, run_config
from logra.rl.cli import main as train_main

# one short update and a small evaluation: what matters is that each task kind runs
SHORT = ["--updates", "1", "--prompts_per_update", "2", "--responses_per_prompt", "2", "--eval_problems", "2",
         "--eval_every", "0", "--checkpoint_every", "0", "--kl.probe_responses", "2", "--logra.rank", "4",
         "--quiet"]
# the tiny policy's warm start, shortened; long enough positions for the longest rg-hard prompts
TINY = ["--tiny.sft_steps", "2", "--tiny.sft_batch_size", "2", "--tiny.num_demonstrations", "8",
        "--tiny.max_position_embeddings", "8192", "--max_new_tokens", "4"]


@pytest.fixture(scope="module")
def math_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("math") / "problems.jsonl"
    rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A saved random Qwen2 with a byte-level tokenizer, as a user's `--model` path."""
    return save_local_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # some reasoning-gym generators write scratch files to the working directory


def _run(tmp_path, *argv: str) -> dict:
    run = tmp_path / "run"
    assert train_main([*argv, *SHORT, "--run_dir", str(run), "--cache_dir", str(tmp_path / "cache")]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"] == 1
    return json.loads((run / "config.json").read_text())


def _kinds(math_file) -> dict[str, str]:
    return {"reasoning-gym": "basic_arithmetic", "mixture": "chain_sum:0.5,basic_arithmetic:0.5",
            "rg-hard": "rg-hard", "math": f"math:{math_file}"}


@pytest.mark.parametrize("kind", ["reasoning-gym", "mixture", "math",
                                  pytest.param("rg-hard", marks=pytest.mark.slow)])  # 6.7k-byte prompts: ~70 s
def test_each_task_kind_runs_on_the_tiny_policy(tmp_path, math_file, kind):
    """The embedded recipe's chain_sum options never leak into another task."""
    config = _run(tmp_path, "--task", _kinds(math_file)[kind], *TINY)
    assert config["model"] == "" and config["logra"]["rank"] == 4
    assert config["task_config"] is None and config["strip_prefix"] is None and config["partial_credit"] is False
    assert config["extract"] == "full" and config["instruction"] == ""  # the tiny policy answers bare
    assert config["train_pool"] == 0  # the recipe's pool belongs to chain_sum: another task gets the generic one


@pytest.mark.parametrize("kind", ["reasoning-gym", "mixture", "math", "rg-hard"])
def test_each_task_kind_runs_on_a_saved_local_model(tmp_path, math_file, local_model, kind):
    """A `--model` run takes recipe 'model' (the plain defaults but for the LoGRA update) and each
    task's own answer format."""
    config = _run(tmp_path, "--model", str(local_model), "--task", _kinds(math_file)[kind], "--max_new_tokens", "4")
    assert config["extract"] is None and config["instruction"] is None and config["task_config"] is None
    assert config["logra"]["non_target"] == "freeze" and config["kl"]["budget"] == 2e-4  # the paper's
    assert config["logra"]["optimizer"] == "adam" and config["logra"]["refresh"] is False  # the embedded update
    task = build_task(RLConfig(**{k: config[k] for k in ("task", "eval_fraction")}))
    expected = "boxed" if kind == "math" else "answer"
    leaves = getattr(task, "tasks", [task])
    assert {leaf.extract for leaf in leaves} == ({"answer"} if kind == "mixture" else {expected})


def test_embedded_recipe_is_the_default_and_its_task_options_stay_with_chain_sum():
    embedded = build_config({}, "embedded")
    assert embedded == recipe_config("embedded")
    assert embedded.task == "chain_sum" and embedded.max_new_tokens == 6 and embedded.logra.rank == 48
    # the paper's RL recipe, one response to each of 256 prompts, 700 updates at a KL budget of
    # 4e-3 -> 4e-4 (docs/learning.md, section 22)
    assert (embedded.algorithm, embedded.prompts_per_update, embedded.responses_per_prompt, embedded.updates) == \
        ("reinforce", 256, 1, 700)
    assert (embedded.kl.budget, embedded.kl.budget_final) == (4e-3, 4e-4)
    assert embedded.task_config == {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
    assert embedded.train_pool == 700 * 256  # every question of the training split (section 28)
    other = build_config({"task": "basic_arithmetic"}, "embedded")
    assert other.logra.rank == 48 and other.task_config is None and other.strip_prefix is None
    assert other.max_new_tokens == 16 and other.train_pool == 0
    plain = build_config({"model": "/some/path"})
    assert plain.logra.rank == 256 and plain.max_new_tokens == 512 and plain.extract is None


@pytest.mark.parametrize("width, rank", [
    (128, 48), (256, 48),  # the tiny policies of docs/learning.md
    (576, 96),  # SmolLM2-135M (recipe smollm2-135m)
    (1536, 256), (5120, 256),  # the paper's rank, in/r = 6 and 20
    (32, 32), (1024, 176), (336, 64), (240, 48),  # below the width; steps of 16, halves round up
])
def test_rank_for_width_gives_the_ranks_we_measured(width, rank):
    assert rank_for_width(width) == rank
    # the rule in words: width / 6 to the nearest multiple of 16 (halves up), within [48, 256] and ≤ width
    assert rank == min(width, 256, max(48, 16 * math.floor(width / 96 + 0.5)))


def test_a_model_run_gets_the_embedded_update_with_the_rank_of_its_width(tmp_path, local_model):
    wide = tmp_path / "wide"  # a config alone: the rule reads the model's width, never its weights
    Qwen2Config(hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(wide)
    config = build_config({"model": str(wide)}, "model")
    assert config.logra.rank == 96 and config.logra.update_ratio == 1e-4
    assert (config.logra.optimizer, config.logra.beta1, config.logra.refresh, config.logra.trust_ratio,
            config.logra.distribution) == ("adam", 0.9, False, "layer", "inputs")
    assert build_config({"model": str(wide), "logra.rank": 64}, "model").logra.rank == 64  # a given rank stays
    paper = build_config({"model": str(wide)})  # what `--recipe none` builds: the paper's update
    assert (paper.logra.rank, paper.logra.optimizer, paper.logra.refresh) == (256, "row_adam", True)
    with pytest.raises(SystemExit, match="give a model"):
        build_config({}, "model")
    # `logra train --model PATH` with no recipe: 'model', here capped at the width (32)
    short = SHORT[:SHORT.index("--logra.rank")] + ["--quiet"]
    run = tmp_path / "run"
    assert train_main(["--model", str(local_model), "--task", "basic_arithmetic", "--max_new_tokens", "4", *short,
                       "--run_dir", str(run)]) == 0
    saved = json.loads((run / "config.json").read_text())["logra"]
    assert (saved["rank"], saved["optimizer"]) == (32, "adam")


def test_run_config_reads_back_what_a_finished_run_was_started_with(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint"):
        run_config(tmp_path)
    _run(tmp_path, *TINY, "--seed", "5", "--task_config", "{min_terms: 2, max_terms: 2}", "--kl.budget", "0.002",
         "--train_pool", "0")  # not the recipe's pool of 179 200 draws (~5 s to build)
    config = run_config(tmp_path / "run")
    assert (config.seed, config.task_config, config.kl.budget) == (5, {"min_terms": 2, "max_terms": 2}, 0.002)
    assert (config.logra.rank, config.tiny.sft_steps, config.max_new_tokens) == (4, 2, 4)


def test_a_run_saved_with_settings_its_optimizer_never_read_still_resumes(tmp_path, capsys):
    """Older versions saved a baseline's lr (or logra.lr beside an update ratio) in a LoGRA run's
    config; they are refused now, so reading the run resets them to their defaults instead."""
    from logra.rl.checkpoint import save_checkpoint

    saved = RLConfig().to_dict()
    saved.update(lr=3e-4, lora_rank=8)
    saved["logra"]["lr"] = 0.01
    save_checkpoint(tmp_path / "logra", torch.nn.Linear(2, 2), {"update": 3}, saved)
    config = run_config(tmp_path / "logra")
    assert (config.lr, config.lora_rank, config.logra.lr) == (RLConfig().lr, RLConfig().lora_rank, RLConfig().logra.lr)
    err = capsys.readouterr().err
    assert "lr=0.0003" in err and "lora_rank=8" in err and "logra.lr=0.01" in err
    saved.update(optimizer="adamw")  # read by AdamW: kept (lora_rank and logra.lr are not)
    save_checkpoint(tmp_path / "adamw", torch.nn.Linear(2, 2), {"update": 3}, saved)
    assert run_config(tmp_path / "adamw").lr == 3e-4
    # a resumed LoGRA run still takes (and compares) unread settings given at their defaults
    _run(tmp_path, *TINY, "--train_pool", "0")
    assert train_main(["--resume", str(tmp_path / "run"), "--lr", str(RLConfig().lr), "--quiet"]) == 0


def test_help_shows_the_embedded_defaults(capsys):
    text = " ".join(_parser().format_help().split())
    assert "--logra.rank INT" in text
    assert "(default: 48; with --recipe none: 256)" in text
    assert "(default: 'chain_sum')" in text


@pytest.mark.parametrize("argv, message", [
    (["--logra.rank", "0"], "rank must be a positive int"),
    (["--updates", "-3"], "updates must be >= 1"),
    (["--kl.budget", "-1"], "budgets"),
    (["--eval_fraction", "2"], "eval_fraction"),
    (["--logra.optimizer", "lion"], "optimizer"),
    (["--updates", "many"], "expects an int"),
])
def test_invalid_values_are_one_line_errors(argv, message):
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    text = str(e.value)
    assert text.startswith("logra train: ") and message in text and "\n" not in text


def test_a_missing_task_file_or_bad_device_is_one_line(tmp_path):
    for argv in (["--task", f"math:{tmp_path}/missing.jsonl"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as e:
            train_main([*argv, "--run_dir", str(tmp_path / "run"), "--cache_dir", str(tmp_path / "cache")])
        assert str(e.value).startswith("logra train: ") and "\n" not in str(e.value)


def test_an_option_the_task_kind_does_not_take_is_a_clear_error(tmp_path, math_file):
    with pytest.raises(SystemExit, match=r"logra train: task 'math:.*' refused its options .*task_config"):
        train_main(["--task", f"math:{math_file}", "--task_config", "{min_terms: 2}", "--run_dir", str(tmp_path)])


def test_a_missing_extra_is_named(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    assert cli.main(["train"]) == 2
    assert "pip install 'logra[rl]'" in capsys.readouterr().err
    from logra._optional import require

    with pytest.raises(MissingExtraError, match=r"logra\[rl\]"):
        require("reasoning_gym")
