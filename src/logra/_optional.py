"""Optional dependencies: import them by name, or say which extra installs them.

``pip install logra`` brings the library (torch, transformers, safetensors). The RL job,
tasks and plots need ``logra[rl]``, the TRL integration ``logra[trl]``, the peer
benchmarks ``logra[bench]``. A missing one raises `MissingExtraError` naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType

from .errors import MissingExtraError

#: top-level module → the extra of ``pyproject.toml`` that installs it.
EXTRAS: dict[str, str] = {
    "reasoning_gym": "rl", "math_verify": "rl", "peft": "rl", "matplotlib": "rl", "tqdm": "rl", "yaml": "rl",
    "trl": "trl", "vllm": "vllm", "gguf": "gguf",
    "galore_torch": "bench", "apollo_torch": "bench", "bitsandbytes": "bench",
}


def install_hint(module: str) -> str | None:
    """``"pip install 'logra[rl]'"`` for a module an extra installs, else None."""
    extra = EXTRAS.get(module.split(".")[0])
    return f"pip install 'logra[{extra}]'" if extra else None


def require(module: str) -> ModuleType:
    """Import ``module``; if an extra provides it and it is missing, raise `MissingExtraError`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = (e.name or module).split(".")[0]
        hint = install_hint(top)
        if hint is None or importlib.util.find_spec(top) is not None:
            raise
        raise MissingExtraError(f"{module} is not installed; it comes with: {hint}") from e


def package_version(package: str) -> str | None:
    """The installed distribution's version (``importlib.metadata``), None if not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def require_extra(extra: str, what: str) -> None:
    """Raise `MissingExtraError` if any module of ``extra`` is missing (``what`` needs it)."""
    missing = [m for m, e in EXTRAS.items() if e == extra and importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)}: pip install 'logra[{extra}]'")
