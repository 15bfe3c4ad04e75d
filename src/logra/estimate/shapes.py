"""Model shapes for `logra.estimate`: the dimensions of a decoder that decide its memory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen/Mistral-style decoder that decide its memory.

    Attributes:
        name: label used in tables.
        vocab_size: rows of the embedding / lm_head.
        hidden_size: model width ``h``.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA).
        intermediate_size: MLP width (gate/up output, down input).
        head_dim: per-head width; ``hidden_size // num_heads`` when the config has none.
        tie_embeddings: lm_head shares the input embedding.
        qkv_bias: q/k/v projections have biases (Qwen2).
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0
    tie_embeddings: bool = False
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        sizes = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "head_dim")
        for f in sizes:
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"ModelShape.{f} must be positive, got {getattr(self, f)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def q_dim(self) -> int:
        """Width of the query projection's output (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and value) projection's output."""
        return self.num_kv_heads * self.head_dim

    def targets(self) -> list[tuple[str, int, int]]:
        """``(name, out, in)`` of the seven projection weights of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q),
                ("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (projections, q/k/v biases, two norms)."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return sum(o * i for _, o, i in self.targets()) + bias + 2 * self.hidden_size

    @property
    def root_parameters(self) -> int:
        """Parameters outside the decoder layers: embedding, lm_head (if untied), final norm."""
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_embeddings else 2) + self.hidden_size

    @property
    def num_parameters(self) -> int:
        """All parameters (tied embeddings counted once)."""
        return self.num_layers * self.layer_parameters + self.root_parameters

    @classmethod
    def named(cls, name: str) -> ModelShape:
        """A built-in shape by name (case-insensitive; see `BUILTIN_SHAPES` and `ALIASES`).

        Raises:
            ValueError: unknown name; the message lists the valid names.
        """
        key = name.strip().lower()
        key = ALIASES.get(key, key)
        for shape_name, shape in BUILTIN_SHAPES.items():
            if shape_name.lower() == key:
                return shape
        valid = ", ".join(list(BUILTIN_SHAPES) + sorted(ALIASES))
        raise ValueError(f"unknown model {name!r}; built-in shapes: {valid} (or pass a path to a config.json)")

    @classmethod
    def from_config(cls, config: str | Path | Mapping[str, Any], name: str | None = None) -> ModelShape:
        """Read a Hugging Face ``config.json`` (a path, a directory holding one, or its dict).

        Multimodal configs with a ``text_config`` use that. ``tie_word_embeddings``
        defaults to False (the Llama/Qwen2 config default); q/k/v biases are assumed for
        ``model_type`` qwen2 and otherwise read from ``attention_bias``.

        Raises:
            ValueError: a required field is missing.
        """
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            with open(path) as f:
                config = json.load(f)
            name = name or path.parent.name or path.stem
        cfg: Mapping[str, Any] = config.get("text_config") or config
        model_type = str(cfg.get("model_type", config.get("model_type", "")))
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config lacks {missing}; is it a decoder-only language model config?")
        tie = cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return cls(
            name=name or model_type or "config",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            head_dim=int(cfg.get("head_dim") or 0),
            tie_embeddings=bool(tie),
            qkv_bias=model_type.startswith("qwen2") or bool(cfg.get("attention_bias", False)),
        )

    @classmethod
    def from_model(cls, model: Any, name: str | None = None) -> ModelShape:
        """The shape of an instantiated Hugging Face causal LM (reads ``model.config``)."""
        return cls.from_config(model.config.to_dict(), name=name)


#: Common shapes, from the models' published ``config.json`` files. ``dense-27B`` stands in
#: for the paper's 27B model, whose configuration is not published: it has Gemma-3-27B's
#: text-model dimensions (27.0B parameters) but is modelled as a Llama/Qwen-style layer.
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s for s in (
        ModelShape("Qwen2.5-1.5B", 151936, 1536, 28, 12, 2, 8960, 128, tie_embeddings=True, qkv_bias=True),
        ModelShape("Qwen2.5-7B", 152064, 3584, 28, 28, 4, 18944, 128, tie_embeddings=False, qkv_bias=True),
        ModelShape("dense-27B", 262208, 5376, 62, 32, 16, 21504, 128, tie_embeddings=True, qkv_bias=False),
        ModelShape("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336, 128, tie_embeddings=False, qkv_bias=False),
        ModelShape("Llama-3-70B", 128256, 8192, 80, 64, 8, 28672, 128, tie_embeddings=False, qkv_bias=False),
    )
}
#: Other names for the built-in shapes (same dimensions).
ALIASES: dict[str, str] = {
    "qwen2.5-math-1.5b": "qwen2.5-1.5b", "qwen2.5-math-7b": "qwen2.5-7b",
    "llama-3.1-8b": "llama-3-8b", "llama-3.1-70b": "llama-3-70b", "27b": "dense-27b",
}



def resolve_shape(model: str) -> ModelShape:
    """A built-in shape by name, or the shape of a ``config.json`` (a path or its directory).

    Raises:
        FileNotFoundError: a config path that does not exist.
        ValueError: an unknown name, or a config that is not a decoder-only LM's.
    """
    path = Path(model)
    if path.suffix == ".json" or path.is_dir() or path.is_file():
        if not path.exists():
            raise FileNotFoundError(f"no config at {path}")
        return ModelShape.from_config(path)
    return ModelShape.named(model)
