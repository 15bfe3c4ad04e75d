"""Targeting (issue 20, item 3): `decoder-linear` sketches every 2-D linear weight of the decoder
blocks of any causal LM, fused or not, exactly; it says what it left out; odd layers are refused."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from transformers import FalconConfig, FalconForCausalLM, OPTConfig, OPTForCausalLM, Phi3Config, Phi3ForCausalLM

from conftest import tiny_llama, tiny_qwen2, token_batch
from logra import LoGRAConfig, LoGRAOptimizer
from logra.sketch import DECODER_LINEAR, SketchSet, decoder_blocks, find_targets, target_module_names

#: today's default for the Llama / Qwen family: `decoder-linear` must select these, in this order
LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _phi3() -> Phi3ForCausalLM:  # fused qkv_proj and gate_up_proj
    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)).float()


def _opt() -> OPTForCausalLM:  # out_proj, fc1, fc2 (and biases everywhere)
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(
        vocab_size=97, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        dropout=0.0)).float()  # no dropout: the dense reference and the sketched run see the same model


def _falcon() -> FalconForCausalLM:  # FalconLinear (an nn.Linear subclass) with a fused query_key_value
    torch.manual_seed(0)
    return FalconForCausalLM(FalconConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).float()


ARCHS = {"phi3": _phi3, "opt": _opt, "falcon": _falcon}


def _block_weights(model: nn.Module) -> list[str]:
    """Every 2-D weight of an nn.Linear inside the decoder blocks, from first principles."""
    blocks = {Phi3ForCausalLM: "model.layers.", OPTForCausalLM: "model.decoder.layers.",
              FalconForCausalLM: "transformer.h."}
    prefix = blocks[type(model)]
    return [f"{n}.weight" for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, nn.Linear)]


@pytest.mark.parametrize("build", [tiny_qwen2, tiny_llama, lambda: tiny_qwen2(tie=True)])
@pytest.mark.parametrize("embeddings", [False, True])
def test_decoder_linear_selects_the_llama_projections_in_the_same_order(build, embeddings):
    """The embedded recipe and every Llama/Qwen result stay bitwise: same targets, same order."""
    model = build()
    assert list(find_targets(model, (DECODER_LINEAR,), embeddings)) == list(find_targets(model, LLAMA_NAMES,
                                                                                          embeddings))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_decoder_linear_is_sketched_exactly(arch):
    """S = G Aᵀ against dense autograd (rtol 1e-5) for every linear weight of every block."""
    model = ARCHS[arch]()
    batches = [token_batch(97, seed=s) for s in range(2)]
    ref = copy.deepcopy(model).train()
    for b in batches:
        ref(**b).loss.backward()
    dense = {n: p.grad for n, p in ref.named_parameters()}
    model.train()
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=8, target_modules=(DECODER_LINEAR,)))
    assert list(opt.targets) == _block_weights(model)
    for b in batches:
        model(**b).loss.backward()
    for name, s in opt.sketches().items():
        expected = dense[name] @ opt.projection(name).T
        torch.testing.assert_close(s, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    # the sketched model computes what the plain one does
    with torch.no_grad():
        torch.testing.assert_close(model(**batches[0]).logits, ref(**batches[0]).logits, rtol=1e-5, atol=1e-6)


def test_construction_says_once_what_is_sketched_and_what_is_left(caplog):
    model = _opt()
    with caplog.at_level(logging.INFO, logger="logra.sketch"):
        sketches = SketchSet(model, (DECODER_LINEAR,), 4, non_target="freeze")
    lines = [r.getMessage() for r in caplog.records if r.name == "logra.sketch"]
    assert lines == [sketches.describe()]
    text = lines[0]
    assert "LoGRA sketches 12 weights of OPTForCausalLM" in text
    for leaf in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj", "fc1", "fc2"):
        assert f"model.decoder.layers.*.{leaf}.weight ×2" in text, leaf
    assert ("left to non_target='freeze' (frozen): 2 other 2-D weights (model.decoder.embed_tokens.weight, "
            "model.decoder.embed_positions.weight) and 22 parameters that are not 2-D") in text


def test_decoder_blocks_are_the_outermost_list_of_layers():
    assert decoder_blocks(_opt()) == ["model.decoder.layers.0", "model.decoder.layers.1"]
    assert decoder_blocks(_falcon()) == ["transformer.h.0", "transformer.h.1"]
    moe = nn.Module()  # blocks holding a list of experts: the experts are not blocks
    moe.layers = nn.ModuleList(nn.ModuleDict({"experts": nn.ModuleList(nn.Sequential(nn.Linear(4, 4)) for _ in "ab"),
                                              "out": nn.Linear(4, 4)}) for _ in range(2))
    moe.per_layer = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))  # leaf layers: not blocks
    assert decoder_blocks(moe) == ["layers.0", "layers.1"]
    assert len(find_targets(moe, (DECODER_LINEAR,))) == 6
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no decoder blocks"):
        find_targets(flat, (DECODER_LINEAR,))


def test_falcon_fused_layer_named_in_the_message_can_be_targeted():
    """The no-match message lists query_key_value as an nn.Linear; naming it then works."""
    model = _falcon()
    with pytest.raises(ValueError, match="query_key_value") as e:
        LoGRAOptimizer(model, LoGRAConfig(rank=4, target_modules=("qkv_proj",)))
    assert "nn.Linear layers" in str(e.value)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=4, target_modules=("query_key_value",)))
    assert list(opt.targets) == [f"transformer.h.{i}.self_attention.query_key_value.weight" for i in range(2)]


class _Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_linear_subclass_computing_something_else_is_refused_unchanged():
    model = tiny_qwen2()
    layer = model.model.layers[0].mlp.down_proj
    doubled = _Doubled(layer.in_features, layer.out_features, bias=False)
    doubled.weight = layer.weight
    model.model.layers[0].mlp.down_proj = doubled
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj' is a _Doubled whose forward is not x Wᵀ"):
        LoGRAOptimizer(model, LoGRAConfig(rank=4, target_modules=(DECODER_LINEAR,)))
    assert all(p.requires_grad for p in model.parameters())  # nothing was installed
    assert not any(hasattr(m, "_logra_target") for m in model.modules())


def test_a_packed_weight_is_refused():
    model = tiny_qwen2()
    layer = model.model.layers[1].self_attn.o_proj
    layer.weight = nn.Parameter(torch.zeros(layer.out_features * layer.in_features // 2, 1, dtype=torch.uint8),
                                requires_grad=False)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.o_proj' is a Linear whose weight is torch.uint8"):
        LoGRAOptimizer(model, LoGRAConfig(rank=4))


def test_a_model_on_the_meta_device_is_refused_at_construction():
    with torch.device("meta"):
        model = tiny_qwen2()
    with pytest.raises(ValueError, match=r"^parameter model.embed_tokens.weight is on the meta device"):
        LoGRAOptimizer(model, LoGRAConfig(rank=4))
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("patterns", [(DECODER_LINEAR,), (r"\.(qkv|o)_proj$",)])
def test_lora_adapts_exactly_the_layers_logra_sketches(patterns):
    """`logra train --optimizer lora` compares against LoRA on the same layers, whatever the patterns."""
    peft = pytest.importorskip("peft")
    model = _phi3()
    names = target_module_names(model, patterns)
    assert names == [n.removesuffix(".weight") for n in find_targets(model, patterns)]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=names, lora_dropout=0.0))
    adapted = [n.removeprefix("base_model.model.") for n, m in lora.named_modules() if hasattr(m, "lora_A")]
    assert adapted == names


def test_the_default_config_targets_every_decoder_linear_and_the_optimizer_says_so():
    """`LoGRAConfig()` targets OPT's out_proj/fc1/fc2 too, and `describe()` names the mode."""
    from logra import LoGRAConfig, LoGRAOptimizer

    opt = LoGRAOptimizer(_opt(), LoGRAConfig(rank=4, non_target="adamw"))
    assert len(opt.targets) == 12 and any(n.endswith("fc2.weight") for n in opt.targets)
    assert "left to non_target='adamw'" in opt.describe()
