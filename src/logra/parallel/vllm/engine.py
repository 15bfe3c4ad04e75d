"""LoGRA deltas into a running vLLM engine: `LoGRAWorkerExtension` (inside the engine's worker).

vLLM loads this class into every worker with
``LLM(model=..., worker_extension_cls="logra.parallel.vllm.LoGRAWorkerExtension")``; the
driver calls its methods through ``llm.collective_rpc(name, args=...)`` (`VLLMPolicy`
wraps that). Every argument is plain ``bytes``/``str``/``int``: tensors passed through
``collective_rpc`` arrive broken in vLLM's multi-process mode, bytes arrive intact.

Per update only the `PolicyDelta` (``U`` factors and seeds, ``out·r`` values per target)
and the densely trained non-target tensors (if any) cross into the engine. The worker
rebuilds every projection from its seed and merges with `logra.delta.merge_update`, the
trainer's own function, on a tensor of the HF weight's full shape, so the engine ends with
the bits an HF copy of the policy in the engine's dtype would hold.

Two ways to hold the weights, chosen at `logra_configure`:

- ``'inplace'``: vLLM keeps plain fused tensors (bf16 on an AVX2 CPU, every dtype on GPU). Each
  HF target is a view of its rows in ``qkv_proj``/``gate_up_proj`` (or the whole
  ``o_proj``/``down_proj``; the first ``vocab`` rows of a padded embedding), merged in
  place. No extra memory.
- ``'shadow'``: vLLM keeps prepacked kernel handles and an empty ``.weight`` (oneDNN: fp32
  on an AVX2 CPU, bf16 too on an AVX-512/AMX one), so nothing can be edited in place. The worker keeps an
  HF-named copy (the "shadow") of every vLLM module a delta touches, in the engine's
  dtype, merges there and pushes those modules through vLLM's ``reload_weights`` (which
  re-fuses and re-packs). Extra memory: one copy of those modules' weights.

Verification happens before any weight changes: step order, sync fields, target names,
shapes, finite factors and dense tensors, and (when the delta carries one) the checksum
of the merged result, computed on temporaries one target at a time. A refused delta
leaves the engine as it was.

A driver that calls these methods itself must call ``llm.reset_prefix_cache()`` after a
change of weights (`VLLMPolicy` does): vLLM's prefix cache lives in the scheduler, out of a
worker's reach, and would keep serving prompt KV computed with the old weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from ...config import LoGRAConfig
from ...delta import PolicyDelta, check_sync, delta_projection, merge_update
from ...errors import ChecksumMismatchError, DeltaGapError, DeltaMismatchError, LayoutError, NeedsResyncError
from ...projection import stable_name
from .layout import FusedLayout
from .receiver import _digest

#: Methods the extension adds to a vLLM worker (callable through ``collective_rpc``).
RPC_METHODS = ("logra_configure", "logra_apply_delta", "logra_checksum", "logra_load_full", "logra_info")

MODES = ("inplace", "shadow")

#: A verified delta whose targets take at most this many bytes keeps the merged copies of
#: its dry run and commits them by a copy; larger ones are merged a second time in place
#: (bitwise the same result) so the dry run needs one target's temporary at a time.
KEEP_MERGED_BYTES = 1 << 30


def _module_of(fused_name: str) -> str:
    """The vLLM module that owns a fused parameter name (``...qkv_proj.weight`` → ``...qkv_proj``)."""
    return fused_name.rsplit(".", 1)[0]


def read_state(source: str | bytes) -> dict[str, torch.Tensor]:
    """HF-named tensors of a saved policy: a folder of ``*.safetensors``, one file, or safetensors bytes.

    Raises:
        FileNotFoundError: a path without safetensors files.
    """
    if isinstance(source, bytes | bytearray):
        return {stable_name(k): v for k, v in st_load(bytes(source)).items()}
    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {source}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({stable_name(k): v for k, v in load_file(str(f)).items()})
    return out


def _hf_targets(hf_config: Any, config: LoGRAConfig) -> tuple[list[str], list[str], dict[str, tuple[int, ...]]]:
    """(target names, densely trained names, every parameter's shape) of the HF model the
    trainer runs, found exactly as `LoGRAOptimizer` finds them (on a meta-device copy)."""
    from transformers import AutoModelForCausalLM

    from ...sketch import find_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    targets = sorted(find_targets(model, config.target_modules, config.non_target == "sketch"))
    shapes = {stable_name(n): tuple(p.shape) for n, p in model.named_parameters()}
    dense = [] if config.non_target == "freeze" else sorted(set(shapes) - set(targets))
    return targets, dense, shapes


def _finite(t: torch.Tensor) -> bool:
    # min/max instead of isfinite(): no mask of the tensor's size (factors can be large)
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.float() if t.dtype not in (torch.float32, torch.float64) else t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class LoGRAWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): receives verified LoGRA deltas.

    The methods are called through ``LLM.collective_rpc`` (see `VLLMPolicy` for a driver
    wrapper) and return checksums as hex strings: `logra.delta.weights_checksum` of the
    engine's target weights under the trainer's (Hugging Face) names, directly comparable
    with the trainer's. Only tensor-parallel size 1 is supported (one worker per engine).

    State kept on the worker (attributes prefixed ``_logra``): the config, the policy step,
    the HF-named tensors (views into vLLM's weights, or the shadow copy), and whether a
    failed load requires a full resync.
    """

    # ------------------------------------------------------------ rpc: set up
    def logra_configure(self, config_json: str, step: int) -> str:
        """Start receiving deltas: ``config_json`` is `LoGRAConfig.to_dict` as JSON, ``step`` the
        policy step the engine's current weights hold. Returns the engine's checksum.

        Raises:
            LayoutError: tensor-parallel size > 1, or a model vLLM does not lay out like Llama/Qwen2.
            ValueError: a malformed config.
        """
        config = LoGRAConfig(**json.loads(config_json))
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        tp = self.vllm_config.parallel_config.tensor_parallel_size  # type: ignore[attr-defined]
        pp = self.vllm_config.parallel_config.pipeline_parallel_size  # type: ignore[attr-defined]
        if tp != 1 or pp != 1:
            raise LayoutError(f"LoGRAWorkerExtension supports tensor/pipeline-parallel size 1, the engine has "
                              f"tp={tp}, pp={pp}")
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        layout = FusedLayout.from_hf_config(hf_config)
        targets, dense, shapes = _hf_targets(hf_config, config)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        params = dict(model.named_parameters())
        prepacked = False
        for name in targets + dense:
            slot = layout.slot(name, shapes[name])
            if slot is None:
                continue
            p = params.get(slot.fused_name)
            if p is None:
                raise LayoutError(f"{name} belongs to vLLM parameter {slot.fused_name}, which this engine lacks")
            # oneDNN prepacking leaves an empty `.weight` behind; edits to it would do nothing
            prepacked |= tuple(p.shape) != slot.fused_shape
        previous = getattr(self, "_logra", None)
        state: dict[str, Any] = {
            "config": config, "layout": layout, "targets": targets, "dense": dense, "shapes": shapes,
            "step": step, "needs_resync": False, "mode": "shadow" if prepacked else "inplace",
            "fitted": {},  # distribution='inputs': the projections the last delta that carried any carried
            "dtype": self.model_runner.model_config.dtype,  # type: ignore[attr-defined]
        }
        if prepacked:
            state["modules"] = self._logra_modules(layout, targets + dense, shapes)
            names = [n for names in state["modules"].values() for n in names]
            # A shadow from an earlier configuration mirrors the engine (deltas and full loads
            # since went through it): keep it. Only tensors it lacks come from the last full
            # load on disk (the model folder at start).
            kept = previous["tensors"] if previous is not None and previous["mode"] == "shadow" else {}
            tensors = {n: kept[n] for n in names if n in kept}
            if len(tensors) < len(names):
                source = getattr(self, "_logra_source", None) or self.model_runner.model_config.model  # type: ignore
                full = read_state(source)
                missing = [n for n in names if n not in tensors and n not in full]
                if missing:
                    raise LayoutError(f"the engine's weights at {source} lack {missing[0]}")
                tensors.update({n: full[n].to(state["dtype"]).clone() for n in names if n not in tensors})
            state["tensors"] = tensors
        else:
            state["tensors"] = self._logra_views(layout, targets + dense, shapes, params)
        self._logra = state
        return self.logra_checksum()

    @staticmethod
    def _logra_modules(layout: FusedLayout, names: list[str], shapes: dict[str, tuple[int, ...]]
                       ) -> dict[str, list[str]]:
        """vLLM module → every HF parameter it is loaded from, for the modules holding ``names``.

        vLLM's layerwise reload processes a module once all of its parameters arrive (a
        ``qkv_proj`` needs q, k, v weights and biases), so a reload pushes whole modules.
        """
        wanted = {_module_of(f) for n in names if (f := layout.fused_name(n)) is not None}
        modules: dict[str, list[str]] = {}
        for n in sorted(shapes):
            try:
                f = layout.fused_name(n)
            except LayoutError:
                continue
            if f is not None and _module_of(f) in wanted:
                modules.setdefault(_module_of(f), []).append(n)
        return modules

    @staticmethod
    def _logra_views(layout: FusedLayout, names: list[str], shapes: dict[str, tuple[int, ...]],
                     params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF name → the view of vLLM's fused tensor holding it (tp = 1: whole HF tensors)."""
        views = {}
        for n in names:
            slot = layout.slot(n, shapes[n])
            if slot is not None:  # a tied lm_head has no tensor of its own
                views[n] = slot.fused_part(params[slot.fused_name].data)
        return views

    def logra_info(self) -> str:
        """JSON: mode (``'inplace'``/``'shadow'``), step, dtype, targets, and the shadow's bytes."""
        s = self._logra_state()
        shadow = sum(t.numel() * t.element_size() for t in s["tensors"].values()) if s["mode"] == "shadow" else 0
        return json.dumps({"mode": s["mode"], "step": s["step"], "dtype": str(s["dtype"]).replace("torch.", ""),
                           "targets": len(s["targets"]), "dense": len(s["dense"]), "shadow_bytes": shadow,
                           "needs_resync": s["needs_resync"]})

    def _logra_state(self) -> dict[str, Any]:
        state = getattr(self, "_logra", None)
        if state is None:
            raise NeedsResyncError("LoGRA is not configured on this engine: call logra_configure first")
        return state

    # ------------------------------------------------------------ rpc: checksums
    def logra_checksum(self) -> str:
        """`logra.delta.weights_checksum` of the engine's target weights (HF names, sorted)."""
        s = self._logra_state()
        return _digest((n, s["tensors"][n]) for n in s["targets"] if n in s["tensors"])

    # ------------------------------------------------------------ rpc: deltas
    def logra_apply_delta(self, delta_bytes: bytes, dense_bytes: bytes = b"", checksum: bool = True) -> str:
        """Verify and merge the next update; return the checksum of the merged target weights.

        Args:
            delta_bytes: `PolicyDelta.to_bytes` of update `step`. If it carries a checksum
                (the trainer's `weights_checksum` over its factors' names, in the engine's
                dtype), the merged weights must match it.
            dense_bytes: safetensors bytes of the densely trained non-target tensors after
                the update (``non_target='adamw'``/``'sketch'``), HF names; empty if none.
            checksum: return the checksum of the merged weights even when the delta carries
                none; False returns ``""`` then (hashing costs about as much as the merge:
                0.9 s of 2.7 s at the 0.5B shape in bf16 on this CPU).

        Raises:
            NeedsResyncError: not configured, or a failed full load; call `logra_load_full`.
            DeltaGapError: the delta is not the next update (dropped or repeated).
            DeltaMismatchError: sync fields, names, shapes or non-finite values.
            ChecksumMismatchError: the merge would not give the trainer's weights.
            In every case the engine's weights are unchanged.
        """
        s = self._logra_state()
        if s["needs_resync"]:
            raise NeedsResyncError("this engine's weights are not trusted after a failed load; "
                                   "call logra_load_full")
        delta = PolicyDelta.from_bytes(bytes(delta_bytes))
        dense = {stable_name(k): v for k, v in st_load(bytes(dense_bytes)).items()} if dense_bytes else {}
        self._logra_verify(s, delta, dense)
        tensors = s["tensors"]
        names = sorted(delta.factors)
        merged: dict[str, torch.Tensor] = {}
        got = None
        if delta.checksum is not None:
            # Dry run on temporaries: the engine stays untouched if the result is not the trainer's.
            # Small enough targets keep their merged copies (committed by a copy, not a second merge).
            keep = sum(tensors[n].numel() * tensors[n].element_size() for n in names) <= KEEP_MERGED_BYTES

            def candidates() -> Iterator[tuple[str, torch.Tensor]]:
                for n in names:
                    out = self._logra_merged(s, delta, n, copy=True)
                    if keep:
                        merged[n] = out
                    yield n, out

            got = _digest(candidates())
            if got != delta.checksum:
                raise ChecksumMismatchError(
                    f"update {delta.step}: merged target weights would have checksum {got}, the trainer's is "
                    f"{delta.checksum} (engine dtype {s['dtype']}); engine unchanged")
        with torch.no_grad():
            for n in names:
                if n not in merged:
                    self._logra_merged(s, delta, n, copy=False)
                elif s["mode"] == "shadow":
                    tensors[n] = merged.pop(n)  # the shadow is ours: take the merged copy as it is
                else:
                    tensors[n].copy_(merged.pop(n))  # a view into vLLM's weights: write through it
            for n, t in dense.items():
                tensors[n].copy_(t.to(tensors[n].dtype))
        if s["mode"] == "shadow":
            self._logra_push(s, list(delta.factors) + list(dense))
        self._logra_repack(s, list(delta.factors) + list(dense))
        if delta.projections:
            s["fitted"] = dict(delta.projections)
        s["step"] = delta.step + 1
        if got is None and checksum:
            got = _digest((n, tensors[n]) for n in names)
        return got or ""

    def _logra_verify(self, s: dict[str, Any], delta: PolicyDelta, dense: dict[str, torch.Tensor]) -> None:
        """Every check of `logra_apply_delta` that can be made before merging."""
        if delta.step != s["step"]:
            raise DeltaGapError(s["step"], delta.step)
        config = s["config"]
        check_sync(delta, config)
        if not math.isfinite(delta.decay) or not 0 <= delta.decay < 1:
            raise DeltaMismatchError(f"update {delta.step}: decay {delta.decay} is not in [0, 1)")
        unknown = sorted(set(delta.factors) - set(s["targets"]))
        if unknown:
            raise DeltaMismatchError(f"update {delta.step} targets {unknown[0]}, not a LoGRA target of this engine")
        for n, u in delta.factors.items():
            shape = s["shapes"][n]
            if tuple(u.shape) != (shape[0], config.rank) or config.rank > shape[1]:
                raise DeltaMismatchError(f"update {delta.step}: factor for {n} is {tuple(u.shape)}, the weight is "
                                         f"{shape}, rank {config.rank}")
            if not _finite(u):
                raise DeltaMismatchError(f"update {delta.step}: factor for {n} holds NaN or Inf")
            c = delta.column_scales.get(n)
            if c is not None and (tuple(c.shape) != (shape[1],) or not _finite(c)):
                raise DeltaMismatchError(f"update {delta.step}: column scale for {n} is {tuple(c.shape)} or "
                                         "not finite")
            if n in delta.fitted and not _finite(delta_projection(delta, config, n, shape[1], kept=s["fitted"])):
                raise DeltaMismatchError(f"update {delta.step}: fitted projection for {n} holds NaN or Inf")
        for n, t in dense.items():
            if n not in s["dense"]:
                raise DeltaMismatchError(f"update {delta.step} sends dense {n}, which this engine's config "
                                         f"(non_target={config.non_target!r}) does not train")
            if tuple(t.shape) != s["shapes"][n] or not _finite(t):
                raise DeltaMismatchError(f"update {delta.step}: dense {n} is {tuple(t.shape)}, expected "
                                         f"{s['shapes'][n]}, or holds NaN/Inf")

    @staticmethod
    def _logra_merged(s: dict[str, Any], delta: PolicyDelta, name: str, copy: bool) -> torch.Tensor:
        """``name``'s weight after ``delta``: merged into a temporary (``copy``) or in place."""
        w = s["tensors"][name]
        out = w.clone() if copy else w
        a = delta_projection(delta, s["config"], name, w.shape[1], w.device, kept=s["fitted"])
        with torch.no_grad():
            merge_update(out, delta.factors[name].to(w.device), a, delta.decay)
        return out

    def _logra_push(self, s: dict[str, Any], changed: Iterable[str]) -> None:
        """Shadow mode: reload every vLLM module holding a changed tensor (whole modules)."""
        layout = s["layout"]
        modules = {_module_of(f) for n in changed if (f := layout.fused_name(n)) is not None}
        names = [n for m in sorted(modules) for n in s["modules"][m]]
        self._logra_reload((n, s["tensors"][n]) for n in names)

    def _logra_repack(self, s: dict[str, Any], changed: Iterable[str]) -> None:
        """Rebuild vLLM's CPU GEMM handles that copied a changed weight but keep ``.weight``.

        On a CPU vLLM gives the output head (``UnquantizedEmbeddingMethod``) a packed copy
        of its weight for the logits GEMM and keeps ``.weight`` for the embedding lookup. A
        tied ``lm_head`` shares the embedding's ``.weight`` but is a module of its own, which
        a reload of ``embed_tokens`` does not re-process, and an in-place merge re-processes
        nothing: both would leave the logits on the old weights (measured: 0.58 nats off
        after one update of a tied fp32 model). Modules with an emptied ``.weight`` (prepacked
        linear layers) are re-packed by ``reload_weights`` itself; GPUs have no such handles.
        """
        layout = s["layout"]
        params = dict(self.model_runner.get_model().named_parameters())  # type: ignore[attr-defined]
        ptrs = {params[f].data_ptr() for n in changed if (f := layout.fused_name(n)) is not None and f in params}
        for module in self.model_runner.get_model().modules():  # type: ignore[attr-defined]
            w = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if (hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.numel() and w.data_ptr() in ptrs
                    and hasattr(method, "process_weights_after_loading")):
                method.process_weights_after_loading(module)

    def _logra_reload(self, weights: Iterator[tuple[str, torch.Tensor]] | Iterable[tuple[str, torch.Tensor]]
                      ) -> None:
        self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]

    # ------------------------------------------------------------ rpc: full resync
    def logra_load_full(self, path_or_bytes: str | bytes, step: int, fitted: bytes = b"") -> str:
        """Load a whole saved policy (HF names: a folder, a ``.safetensors`` file or its bytes) at ``step``.

        Every parameter of the engine's model must be present (a tied ``lm_head`` may be
        absent); tensors are cast to the engine's dtype. ``fitted``: safetensors bytes of the
        trainer's fitted projections (by input group), kept for the deltas that follow in place of
        the engine's; empty leaves none (a delta that needs them must carry them). Afterwards
        the engine accepts update ``step`` next. Returns the checksum.

        Raises:
            LayoutError: the saved policy lacks a parameter or has another shape; the engine is unchanged.
        """
        s = self._logra_state()
        full = read_state(path_or_bytes)
        for n, shape in s["shapes"].items():
            if n == "lm_head.weight" and s["layout"].tie_word_embeddings:
                continue
            if n not in full:
                raise LayoutError(f"full weights for step {step} lack {n}")
            if tuple(full[n].shape) != shape:
                raise LayoutError(f"full weights for step {step}: {n} is {tuple(full[n].shape)}, expected {shape}")
        projections = dict(st_load(fitted)) if fitted else {}  # read before any weight changes
        names = [n for n in sorted(full) if n in s["shapes"]]
        try:
            self._logra_reload((n, full[n].to(s["dtype"])) for n in names)
        except Exception:
            s["needs_resync"] = True  # partly loaded: only another full load can be trusted
            raise
        if s["mode"] == "shadow":
            for n, t in s["tensors"].items():
                t.copy_(full[n].to(t.dtype))
        self._logra_repack(s, names)
        if isinstance(path_or_bytes, str):  # where a later reconfiguration re-reads the shadow from
            self._logra_source = path_or_bytes
        s["fitted"] = projections  # another run's kept projections would merge this run's deltas wrongly
        s["step"] = step
        s["needs_resync"] = False
        return self.logra_checksum()
