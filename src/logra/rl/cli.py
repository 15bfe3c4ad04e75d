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
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import yaml

from ..errors import LoGRAError
from .checkpoint import checkpoint_dir, read_checkpoint_config
from .config import BASELINE_SETTINGS, RECIPES, RLConfig, config_from, flat_fields, recipe_config
from .trainer import RLTrainer

_RESUMABLE_CHANGES = {"updates", "eval_every", "checkpoint_every", "tensorboard", "threads"}


def _field_docs() -> dict[str, str]:
    """Dotted key → help text, from the 'Attributes:' sections of the config docstrings."""
    docs: dict[str, str] = {}
    default = RLConfig()
    sections = {"": RLConfig, **{f.name + ".": type(getattr(default, f.name)) for f in dataclasses.fields(RLConfig)
                                 if dataclasses.is_dataclass(getattr(default, f.name))}}
    for prefix, cls in sections.items():
        doc = (cls.__doc__ or "").split("Attributes:", 1)
        current = None
        for line in doc[1].splitlines() if len(doc) == 2 else []:
            m = re.match(r"\s{8}(\w+): (.*)", line)
            if m:
                current = prefix + m.group(1)
                docs[current] = m.group(2).strip()
            elif current and line.strip():
                docs[current] += " " + line.strip()
    return docs


def _coerce(key: str, text: Any, field: dataclasses.Field) -> Any:
    """A command-line or config-file value as the type the field is annotated with."""
    kind = str(field.type)
    if not isinstance(text, str):
        return tuple(text) if kind.startswith("tuple") else text
    low = text.strip().lower()
    if low in ("none", "null") and "None" in kind:
        return None
    try:
        if kind.startswith("dict"):
            value = yaml.safe_load(text) if text.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return value
        if kind.startswith("bool"):
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return low in ("true", "1", "yes")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("tuple"):
            return tuple(s.strip() for s in text.split(",") if s.strip())
    except ValueError:
        name = kind.split(" ")[0]
        expected = "a mapping such as '{min_digits: 1}'" if kind.startswith("dict") else (
            f"{'an' if name[0] in 'aeiou' else 'a'} {name}")
        raise SystemExit(f"logra train: --{key} expects {expected}, got {text!r}") from None
    return text


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections → dotted keys; dict-valued options (``task_config``) stay whole."""
    leaves = flat_fields()
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


def build_config(values: dict[str, Any], recipe: str | None = None) -> RLConfig:
    """An `RLConfig` from dotted keys over a recipe's settings (unknown keys name the nearest valid one).

    Every problem is a one-line `SystemExit` (``logra train: ...``), never a traceback.
    """
    fields = flat_fields()
    for key in values:
        if key not in fields:
            raise _unknown(key, list(fields), "the config")
    typed = {key: _coerce(key, value, fields[key]) for key, value in values.items()}
    try:
        return recipe_config(recipe, **typed) if recipe else config_from(typed)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"logra train: {e}") from None


def run_config(run_dir: str | Path) -> RLConfig:
    """The `RLConfig` a run with a checkpoint was started with (its verified ``config.json``).

    Raises:
        SystemExit: the run has no checkpoint, or its config fails verification or is refused.
    """
    try:
        return build_config(_saved_values(Path(run_dir)))
    except LoGRAError as e:
        raise SystemExit(f"logra: {e}") from None


def _saved_values(run_dir: Path) -> dict[str, Any]:
    """Dotted keys of the run's checkpointed config, with the settings it never read at their defaults.

    Earlier versions saved a baseline's ``lr``, ``adam_beta1``, ``lora_rank`` or
    ``lr_schedule`` with another optimizer, and ``logra.lr`` beside an update ratio; they
    changed nothing in that run and are refused now, so they are reset (with a note on
    stderr) rather than making the run impossible to resume.
    """
    values = _flatten(read_checkpoint_config(run_dir))
    defaults = _flatten(RLConfig().to_dict())
    optimizer = values.get("optimizer", defaults["optimizer"])
    unread = [k for k, users in BASELINE_SETTINGS.items() if optimizer not in users]
    if values.get("logra.update_ratio", defaults["logra.update_ratio"]) is not None:
        unread.append("logra.lr")  # the update ratio sizes LoGRA's steps
    reset = {k: values[k] for k in unread if k in values and _coerce_saved(values[k]) != defaults[k]}
    if reset:
        print(f"logra: {run_dir} was saved with settings it never read (optimizer {optimizer!r}); "
              "they are reset to their defaults: " + ", ".join(f"{k}={v!r}" for k, v in reset.items()),
              file=sys.stderr)
    return {**values, **{k: defaults[k] for k in reset}}


def load_config_file(path: str) -> dict[str, Any]:
    """Dotted keys of a YAML (.yaml/.yml) or TOML (.toml) config file."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"logra train: config file {path} does not exist")
    if not p.is_file():
        raise SystemExit(f"logra train: config file {path} is a folder, not a YAML or TOML file")
    try:
        text = p.read_text()
        tree = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        where = getattr(e, "problem_mark", None)  # YAML: line and column of the problem
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        detail = " ".join(str(getattr(e, "problem", None) or e).split())
        raise SystemExit(f"logra train: config file {path} cannot be read{at}: {detail}") from None
    if not isinstance(tree, dict):
        raise SystemExit(f"logra train: {path} must hold a mapping of options")
    return _flatten(tree)


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    return repr(value) if isinstance(value, (str, dict)) else str(value)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logra train",
        description="RL post-training with LoGRA (default), dense AdamW or LoRA. With no arguments: the "
        "embedded default (recipe 'embedded': a tiny Qwen2 policy, warm-started and cached, then RL on a "
        "reasoning-gym task); with --model, recipe 'model' (see --recipe). Defaults shown are the embedded "
        "default's; where the plain defaults (--recipe none) differ, that value is shown too.",
    )
    parser.add_argument("--config", help="YAML or TOML file of options (flags override it)")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    recipes = "; ".join(f"'{r.name}': {r.description}" for r in RECIPES.values())
    parser.add_argument("--recipe", choices=[*RECIPES, "none"], default=None,
                        help=f"preset settings under the options: {recipes}; 'none': the plain defaults, "
                             "the paper's LoGRA update (default: 'embedded' without --model, else 'model')")
    docs = _field_docs()
    embedded = _flatten(build_config({}, "embedded").to_dict())
    plain = _flatten(RLConfig().to_dict())
    for key, f in flat_fields().items():
        default = f"{_shown(_coerce_saved(embedded[key]))}"
        if plain[key] != embedded[key]:
            default += f"; with --recipe none: {_shown(_coerce_saved(plain[key]))}"
        kind = str(f.type)
        choices = re.findall(r"['\"](\w+)['\"]", kind) if kind.startswith("Literal") else []
        kind = "{" + ",".join(choices) + "}" if choices else kind.split(" ")[0].split("[")[0].upper()
        parser.add_argument(f"--{key}", dest=key, default=argparse.SUPPRESS, metavar=kind,
                            help=f"{docs.get(key, '')} (default: {default})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse options, build or resume the trainer, run it."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise _unknown(extra[0].lstrip("-").split("=")[0], list(flat_fields()), "the command line")
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "resume", "quiet", "recipe")}
    values = load_config_file(args.config) if args.config else {}
    values.update(flags)
    recipe = args.recipe or ("model" if values.get("model") else "embedded")
    if args.resume:
        if checkpoint_dir(Path(args.resume)) is None:
            raise SystemExit(f"logra train: {args.resume} has no checkpoint to resume")
        try:
            saved = _saved_values(Path(args.resume))
        except LoGRAError as e:
            raise SystemExit(f"logra train: {e}") from None
        wanted = build_config({**saved, **values})
        current = _flatten(wanted.to_dict())
        differ = [k for k in values if k not in _RESUMABLE_CHANGES and current.get(k) != _coerce_saved(saved.get(k))]
        if differ:
            raise SystemExit(f"logra train: {args.resume} was run with a different config: "
                             + ", ".join(f"{k}={saved.get(k)!r} (asked {current.get(k)!r})" for k in differ))
        config = dataclasses.replace(wanted, run_dir=args.resume)
    else:
        config = build_config(values, None if recipe == "none" else recipe)
    if config.dp > 1:
        from ..parallel import spawn_local

        codes = spawn_local(_dp_rank, config.dp, args=(config, bool(args.resume), args.quiet), timeout=7 * 24 * 3600)
        if any(codes):
            raise SystemExit(f"logra train: data-parallel ranks exited with codes {codes}")
        return 0
    _run(config, bool(args.resume), args.quiet)
    return 0


def _run(config: RLConfig, resume: bool, quiet: bool) -> None:
    try:
        trainer = RLTrainer(config, progress=not quiet)
    except (ValueError, OSError, RuntimeError) as e:  # bad task file, device, model: one line, no traceback
        raise SystemExit(f"logra train: {e}") from None
    if resume:
        try:
            trainer.load_checkpoint()
        except LoGRAError as e:  # a damaged checkpoint, or one another optimizer wrote: one line
            raise SystemExit(f"logra train: {e}") from None
    try:
        trainer.train()
    except FileExistsError as e:  # a fresh run in a folder that holds another run
        raise SystemExit(f"logra train: {e}") from None


def _dp_rank(rank: int, world: int, store: str, config: RLConfig, resume: bool, quiet: bool) -> None:
    """One data-parallel rank spawned by ``logra train --dp N``."""
    import torch.distributed as dist

    from ..parallel import init_local

    init_local(rank, world, store)
    try:
        _run(config, resume, quiet)
    finally:
        dist.destroy_process_group()


def _coerce_saved(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


if __name__ == "__main__":
    sys.exit(main())
