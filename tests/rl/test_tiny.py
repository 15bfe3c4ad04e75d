"""Tests for the embedded tiny policy: byte tokenizer, model build, SFT warm start, cache."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2ForCausalLM

from logra.rl import tiny
from logra.rl.tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    TinyPolicyConfig,
    build_tiny_policy,
    byte_tokenizer,
    load_or_warm_start,
    warm_start,
)

TEXTS = [
    "",
    "12 + 7 = 19",
    "  leading and trailing spaces \n\t",
    "héllo wörld — ünïcödé",
    "日本語のテキスト 🎉🚀",
    "<not a special token> \x00\x01\x7f",
]


def _micro_config(**overrides) -> TinyPolicyConfig:
    """A model small enough that a few SFT steps take well under a second each."""
    base = dict(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=32,
        sft_steps=3,
        sft_batch_size=8,
        sft_lr=3e-3,
        sft_warmup_steps=1,
        num_demonstrations=16,
        seed=1,
    )
    base.update(overrides)
    return TinyPolicyConfig(**base)


def _fixed_demos() -> list[tuple[str, str]]:
    return [(f"{a} + {b} =", f" {a + b}") for a in range(4) for b in range(4)]


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


# --- tokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip_is_lossless_and_byte_aligned(text):
    tok = byte_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_special_tokens():
    tok = byte_tokenizer()
    assert len(tok) == 258
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == EOS_TOKEN
    assert {tok.pad_token_id, tok.eos_token_id} == {256, 257}
    # No BOS/EOS sneaks in: prompts must be exactly their bytes.
    assert tok("ab")["input_ids"] == [97, 98]
    assert tok.decode([104, 105, tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "hi"


def test_byte_tokenizer_left_pads_batches():
    tok = byte_tokenizer()
    enc = tok(["1 + 2 =", "33 - 4 ="], padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 8)
    assert enc["input_ids"][0, 0].item() == tok.pad_token_id
    assert enc["attention_mask"][0].tolist() == [0] + [1] * 7
    assert enc["input_ids"][:, -1].tolist() == [ord("="), ord("=")]


def test_byte_tokenizer_save_and_autoload_equal(tmp_path):
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert loaded.padding_side == "left"
    for text in TEXTS:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text


# --- model + prompt ----------------------------------------------------------------


def test_build_tiny_policy_shapes_and_determinism():
    cfg = _micro_config()
    model, tok = build_tiny_policy(cfg)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.vocab_size == len(tok)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    again, _ = build_tiny_policy(cfg)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_batched_generation_with_left_padding_stops_and_pads():
    cfg = _micro_config()
    model, tok = build_tiny_policy(cfg)
    enc = tok(["1 + 2 =", "33 - 44 ="], padding=True, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5)
    assert out.shape[0] == 2 and 0 < out.shape[1] - enc["input_ids"].shape[1] <= 5
    # Left padding: the unpadded row's prompt survives intact at the front.
    assert out[1, : enc["input_ids"].shape[1]].tolist() == enc["input_ids"][1].tolist()


# --- warm start ----------------------------------------------------------------------


def _answer_loss(model, tok, demos) -> float:
    from logra.rl.tiny import _collate, _encode_demonstrations

    seqs, starts = _encode_demonstrations(tok, demos, model.config.max_position_embeddings)
    ids, mask, labels = _collate(seqs, starts, tok.pad_token_id)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()


def test_warm_start_loss_falls_on_fixed_set():
    demos = _fixed_demos()
    cfg = _micro_config(hidden_size=64, intermediate_size=128, sft_steps=60, sft_batch_size=16, sft_warmup_steps=5)
    model, tok = build_tiny_policy(cfg)
    before = _answer_loss(model, tok, demos)
    stats = warm_start(model, tok, demos, cfg, progress=False)
    after = _answer_loss(model, tok, demos)
    assert not model.training
    assert before > 4.0  # ~ln(258) at random init
    assert after < 0.5 * before and after < 1.5, (before, after)
    assert stats["final_loss"] < 0.5 * stats["first_loss"]
    assert stats["seconds"] > 0 and stats["steps"] == 60


def test_warm_start_masks_prompt_tokens():
    from logra.rl.tiny import _collate, _encode_demonstrations

    tok = byte_tokenizer()
    seqs, starts = _encode_demonstrations(tok, [("1 + 2 =", " 3"), ("10 + 20 =", " 30")], 32)
    ids, mask, labels = _collate(seqs, starts, tok.pad_token_id)
    assert labels[0].tolist() == [-100] * 7 + [ord(" "), ord("3"), tok.eos_token_id] + [-100] * 3
    assert labels[1].tolist() == [-100] * 9 + [ord(" "), ord("3"), ord("0"), tok.eos_token_id]
    assert mask[0].tolist() == [1] * 10 + [0] * 3


# --- cache -----------------------------------------------------------------------------


def test_load_or_warm_start_caches_and_skips_training(tmp_path):
    cfg = _micro_config()
    calls = []

    def demos_fn():
        calls.append(1)
        return _fixed_demos()

    m1, tok1, info1 = load_or_warm_start(cfg, tmp_path, demos_fn, "fixed-demos", progress=False)
    assert info1["cache_hit"] is False and len(calls) == 1
    entry = tmp_path / cfg.cache_key("fixed-demos")
    assert (entry / "model.safetensors").is_file()
    assert (entry / "tokenizer.json").is_file()
    assert json.loads((entry / "logra_tiny_info.json").read_text())["warm_start"]["steps"] == cfg.sft_steps
    assert [p.name for p in tmp_path.iterdir()] == [cfg.cache_key("fixed-demos")]  # no temp dir left behind

    m2, tok2, info2 = load_or_warm_start(cfg, tmp_path, demos_fn, "fixed-demos", progress=False)
    assert info2["cache_hit"] is True and len(calls) == 1  # no demos, no training
    assert info2["warm_start"] == info1["warm_start"]
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    assert not m2.training and m2.config.vocab_size == len(tok2)
    assert tok2("héllo")["input_ids"] == tok1("héllo")["input_ids"]
    # The entry is a plain safetensors checkpoint, loadable without logra.
    assert set(load_file(entry / "model.safetensors")) <= set(sd1)


def test_cache_key_tracks_every_recipe_field(tmp_path):
    cfg = _micro_config()
    assert cfg.cache_key() == _micro_config().cache_key()
    assert cfg.cache_key() != _micro_config(sft_steps=4).cache_key()
    assert cfg.cache_key("chain_sum") != cfg.cache_key("basic_arithmetic")
    assert cfg.cache_key() != _micro_config(seed=2).cache_key()
    assert cfg.cache_key() != _micro_config(shipped=False).cache_key()  # a trained entry is not the shipped one


def test_demonstrations_that_do_not_fit_are_refused():
    cfg = _micro_config()
    model, tok = build_tiny_policy(cfg)
    long = [("x" * (cfg.max_position_embeddings + 5), " 1")]
    with pytest.raises(ValueError, match="no demonstration fits"):
        warm_start(model, tok, long, cfg, progress=False)


def test_warm_start_is_the_same_whatever_the_thread_count():
    """The warm start is a function of its config: 1 and 2 threads give bitwise the same policy."""
    demos = _fixed_demos() * 4
    cfg = _micro_config(hidden_size=64, intermediate_size=128, sft_steps=8, sft_batch_size=32)
    states = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        model, tok = build_tiny_policy(cfg)
        warm_start(model, tok, demos, cfg, progress=False)
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_cache_key_tracks_library_versions(monkeypatch):
    import transformers

    key = _micro_config().cache_key("d")
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert _micro_config().cache_key("d") != key


# --- the shipped warm start of the embedded default ------------------------------------


@pytest.fixture(scope="module")
def default_demos():
    """The embedded recipe's tiny config and its SFT demonstrations (20000, under a second)."""
    from logra.rl.build import warm_start_demonstrations
    from logra.rl.config import build_task, recipe_config

    config = recipe_config("embedded")
    return config.tiny, warm_start_demonstrations(config, build_task(config))


def _shipped_file():
    (record,) = tiny._SHIPPED_DIR.glob("*.json")
    return record.with_suffix(".safetensors")


def test_embedded_default_loads_the_shipped_warm_start_instead_of_training(tmp_path, monkeypatch, default_demos):
    config, demos = default_demos
    monkeypatch.setattr(tiny, "warm_start", lambda *a, **k: pytest.fail("the default policy was trained"))
    model, _, info = load_or_warm_start(config, tmp_path, lambda: demos, "default", progress=False)
    state, shipped = model.state_dict(), load_file(_shipped_file())
    assert shipped and all(torch.equal(state[k], v) for k, v in shipped.items())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert not model.training and info["cache_hit"] is False and info["shipped"]["file"] == str(_shipped_file())
    # the cache entry is written as for a trained policy, so a hit (and `bench spectrum`) reads it
    again, _, info2 = load_or_warm_start(config, tmp_path, lambda: pytest.fail("demos on a hit"), "default",
                                         progress=False)
    assert info2["cache_hit"] is True and info2["shipped"]["checksum"] == info["shipped"]["checksum"]
    assert all(torch.equal(again.state_dict()[k], v) for k, v in shipped.items())


def test_shipped_warm_start_only_for_its_own_config_and_demonstrations(default_demos):
    config, demos = default_demos
    model, _ = build_tiny_policy(config)
    random_init = {k: v.clone() for k, v in model.state_dict().items()}
    for other_config, other_demos in [(config, demos[:-1]), (config, [(p + " ", a) for p, a in demos]),
                                      (dataclasses.replace(config, sft_steps=299), demos),
                                      (dataclasses.replace(config, shipped=False), demos)]:
        assert tiny._load_shipped(model, other_config, other_demos) is None
        assert all(torch.equal(v, random_init[k]) for k, v in model.state_dict().items())  # left as it was
    assert tiny._load_shipped(model, config, demos) is not None
    assert not torch.equal(model.model.norm.weight, random_init["model.norm.weight"])


def test_damaged_shipped_weights_are_refused(tmp_path, monkeypatch, default_demos):
    config, demos = default_demos
    folder = tmp_path / "shipped"
    shutil.copytree(tiny._SHIPPED_DIR, folder)
    weights = folder / _shipped_file().name
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] += 1e-3
    save_file(tensors, weights)
    monkeypatch.setattr(tiny, "_SHIPPED_DIR", folder)
    with pytest.raises(RuntimeError, match="damaged"):
        tiny._load_shipped(build_tiny_policy(config)[0], config, demos)
