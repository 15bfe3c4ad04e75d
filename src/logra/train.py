"""``logra train``: the RL post-training job, configured by dataclasses, YAML/TOML and flags.

Every field of `RLConfig` (and of its nested ``logra``, ``kl`` and ``tiny`` sections)
is a flag: ``--updates 100``, ``--logra.rank 64``, ``--kl.budget 1e-4``. A config file
(``--config run.yaml``) sets them first, flags override. ``--resume RUN_DIR`` continues
a run exactly from its last checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from .rl import RLConfig, RLTrainer

_RESUMABLE_CHANGES = {"updates", "eval_every", "checkpoint_every", "tensorboard", "threads"}


def _field_docs(cls: type) -> dict[str, str]:
    """Field help from the 'Attributes:' section of a dataclass docstring."""
    doc = (cls.__doc__ or "").split("Attributes:", 1)
    docs: dict[str, str] = {}
    if len(doc) == 2:
        current = None
        for line in doc[1].splitlines():
            m = re.match(r"\s{8}(\w+): (.*)", line)
            if m:
                current = m.group(1)
                docs[current] = m.group(2).strip()
            elif current and line.strip():
                docs[current] += " " + line.strip()
    return docs


def _flat_fields(cls: type, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Dotted key → (default value, help) for every leaf field of a nested dataclass."""
    out: dict[str, tuple[Any, str]] = {}
    docs = _field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flat_fields(type(value), f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (value, docs.get(f.name, ""))
    return out


def _coerce(key: str, text: Any, default: Any) -> Any:
    if not isinstance(text, str):
        return tuple(text) if isinstance(default, tuple) else text
    if isinstance(default, dict):
        value = yaml.safe_load(text) if text.strip() else {}
        if not isinstance(value, dict):
            raise SystemExit(f"logra train: --{key} expects a mapping such as '{{min_digits: 1}}', got {text!r}")
        return value
    low = text.strip().lower()
    if low in ("none", "null") and (default is None or key.endswith(("update_ratio", "max_grad_norm"))):
        return None
    try:
        if isinstance(default, bool):
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return low in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float) or default is None:
            return float(text)
        if isinstance(default, tuple):
            return tuple(s.strip() for s in text.split(",") if s.strip())
    except ValueError:
        raise SystemExit(f"logra train: --{key} expects a {type(default).__name__}, got {text!r}") from None
    return text


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections → dotted keys; dict-valued options (``task_config``) stay whole."""
    leaves = _flat_fields(RLConfig)
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and prefix + k not in leaves:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _unknown(key: str, valid: list[str], where: str) -> SystemExit:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5) or difflib.get_close_matches(
        key.split(".")[-1], [v.split(".")[-1] for v in valid], n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return SystemExit(f"logra train: unknown option {key!r} in {where}{hint} (see `logra train --help`)")


def build_config(values: dict[str, Any]) -> RLConfig:
    """An `RLConfig` from dotted keys (unknown keys name the nearest valid one)."""
    fields = _flat_fields(RLConfig)
    for key in values:
        if key not in fields:
            raise _unknown(key, list(fields), "the config")
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in values.items():
        value = _coerce(key, value, fields[key][0])
        if "." in key:
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        else:
            top[key] = value
    base = RLConfig()
    for section, changes in nested.items():
        top[section] = dataclasses.replace(getattr(base, section), **changes)
    return dataclasses.replace(base, **top)


def load_config_file(path: str) -> dict[str, Any]:
    """Dotted keys of a YAML (.yaml/.yml) or TOML (.toml) config file."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"logra train: config file {path} does not exist")
    text = p.read_text()
    tree = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    if not isinstance(tree, dict):
        raise SystemExit(f"logra train: {path} must hold a mapping of options")
    return _flatten(tree)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logra train",
        description="RL post-training with LoGRA (default), dense AdamW or LoRA. With no arguments: the "
        "embedded default (a tiny Qwen2 policy, warm-started and cached, then RL on a reasoning-gym task).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", help="YAML or TOML file of options (flags override it)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    for key, (default, doc) in _flat_fields(RLConfig).items():
        shown = ",".join(default) if isinstance(default, tuple) else repr(default) if isinstance(default, (str, dict)) else default
        parser.add_argument(f"--{key}", dest=key, default=argparse.SUPPRESS, metavar="FLOAT" if default is None else type(default).__name__.upper(),
                            help=f"{doc} (default: {shown})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse options, build or resume the trainer, run it."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise _unknown(extra[0].lstrip("-").split("=")[0], list(_flat_fields(RLConfig)), "the command line")
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "quiet")}
    values = load_config_file(args.config) if args.config else {}
    values.update(flags)
    if args.resume:
        saved_path = Path(args.resume) / "checkpoint" / "config.json"
        if not saved_path.exists():
            raise SystemExit(f"logra train: {args.resume} has no checkpoint to resume")
        saved = _flatten(json.loads(saved_path.read_text()))
        wanted = build_config({**saved, **values})
        current = _flatten(wanted.to_dict())
        differ = [k for k in values if k not in _RESUMABLE_CHANGES and current.get(k) != _coerce_saved(saved.get(k))]
        if differ:
            raise SystemExit(f"logra train: {args.resume} was run with a different config: "
                             + ", ".join(f"{k}={saved.get(k)!r} (asked {current.get(k)!r})" for k in differ))
        config = dataclasses.replace(wanted, run_dir=args.resume)
    else:
        config = build_config(values)
    if config.dp > 1:
        from .distributed import spawn_local

        codes = spawn_local(_dp_rank, config.dp, args=(config, bool(args.resume), args.quiet), timeout=7 * 24 * 3600)
        if any(codes):
            raise SystemExit(f"logra train: data-parallel ranks exited with codes {codes}")
        return 0
    _run(config, bool(args.resume), args.quiet)
    return 0


def _run(config: RLConfig, resume: bool, quiet: bool) -> None:
    try:
        trainer = RLTrainer(config, progress=not quiet)
    except ValueError as e:
        raise SystemExit(f"logra train: {e}") from None
    if resume:
        trainer.load_checkpoint()
    trainer.train()


def _dp_rank(rank: int, world: int, store: str, config: RLConfig, resume: bool, quiet: bool) -> None:
    """One data-parallel rank spawned by ``logra train --dp N``."""
    import torch.distributed as dist

    from .distributed import init_local

    init_local(rank, world, store)
    try:
        _run(config, resume, quiet)
    finally:
        dist.destroy_process_group()


def _coerce_saved(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


if __name__ == "__main__":
    sys.exit(main())
