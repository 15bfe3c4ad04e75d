"""`logra estimate`: shapes, the saved-activation model, and predictions vs MemTracker."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from logra import LoGRAConfig, LoGRAOptimizer
from logra.estimate import (
    BUILTIN_SHAPES,
    CATEGORIES,
    GIB,
    PAPER_TABLE,
    ModelShape,
    compare_with_tracker,
    estimate,
    main,
    measure_saved_activations,
    paper_comparison,
    predict_saved_activations,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _meta_parameter_count(shape: ModelShape) -> int:
    """Parameters of the real HF model of this shape, built on the meta device (no memory)."""
    kwargs = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, tie_word_embeddings=shape.tie_embeddings,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs)) if shape.qkv_bias else LlamaForCausalLM(LlamaConfig(**kwargs))
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("name", list(BUILTIN_SHAPES))
def test_builtin_shapes_count_parameters_like_the_hf_model(name: str) -> None:
    shape = ModelShape.named(name)
    assert shape.num_parameters == _meta_parameter_count(shape)


def test_builtin_shapes_have_the_published_sizes() -> None:
    sizes = {name: s.num_parameters / 1e9 for name, s in BUILTIN_SHAPES.items()}
    assert sizes["Qwen2.5-1.5B"] == pytest.approx(1.54, abs=0.01)
    assert sizes["Qwen2.5-7B"] == pytest.approx(7.62, abs=0.01)
    assert sizes["Llama-3-8B"] == pytest.approx(8.03, abs=0.01)
    assert sizes["Llama-3-70B"] == pytest.approx(70.55, abs=0.01)
    assert sizes["dense-27B"] == pytest.approx(27.0, abs=0.1)


def test_named_is_case_insensitive_and_knows_aliases() -> None:
    assert ModelShape.named("qwen2.5-7b") is BUILTIN_SHAPES["Qwen2.5-7B"]
    assert ModelShape.named("Qwen2.5-Math-1.5B") is BUILTIN_SHAPES["Qwen2.5-1.5B"]


def test_unknown_model_name_lists_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError) as err:
        ModelShape.named("gpt-5-mini")
    for name in BUILTIN_SHAPES:
        assert name in str(err.value)
    assert main(["--model", "gpt-5-mini"]) == 2
    assert "Llama-3-70B" in capsys.readouterr().err


def test_from_config_reads_a_config_json(tmp_path) -> None:
    cfg = Qwen2Config(vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(cfg.to_json_string())
    shape = ModelShape.from_config(path)
    assert shape == ModelShape("my-model", 1000, 96, 3, 6, 2, 200, head_dim=16, tie_embeddings=True, qkv_bias=True)
    assert ModelShape.from_config(path.parent) == shape
    assert shape.num_parameters == sum(p.numel() for p in Qwen2ForCausalLM(cfg).parameters())
    # multimodal configs keep the language model under text_config
    nested = ModelShape.from_config({"model_type": "llava", "text_config": LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).to_dict()})
    assert (nested.vocab_size, nested.num_kv_heads, nested.qkv_bias) == (500, 4, False)
    # and the CLI accepts the path (at a rank LoGRA can run on 96-wide layers; the default 256 is refused)
    assert main(["--model", str(path), "--seq", "64", "--rank", "64", "--json"]) == 0


def test_from_config_rejects_a_non_decoder_config() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"vocab_size": 10})


# ----------------------------------------------------------------------------- saved activations
def _tiny(arch: str, attention: str, dtype: torch.dtype, tie: bool) -> torch.nn.Module:
    # dimensions unlike those the coefficients were read off (h=96, I=200, 6 heads / 2 kv)
    kwargs = dict(vocab_size=211, hidden_size=48, intermediate_size=112, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=3, max_position_embeddings=64, pad_token_id=0, attn_implementation=attention,
                  tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**kwargs))
    return model.to(dtype)


CASES = [
    # method, precision, attention, padded, arch, tied
    ("adamw", "fp32", "sdpa", False, "qwen2", False),
    ("adamw", "autocast", "sdpa", True, "llama", True),
    ("adamw", "bf16", "eager", False, "qwen2", False),
    ("lora", "fp32", "eager", False, "llama", False),
    ("lora", "autocast", "sdpa", False, "qwen2", True),
    ("lora", "bf16", "sdpa", True, "qwen2", False),
    ("logra-freeze", "fp32", "sdpa", False, "qwen2", False),
    ("logra-freeze", "autocast", "sdpa", False, "llama", False),
    ("logra-freeze", "bf16", "sdpa", True, "qwen2", True),
    ("logra-freeze", "autocast", "eager", False, "qwen2", False),
    ("logra-sketch", "fp32", "sdpa", True, "llama", True),
    ("logra-sketch", "autocast", "sdpa", False, "qwen2", False),
    ("logra-sketch", "bf16", "eager", False, "llama", False),
]


@pytest.mark.filterwarnings("ignore:.*target weights are torch.bfloat16")
@pytest.mark.parametrize("method,precision,attention,padded,arch,tie", CASES)
def test_predicted_saved_activations_equal_the_measured_bytes(method, precision, attention, padded, arch, tie) -> None:
    import peft

    model = _tiny(arch, attention, torch.bfloat16 if precision == "bf16" else torch.float32, tie)
    shape = ModelShape.from_model(model)
    rank, batch, seq = 4, 3, 20
    if method.startswith("logra"):
        LoGRAOptimizer(model, LoGRAConfig(rank=rank, non_target=method.split("-")[1]))
    elif method == "lora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=TARGETS, lora_dropout=0.0))
    ids = torch.randint(1, shape.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -4:] = 0
    measured = measure_saved_activations(model, {"input_ids": ids, "attention_mask": mask, "labels": ids},
                                         autocast=precision == "autocast")
    predicted = predict_saved_activations(shape, method, seq=seq, batch=batch, rank=rank, precision=precision,
                                          attention=attention, padded=padded)
    assert measured == predicted


def test_logra_saves_less_than_adamw_and_the_difference_is_what_goes_away() -> None:
    shape = BUILTIN_SHAPES["Qwen2.5-7B"]
    kw = dict(seq=1024, batch=1, rank=256, precision="bf16")
    dense = predict_saved_activations(shape, "adamw", **kw)
    logra = predict_saved_activations(shape, "logra-freeze", **kw)
    h, inter, n = shape.hidden_size, shape.intermediate_size, 1024
    # per layer: the two norms' normalised outputs and outputs (2 + 2 bytes each), the
    # MLP product (down's input) go; seven P = X Aᵀ (r values, bf16) come
    gone = (2 * (2 * h + 2 * h) + 2 * inter) * n
    came = 7 * 256 * 2 * n
    assert dense.layers[1] - logra.layers[1] == gone - came


# ----------------------------------------------------------------------------- vs MemTracker
# ~11M parameters (Qwen2, untied 16k vocabulary), batch 2 × 128 tokens.
TRACKED = ModelShape("qwen2-11M", vocab_size=16384, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=704, tie_embeddings=False, qkv_bias=True)


@pytest.mark.parametrize("method", ["adamw", "logra-freeze"])
def test_prediction_is_within_10_percent_of_memtracker(method: str) -> None:
    torch.manual_seed(0)
    result = compare_with_tracker(TRACKED, method, batch=2, seq=128, rank=64)
    measured, predicted = result["measured"], result["predicted"]
    assert predicted["total"] == pytest.approx(measured["total"], rel=0.10)
    for category in ("parameters", "gradients", "optimizer"):
        assert predicted[category] == pytest.approx(measured[category], rel=0.02, abs=64 * 1024)
    # the peak instant is modelled too: AdamW peaks in the step (no activations left),
    # LoGRA at the start of backward (activations + logits gradients)
    if method == "adamw":
        assert measured["activations"] < 1024 and result["peak_phase"]["predicted"] == "optimizer step"
    else:
        assert measured["activations"] > 0 and result["peak_phase"]["predicted"] == "loss backward"
        assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.05)


def test_checkpointed_logra_within_10_percent_of_memtracker() -> None:
    shape = ModelShape("qwen2-small", 4096, 128, 3, 4, 2, 512, qkv_bias=True)
    result = compare_with_tracker(shape, "logra-freeze", batch=2, seq=128, rank=32, checkpointing=True, autocast=True)
    assert result["predicted"]["total"] == pytest.approx(result["measured"]["total"], rel=0.10)


# a small vocabulary and checkpointing: the optimizer step holds the peak
STEP_BOUND = ModelShape("qwen2-step-bound", vocab_size=512, hidden_size=256, num_layers=6, num_heads=4,
                        num_kv_heads=2, intermediate_size=704, tie_embeddings=False, qkv_bias=True)


@pytest.mark.parametrize("method", ["logra-freeze", "logra-sketch"])
def test_logra_step_peak_within_2_percent_of_memtracker(method: str) -> None:
    """The step's transients (directions, factors, Gram matrices, checks) are what is
    predicted: the whole sketch buffer's size of extra scratch would be 13% here."""
    torch.manual_seed(0)
    result = compare_with_tracker(STEP_BOUND, method, batch=2, seq=64, rank=64, checkpointing=True)
    assert result["peak_phase"]["predicted"] == "optimizer step"
    assert result["predicted"]["total"] == pytest.approx(result["measured"]["total"], rel=0.02)
    assert result["predicted"]["optimizer"] == pytest.approx(result["measured"]["optimizer"], rel=0.03)


# ----------------------------------------------------------------------------- estimate
def test_logra_state_is_the_sketch_moments_and_projections() -> None:
    shape = BUILTIN_SHAPES["Qwen2.5-1.5B"]
    est = estimate(shape, "logra-freeze", rank=128, seq=512)
    out = shape.num_layers * sum(o for _, o, _ in shape.targets())
    cols = shape.num_layers * sum(i for _, _, i in shape.targets())
    assert est.sketch_values == out * 128
    phase = est.phases["loss backward"]
    assert phase["gradients"] == out * 128 * 4
    assert phase["optimizer"] == out * 4 + cols * 128 // 8  # projection signs as bits
    assert est.trainable_parameters == 0


def test_fsdp_divides_sharded_state_but_not_activations_or_the_sketch() -> None:
    shape = BUILTIN_SHAPES["Qwen2.5-7B"]
    one = estimate(shape, "adamw", seq=2048, shard="fsdp", gpus=1, checkpointing=True)
    four = estimate(shape, "adamw", seq=2048, shard="fsdp", gpus=4, checkpointing=True)
    assert four.phases["optimizer step"]["optimizer"] * 4 == pytest.approx(
        one.phases["optimizer step"]["optimizer"], rel=1e-6)
    assert four.phases["loss backward"]["activations"] == one.phases["loss backward"]["activations"]
    l1 = estimate(shape, "logra-freeze", seq=2048, shard="fsdp", gpus=1)
    l4 = estimate(shape, "logra-freeze", seq=2048, shard="fsdp", gpus=4)
    assert l4.phases["loss backward"]["gradients"] == l1.phases["loss backward"]["gradients"]


def test_logra_needs_less_memory_than_dense_adam_and_the_27b_dense_does_not_fit() -> None:
    for name in ("Qwen2.5-1.5B", "Qwen2.5-7B", "Llama-3-8B"):
        dense = estimate(name, "adamw", seq=4096, checkpointing=True)
        logra = estimate(name, "logra-freeze", seq=4096, checkpointing=True)
        assert logra.total < dense.total
    dense27 = estimate("dense-27B", "adamw", seq=16384, gpus=4, shard="fsdp", checkpointing=True, logits_chunk=1024)
    assert not dense27.fits and dense27.total > 80 * GIB


def test_estimate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="method"):
        estimate("Qwen2.5-7B", "sgd")
    with pytest.raises(ValueError, match="shard"):
        estimate("Qwen2.5-7B", "adamw", shard="zero3")
    with pytest.raises(ValueError, match="seq"):
        estimate("Qwen2.5-7B", "adamw", seq=0)


# ----------------------------------------------------------------------------- CLI
def test_cli_prints_a_table_per_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "Qwen2.5-1.5B", "--gpus", "4", "--shard", "fsdp", "--checkpointing", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    for label in ("Dense AdamW", "LoRA", "LoGRA (freeze)", "LoGRA (sketch)"):
        assert f"### {label}" in out
    assert "(peak)" in out and "| optimizer step" in out


def test_cli_json_is_machine_readable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "Llama-3-8B", "--methods", "adamw", "logra", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["method"] for e in data["estimates"]] == ["adamw", "logra-freeze"]
    for e in data["estimates"]:
        assert set(e["categories_bytes"]) == set(CATEGORIES)
        assert e["peak_bytes"] == sum(e["categories_bytes"].values())


def test_paper_comparison_covers_the_three_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    rows = paper_comparison()
    assert {r["label"] for r in rows} == {"1.5B", "7B", "27B"} and len(rows) == len(PAPER_TABLE)
    dense27 = next(r for r in rows if r["label"] == "27B" and r["method"] == "adamw")
    assert not dense27["ours_full_fits"] and not dense27["ours_chunked_fits"]  # paper: OOM
    assert main(["--paper"]) == 0
    out = capsys.readouterr().out
    assert "| 27B | Dense AdamW | OOM" in out and "Assumed" in out
