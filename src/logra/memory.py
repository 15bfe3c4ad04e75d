"""Memory measurement with PyTorch's own tools.

`track_memory` wraps ``torch.distributed._tools.mem_tracker.MemTracker`` (peak bytes by
category: parameters, gradients, optimizer state, activations, temporaries) and adds
the process peak RSS and, on CUDA, ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

GIB = 1024**3
#: Category names of `MemoryReport.peak_by_category`.
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "buffers", "other")
_NAMES = {
    _MemRefType.PARAM: "parameters", _MemRefType.GRAD: "gradients", _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporary", _MemRefType.BUFFER: "buffers",
    _MemRefType.OTH: "other",
}


class _Tracker(MemTracker):
    """MemTracker that tolerates frozen parameters.

    Upstream registers a gradient hook on every parameter of every module it enters,
    which raises for ``requires_grad=False`` weights (LoGRA targets, LoRA bases).
    """

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):  # type: ignore[override]
        result = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for p in module.parameters():
                if p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(self._record_grad),
                        p.register_post_accumulate_grad_hook(lambda q: self._record_grad(q.grad)),
                    )
        return result

    def _register_global_optimizer_hook(self) -> None:  # type: ignore[override]
        # Upstream clears its in-optimizer flag at the end of ANY optimizer step; an
        # optimizer that steps an inner one (LoGRA's non-target AdamW) would have the
        # rest of its step counted as activations. Count nesting depth instead.
        depth = [0]

        def pre(optimizer, args, kwargs) -> None:
            depth[0] += 1
            self._in_opt = True

        def post(optimizer, args, kwargs) -> None:
            self._track_optimizer_states(_MemRefType.OPT, optimizer)
            depth[0] -= 1
            self._in_opt = depth[0] > 0

        self._optimizer_hook_handles = (
            register_optimizer_step_pre_hook(pre),
            register_optimizer_step_post_hook(post),
        )

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:  # type: ignore[override]
        # Upstream refuses a second top-level forward of the same module (a new training
        # step, generation, a KL probe, an output head run chunk by chunk). We only report
        # global peaks, which per-module statistics do not affect, so that module starts a
        # new record; the others keep theirs (their backward may still be to come).
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _record_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def track_as(self, tensors: dict[str, list[torch.Tensor]]) -> None:
        """Count externally created tensors under a category ('gradients' or 'optimizer')."""
        kinds = {"gradients": _MemRefType.GRAD, "optimizer": _MemRefType.OPT}
        for category, items in tensors.items():
            for t in items:
                self._update_and_maybe_create_winfos(t, kinds[category])


@dataclass
class MemoryReport:
    """Peak memory of a tracked region.

    Attributes:
        peak_by_category: bytes per category (`CATEGORIES`) at the tracker's overall peak.
        peak_total: bytes of all tracked tensors at that peak.
        peak_rss: the process's peak resident set size so far (bytes; lifetime of the process).
        cuda_max_allocated: ``torch.cuda.max_memory_allocated`` over the region (None on CPU).
    """

    peak_by_category: dict[str, int] = field(default_factory=dict)
    peak_total: int = 0
    peak_rss: int = 0
    cuda_max_allocated: int | None = None

    def gib(self) -> dict[str, float]:
        """The figures in GiB, flat, for tables and logs."""
        out = {f"{k}_gib": v / GIB for k, v in self.peak_by_category.items()}
        out["tracked_peak_gib"] = self.peak_total / GIB
        out["rss_peak_gib"] = self.peak_rss / GIB
        if self.cuda_max_allocated is not None:
            out["cuda_max_allocated_gib"] = self.cuda_max_allocated / GIB
        return out


def enable_activation_checkpointing(model: nn.Module, reentrant: bool = False) -> None:
    """Turn on a Hugging Face model's activation checkpointing under either name of the method.

    transformers renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``
    in its 5.x series (present in 5.25, absent in 5.17); both take the
    ``torch.utils.checkpoint`` keyword arguments. ``reentrant=False`` is what LoGRA's sketch
    hooks need: recomputation then rebuilds ``P = X Aᵀ`` and the sketch is added once.
    """
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process in bytes (``ru_maxrss``)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


@contextmanager
def track_memory(
    *external: nn.Module | torch.optim.Optimizer | torch.Tensor, device: torch.device | str | None = None
) -> Iterator[MemoryReport]:
    """Track every tensor allocated in the block plus the given modules and optimizers.

    The block may run any number of steps, generations and probes; the report holds
    the peak over all of them. Yields a `MemoryReport` that is filled in when the block
    exits::

        with track_memory(model, optimizer) as report:
            loss = model(**batch).loss; loss.backward(); optimizer.step()
        print(report.gib())
    """
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = _Tracker()
    report = MemoryReport()
    tracker.track_external(*[x for x in external if x is not None])
    for x in external:
        # Optimizers whose state lives outside `optimizer.state` (LoGRA's sketch buffer,
        # second moments, projections) say where it is.
        if hasattr(x, "memory_tensors"):
            tracker.track_as(x.memory_tensors())
    with tracker:
        yield report
    peak = tracker.get_tracker_snapshot("peak")
    by_cat = {name: 0 for name in CATEGORIES}
    total = 0
    for dev, stats in peak.items():
        if device is not None and torch.device(dev).type != device.type:
            continue
        for ref, nbytes in stats.items():
            if ref in _NAMES:
                by_cat[_NAMES[ref]] += nbytes
            elif ref == "Total":
                total += nbytes
    report.peak_by_category = by_cat
    report.peak_total = total
    report.peak_rss = peak_rss_bytes()
    if cuda:
        torch.cuda.synchronize(device)
        report.cuda_max_allocated = torch.cuda.max_memory_allocated(device)
