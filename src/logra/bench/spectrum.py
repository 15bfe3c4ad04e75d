"""``logra bench spectrum``: spectra and cosines of the accumulated update ``ΔW = W_T − W_0`` of finished runs.

For every target weight of a finished ``logra train`` run (the 2-D linear weights of the
decoder layers, `DECODER_LINEAR`: q/k/v/o, gate/up/down) this reads the final weights
``W_T`` (``RUN_DIR/checkpoint/model.safetensors``; for LoRA runs ``(α/r)·B A`` plus any change
of the base weight) and the warm start ``W_0`` the run began from (the cached embedded
policy, the ``--model`` path, or ``--base``), and measures in float64:

* the singular values ``σ`` of ``ΔW``;
* the effective rank ``exp(H(p))`` with ``p = σ / Σσ`` and ``H`` the Shannon entropy
  (Roy & Vetterli 2007): ``k`` for ``k`` equal singular values and zeros, between 1 and
  ``min(out, in)`` otherwise, and smooth in ``σ`` unlike a thresholded rank;
* the 90%-energy rank: how many of the largest singular values hold 90% of ``‖ΔW‖_F²``;
* the relative size ``‖ΔW‖_F / ‖W_0‖_F``;
* with ``--reference``, the cosine ``⟨ΔW_a, ΔW_b⟩ / (‖ΔW_a‖ ‖ΔW_b‖)`` per weight between each
  run and the reference (both must have started from the same ``W_0``);
* with ``--subspace LOGRA_RUN`` (a LoGRA run with one fixed projection per layer,
  ``refresh=False``), the share of each run's ``‖ΔW‖_F²`` inside the input subspace that run
  can reach, the row space of its projection ``A`` (rebuilt from its config and seed):
  ``‖ΔW Q‖_F² / ‖ΔW‖_F²`` with ``Q`` an orthonormal basis of that row space. It is 1 for the
  LoGRA run itself and ``r / in`` in expectation for an update unrelated to ``A``.

Why it matters: a LoGRA run that keeps one fixed projection ``A`` (``[r, in]``) per layer
for the whole run (``refresh=False``, the embedded default) adds updates of the form
``U A`` only, so each layer's accumulated update lies in the rank-``r`` row space of ``A``:
``rank ΔW ≤ r``. Dense AdamW's accumulated update has no such bound, and LoRA's is
``B A`` of rank ``≤ r`` too, but with a learned input subspace. The spectrum shows how much of
AdamW's update lies outside a rank-``r`` subspace, and the cosines how far the runs moved
in the same direction.

Prints two markdown tables (per run × layer kind: means over layers; with ``--reference``
the mean cosines) and writes ``spectrum.png`` (normalised singular values ``σ_i/σ_1`` and
cumulative energy, averaged over weights, one line per run).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..delta import weights_checksum
from ..projection import stable_name
from ..sketch import DECODER_LINEAR, find_targets

#: Layer kinds in table order (the last name part of a target module).
KINDS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Share of ``‖ΔW‖_F²`` the energy rank counts up to.
ENERGY: float = 0.9
_LORA_A = re.compile(r"^(?P<module>.+)\.lora_A\.(?P<adapter>[^.]+)\.weight$")
_PROG = "logra bench spectrum"


def _fail(message: str) -> SystemExit:
    return SystemExit(f"{_PROG}: {message}")


def _log(message: str) -> None:
    print(f"[bench spectrum] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ reading runs
def _run_config(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.json`` (a `RLConfig` as a nested dict)."""
    path = run_dir / "config.json"
    if not path.is_file():
        path = run_dir / "checkpoint" / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise _fail(f"{run_dir}: config.json is unreadable ({type(e).__name__}: {e}); "
                    "is it a `logra train` run directory?") from None
    if not isinstance(config, dict) or not isinstance(config.get("logra"), dict) or "cache_dir" not in config:
        raise _fail(f"{path} is not the config of a `logra train` run")
    return config


def _warm_start_key(run_dir: Path, config: dict[str, Any]) -> str:
    """The cache key of the embedded policy the run started from: the one its ``summary.json``
    records (what the run used), else recomputed with the trainer's own functions."""
    try:
        return str(json.loads((run_dir / "summary.json").read_text())["policy"]["key"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from ..rl.build import warm_start_data_key
    from ..rl.cli import _flatten, build_config
    from ..rl.config import build_task

    rl = build_config(_flatten(config))
    return rl.tiny.cache_key(warm_start_data_key(rl, build_task(rl)))


def warm_start_path(run_dir: str | Path) -> Path:
    """Where the weights the run started from are: its ``--model`` path, or the cache entry
    ``cache_dir/<key>`` of the embedded policy it warm-started (or loaded)."""
    run_dir = Path(run_dir)
    config = _run_config(run_dir)
    if config.get("model"):
        return Path(config["model"]).expanduser()
    return Path(config["cache_dir"]).expanduser() / _warm_start_key(run_dir, config)


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise _fail(f"{path} holds no safetensors weights")
    return files


def _load(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file or of every one in a folder, by stable name (wrapper
    prefixes such as peft's ``base_model.model.`` removed); only ``names`` if given."""
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    name = stable_name(key)
                    if names is None or name in names:
                        out[name] = f.get_tensor(key)
        except (OSError, RuntimeError, ValueError) as e:  # safetensors raises several types
            raise _fail(f"{file} is unreadable: {e}") from None
    return out


def _architecture(arch_dirs: list[Path]) -> tuple[list[str], list[str]]:
    """Stable names of the `DECODER_LINEAR` weights and of all parameters (tied ones once) of
    the architecture in the first of ``arch_dirs`` with a Hugging Face ``config.json`` (built
    on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for folder in arch_dirs:
        if (folder / "config.json").is_file():
            try:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
                return (list(find_targets(model, (DECODER_LINEAR,))),
                        [stable_name(n) for n, _ in model.named_parameters()])
            except (ValueError, OSError, KeyError) as e:
                raise _fail(f"cannot tell the decoder layers from {folder}/config.json: {e}") from None
    raise _fail(f"no model config.json in {', '.join(map(str, arch_dirs))}: cannot tell the decoder layers")


def _lora_scale(config: dict[str, Any], rank: int) -> float:
    """``lora_alpha / r`` of a LoRA run: `build_optimizer` sets ``r = lora_rank or logra.rank``
    and ``lora_alpha = r``."""
    r = int(config.get("lora_rank") or config["logra"]["rank"])
    if r != rank:
        raise _fail(f"the checkpoint's LoRA factors have rank {rank}, its config says {r}")
    return 1.0  # lora_alpha / r with lora_alpha = r


def _run_weights(run_dir: Path, base: str | Path | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Path]:
    """``(ΔW by name, W_0 by name, W_0's path)`` of the run's target weights, float64."""
    from ..rl.checkpoint import checkpoint_dir

    config = _run_config(run_dir)
    ckpt = checkpoint_dir(run_dir)
    if ckpt is None or not (ckpt / "model.safetensors").is_file():
        raise _fail(f"{run_dir} has no checkpoint/model.safetensors (not a finished `logra train` run?)")
    source = warm_start_path(run_dir) if base is None else Path(base).expanduser()
    if not source.exists():
        raise _fail(f"{run_dir}: its starting weights {source} do not exist (pass --base PATH)")
    arch = [source if source.is_dir() else source.parent]
    if base is not None:  # the run's own source still knows the architecture
        try:
            arch.append(warm_start_path(run_dir))
        except SystemExit:
            pass
    names, params = _architecture(arch)
    final = _load(ckpt / "model.safetensors")
    initial = _load(source, set(params))
    from ..rl.evaluation import start_checksum

    recorded = start_checksum(run_dir)
    # the trainer digests its fp32 copy; a file in another dtype reads back to the same floats
    if recorded is not None and (set(params) - initial.keys()
                                 or weights_checksum({n: t.float() for n, t in initial.items()}, params) != recorded):
        raise _fail(f"{source} does not hold the weights {run_dir} started from (checksum {recorded[:12]}); "
                    "was the warm-start cache rebuilt since, or did the run come from another machine? "
                    "Pass --base PATH to its starting weights")
    initial = {n: initial[n] for n in names if n in initial}

    lora: dict[str, torch.Tensor] = {}
    for key in [k for k in final if _LORA_A.match(k)]:
        m = _LORA_A.match(key)
        module, adapter = m["module"], m["adapter"]
        b_key, base_key = f"{module}.lora_B.{adapter}.weight", f"{module}.base_layer.weight"
        if b_key not in final or base_key not in final:
            raise _fail(f"{ckpt}/model.safetensors has {key} but not {b_key} and {base_key}")
        a, b = final[key].double(), final[b_key].double()
        lora[f"{module}.weight"] = _lora_scale(config, a.shape[0]) * (b @ a)
        final[f"{module}.weight"] = final[base_key]

    deltas: dict[str, torch.Tensor] = {}
    w0: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in final:
            continue
        if name not in initial:
            raise _fail(f"{source} has no {name}, which {run_dir} trained: not this run's starting policy")
        wt, wb = final[name].double(), initial[name].double()
        if wt.shape != wb.shape:
            raise _fail(f"{name}: {run_dir} has shape {list(wt.shape)}, {source} {list(wb.shape)}: "
                        "not this run's starting policy")
        deltas[name] = wt - wb + lora.get(name, 0.0)
        w0[name] = wb
    if not deltas:
        raise _fail(f"{run_dir}: its checkpoint holds none of the decoder layers' linear weights ({names[:2]}, ...)")
    return deltas, w0, source


def accumulated_updates(run_dir: str | Path, base: str | Path | None = None) -> dict[str, torch.Tensor]:
    """``ΔW = W_T − W_0`` (float64) of every `DECODER_LINEAR` weight of a finished run, by the
    plain parameter name (``model.layers.0.self_attn.q_proj.weight``).

    Args:
        run_dir: a ``logra train`` run directory with ``checkpoint/model.safetensors``.
        base: the starting weights (a folder of safetensors or one file); default: the run's
            ``--model`` path or the cached warm start of the embedded policy it used.

    Raises:
        SystemExit: a missing checkpoint or starting policy, an unreadable config, shapes
            that differ between ``W_T`` and ``W_0``, or no target weights in the checkpoint.
    """
    return _run_weights(Path(run_dir), base)[0]


# ------------------------------------------------------------------ statistics
def _stats(sigma: torch.Tensor, base_norm: float) -> dict[str, float]:
    energy = sigma.square()
    total = float(energy.sum())
    if total == 0.0:
        return {"effective_rank": math.nan, "energy_rank": 0.0, "relative_norm": 0.0, "norm": 0.0,
                "min_dim": float(sigma.numel())}
    p = sigma / sigma.sum()
    p = p[p > 0]
    cumulative = energy.cumsum(0) / total
    return {
        "effective_rank": math.exp(float(-(p * p.log()).sum())),
        "energy_rank": float(int((cumulative < ENERGY - 1e-12).sum()) + 1),
        "relative_norm": math.sqrt(total) / base_norm if base_norm else math.inf,
        "norm": math.sqrt(total),
        "min_dim": float(sigma.numel()),
    }


def spectrum_stats(delta: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """Spectral statistics of an update ``delta`` of the weight ``base`` (computed in float64).

    Returns:
        ``effective_rank`` (``exp`` of the entropy of ``σ/Σσ``; NaN for ``delta = 0``),
        ``energy_rank`` (fewest singular values holding `ENERGY` of ``‖delta‖_F²``),
        ``relative_norm`` (``‖delta‖_F / ‖base‖_F``), ``norm`` (``‖delta‖_F``) and ``min_dim``
        (``min(out, in)``, the largest rank possible).
    """
    return _stats(torch.linalg.svdvals(delta.double()), float(base.double().norm()))


def subspace_bases(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """Per target, an orthonormal basis ``[in, r]`` (float64) of the row space of the fixed
    projection of a LoGRA run (``refresh=False``), rebuilt from the run's config and seed (a
    projection fitted to the inputs, ``distribution='inputs'``, is read from the run's checkpoint).

    Raises:
        SystemExit: not a LoGRA run with a fixed projection.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import LoGRAConfig
    from ..optimizer import LoGRAOptimizer

    run_dir = Path(run_dir)
    config = _run_config(run_dir)
    if config.get("optimizer") != "logra" or config["logra"].get("refresh", True):
        raise _fail(f"--subspace {run_dir}: needs a LoGRA run with refresh=False (one projection for the run)")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in config["logra"].items()}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(warm_start_path(run_dir)))
    model = model.to_empty(device="cpu")  # the projections depend on shapes and seeds, not values
    model.tie_weights()  # as the run's model: its optimizer state has one sketch for tied embeddings
    optimizer = LoGRAOptimizer(model, LoGRAConfig(**fields))
    if optimizer.needs_fit:
        state = run_dir / "checkpoint" / "state.pt"
        if not state.is_file():
            raise _fail(f"--subspace {run_dir}: its projections were fitted to its inputs and it left no checkpoint "
                        f"({state}) to read them from")
        optimizer.load_state_dict(torch.load(state, weights_only=True)["optimizer"])
    return {name: torch.linalg.qr(optimizer.projection(name).double().T)[0] for name in optimizer.targets}


def _inside(delta: torch.Tensor, basis: torch.Tensor) -> float:
    total = float(delta.square().sum())
    return float((delta @ basis).square().sum()) / total if total else math.nan


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    norm = float(a.norm() * b.norm())
    return float((a * b).sum()) / norm if norm else math.nan


def _kind(name: str) -> str:
    return name.split(".")[-2]


def _kinds(names: list[str]) -> list[str]:
    present = {_kind(n) for n in names}
    return [k for k in KINDS if k in present] + sorted(present - set(KINDS))


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


# ------------------------------------------------------------------ command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished `logra train` run directories")
    p.add_argument("--label", nargs="+", action="extend", default=None, metavar="NAME",
                   help="one name per run, in order (default: the directory names)")
    p.add_argument("--reference", metavar="RUN_DIR_OR_LABEL",
                   help="also print each run's cosine with this run's update (same W_0 required)")
    p.add_argument("--subspace", metavar="LOGRA_RUN",
                   help="also print the share of each run's ‖ΔW‖² inside this fixed-projection LoGRA run's "
                        "input subspace (the row space of its projections)")
    p.add_argument("--base", metavar="PATH",
                   help="starting weights of every run (folder or .safetensors; default: each run's own)")
    p.add_argument("--out-dir", default=".", help="where spectrum.png goes")
    p.add_argument("--json", metavar="FILE", help="also write every weight's statistics and singular values")
    return p


def _fmt(x: float, digits: int = 1) -> str:
    return "–" if math.isnan(x) else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    """Measure the runs, print the tables, write the figure (and ``--json``)."""
    args = _parser().parse_args(argv)
    torch.set_num_threads(1)
    runs = [Path(r) for r in args.runs]
    labels = args.label or [r.resolve().name for r in runs]
    if len(labels) != len(runs):
        raise _fail(f"{len(labels)} --label names for {len(runs)} runs")
    if len(set(labels)) != len(labels):
        raise _fail(f"two runs share a label ({labels}); name them with --label")

    reference: tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
    if args.reference is not None:
        if args.reference in labels:
            ref_dir, ref_label = runs[labels.index(args.reference)], args.reference
        else:
            ref_dir = Path(args.reference)
            same = [i for i, r in enumerate(runs) if r.resolve() == ref_dir.resolve()]
            ref_label = labels[same[0]] if same else ref_dir.resolve().name
        _log(f"reference {ref_label}: reading {ref_dir}")
        ref_delta, ref_w0, _ = _run_weights(ref_dir, args.base)
        reference = (ref_label, ref_delta, ref_w0)

    bases = subspace_bases(args.subspace) if args.subspace else None
    results: dict[str, dict[str, Any]] = {}
    for run, label in zip(runs, labels, strict=True):
        deltas, w0, source = _run_weights(run, args.base)
        _log(f"{label}: {len(deltas)} weights of {run}, W_0 from {source}")
        weights: dict[str, dict[str, Any]] = {}
        for name, delta in deltas.items():
            sigma = torch.linalg.svdvals(delta)
            weights[name] = {**_stats(sigma, float(w0[name].norm())), "singular_values": sigma.tolist()}
        cosines: dict[str, float] = {}
        if reference is not None:
            ref_label, ref_delta, ref_w0 = reference
            for name in deltas.keys() & ref_delta.keys():
                if ref_w0[name].shape != w0[name].shape or not torch.equal(ref_w0[name], w0[name]):
                    raise _fail(f"{label} and the reference {ref_label} started from different weights "
                                f"(W_0 differs at {name}): their updates are not comparable")
                cosines[name] = _cosine(deltas[name], ref_delta[name])
        inside = {n: _inside(d, bases[n]) for n, d in deltas.items() if n in bases} if bases else {}
        results[label] = {"run_dir": str(run), "base": str(source), "weights": weights, "cosines": cosines,
                          "inside": inside}
        del deltas, w0

    kinds = _kinds([n for r in results.values() for n in r["weights"]])
    for r in results.values():
        r["kinds"] = {}
        for kind in kinds:
            rows = [s for n, s in r["weights"].items() if _kind(n) == kind]
            if rows:
                r["kinds"][kind] = {key: _mean([s[key] for s in rows]) for key in
                                    ("effective_rank", "energy_rank", "min_dim", "relative_norm")}
                r["kinds"][kind]["layers"] = len(rows)
                r["kinds"][kind]["cosine"] = _mean([c for n, c in r["cosines"].items() if _kind(n) == kind])
                r["kinds"][kind]["inside"] = _mean([c for n, c in r["inside"].items() if _kind(n) == kind])

    print("## Accumulated update ΔW = W_T − W_0: mean over layers\n")
    print("| run | layer | layers | min(out,in) | effective rank | 90%-energy rank | ‖ΔW‖/‖W_0‖ |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        for kind, k in r["kinds"].items():
            print(f"| {label} | {kind} | {k['layers']} | {_fmt(k['min_dim'], 0)} | {_fmt(k['effective_rank'])} | "
                  f"{_fmt(k['energy_rank'])} | {k['relative_norm']:.2e} |")
    if reference is not None:
        _kind_table(f"Cosine of ΔW with the reference ({reference[0]})", "cosine", results, kinds)
    if bases is not None:
        names = {n for r in results.values() for n in r["inside"]}
        chance = {k: _mean([bases[n].shape[1] / bases[n].shape[0] for n in names if _kind(n) == k]) for k in kinds}
        _kind_table(f"Share of ‖ΔW‖² inside the input subspace of {args.subspace}", "inside", results, kinds,
                    ("(a random r-dim subspace: r / in)", chance))

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = _plot(results, out_dir / "spectrum.png")
    _log(f"wrote {figure}")
    if args.json:
        payload = {"reference": reference[0] if reference else None, "energy": ENERGY, "runs": results}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        _log(f"wrote {args.json}")
    return 0


def _kind_table(title: str, key: str, results: dict[str, dict[str, Any]], kinds: list[str],
                extra: tuple[str, dict[str, float]] | None = None) -> None:
    """One markdown row per run of ``key``'s mean over layers, one column per layer kind."""
    print(f"\n## {title}: mean over layers\n")
    print("| run | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    rows = [(label, {k: r["kinds"].get(k, {}).get(key, math.nan) for k in kinds}) for label, r in results.items()]
    for label, values in [*rows, *([extra] if extra else [])]:
        print(f"| {label} | " + " | ".join(_fmt(values[k], 3) for k in kinds) + " |")


def _plot(results: dict[str, dict[str, Any]], path: Path) -> Path:
    """σ_i/σ_1 (log) and cumulative energy against i, averaged over each run's non-zero weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, r in results.items():
        curves = [torch.tensor(w["singular_values"]) for w in r["weights"].values()]
        curves = [c for c in curves if c[0] > 0]
        if not curves:
            continue
        n = max(len(c) for c in curves)
        ratio = torch.full((len(curves), n), math.nan, dtype=torch.float64)
        energy = torch.ones((len(curves), n), dtype=torch.float64)
        for i, c in enumerate(curves):
            ratio[i, :len(c)] = c / c[0]
            energy[i, :len(c)] = c.square().cumsum(0) / c.square().sum()
        index = range(1, n + 1)
        left.semilogy(index, ratio.nanmean(0), label=label)
        right.plot(index, energy.mean(0), label=label)
    left.set(xlabel="singular value index i", ylabel="σ_i / σ_1 (mean over weights)", title="normalised spectrum of ΔW")
    right.set(xlabel="i (log)", ylabel="share of ‖ΔW‖_F² in σ_1..σ_i (mean over weights)", title="cumulative energy",
              xscale="log")
    right.axhline(ENERGY, color="grey", lw=0.8, ls=":")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
