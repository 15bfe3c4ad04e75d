"""`PolicyDelta` into vLLM's fused layout, verified like `logra.parallel`'s rollout workers.

`apply_delta_fused` merges a `PolicyDelta` into fused tensors (`layout.FusedLayout`) with
one matmul per target, through the same `merge_update` as `apply_delta`, so the fused
slice holds the bits that the HF weight would hold (for shards with tp > 1 the default
``strategy='full'`` runs that matmul at the HF weight's shape, because a BLAS may round a
smaller GEMM differently). `FusedReceiver` adds the checks: the step must be the next
one, the fused state's checksum must match the trainer's per-rank expectation
(`expected_fused_checksum`), and `FusedReceiver.resync` rebuilds the fused tensors from a
full HF state dict.

Bitwise equality needs the same dtype and device arithmetic on both sides: a bf16 vLLM
engine matches a bf16 HF copy that applied the same deltas, not a fp32 trainer's
weights cast to bf16.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from ...config import LoGRAConfig
from ...delta import PolicyDelta, check_sync, delta_projection, merge_update
from ...errors import ChecksumMismatchError, DeltaGapError, DeltaMismatchError, LayoutError, NeedsResyncError
from .layout import FusedLayout, Slot, copy_into_fused, fuse_state_dict, plan_copy


# ------------------------------------------------------------------ checksums
def _digest(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in items:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def fused_checksum(fused: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> str:
    """BLAKE2 digest of the named fused tensors' bytes, in sorted name order (all if None).

    The same recipe as `logra.weights_checksum`, applied to fused names and shards.
    """
    chosen = sorted(fused if names is None else names)
    missing = [n for n in chosen if n not in fused]
    if missing:
        raise LayoutError(f"no fused tensor {missing[0]!r}")
    return _digest((n, fused[n]) for n in chosen)


@torch.no_grad()
def expected_fused_checksum(hf_state: Mapping[str, torch.Tensor], layout: FusedLayout,
                            names: Iterable[str] | None = None) -> str:
    """What `fused_checksum` gives on ``layout.tp_rank`` if its weights equal ``hf_state``'s.

    The trainer computes this per rank (`FusedLayout.for_rank`) from the weights a
    receiver must hold (same dtype as the receiver's). Fused tensors are built one at a
    time on the CPU, so the extra memory is one fused shard.

    Args:
        hf_state: HF name → tensor; must hold every member of the fused tensors asked for.
        names: fused names to cover (default: every fused tensor ``hf_state`` touches).
    """
    by_fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf_state.items():
        s = layout.slot(name, tuple(t.shape))
        if s is not None:
            by_fused.setdefault(s.fused_name, {})[name] = t.detach().cpu()
    chosen = sorted(by_fused if names is None else names)
    missing = [n for n in chosen if n not in by_fused]
    if missing:
        raise LayoutError(f"hf_state holds no member of fused tensor {missing[0]!r}")

    def tensors() -> Iterable[tuple[str, torch.Tensor]]:
        for n in chosen:
            yield n, fuse_state_dict(by_fused[n], layout)[n]

    return _digest(tensors())


# ------------------------------------------------------------------ deltas
def _validate(fused: Mapping[str, torch.Tensor], delta: PolicyDelta, config: LoGRAConfig,
              layout: FusedLayout, kept: Mapping[str, torch.Tensor] | None = None
              ) -> list[tuple[str, torch.Tensor, Slot]]:
    check_sync(delta, config)
    plan = []
    for name, u in delta.factors.items():
        try:
            s = layout.slot(name)
        except LayoutError as e:
            raise DeltaMismatchError(f"delta target {name!r} does not fit the vLLM layout: {e}") from e
        if s is None:  # tied lm_head: vLLM shares embed_tokens, which the delta names instead
            raise DeltaMismatchError(f"delta targets {name!r} but this model ties it to the input embeddings")
        if len(s.hf_shape) != 2:
            raise DeltaMismatchError(f"delta target {name!r} is not a 2-D weight")
        if s.fused_name not in fused:
            raise DeltaMismatchError(f"delta target {name!r} belongs to {s.fused_name}, not among the fused tensors")
        w = fused[s.fused_name]
        if tuple(w.shape) != s.fused_shape:
            raise DeltaMismatchError(f"{s.fused_name} is {tuple(w.shape)}, the layout implies {s.fused_shape}")
        if tuple(u.shape) != (s.hf_shape[0], config.rank) or config.rank > s.hf_shape[1]:
            raise DeltaMismatchError(f"delta factor for {name} is {tuple(u.shape)}, the HF weight is {s.hf_shape}, "
                                     f"rank {config.rank}")
        if name in delta.fitted:  # carried or kept, and of the right shape
            delta_projection(delta, config, name, s.hf_shape[1], kept=kept)
        plan.append((name, u, s))
    return plan


STRATEGIES = ("full", "slice")


@torch.no_grad()
def apply_delta_fused(fused: Mapping[str, torch.Tensor], delta: PolicyDelta, config: LoGRAConfig,
                      layout: FusedLayout, strategy: str = "full",
                      kept: Mapping[str, torch.Tensor] | None = None) -> None:
    """In place: merge ``delta`` into one rank's fused tensors, one matmul per target.

    For each target the projection ``A`` is rebuilt from the seeds exactly as
    `apply_delta` does (a fitted one is the delta's, or else ``kept``'s: the projections of
    the last delta that carried any), and `merge_update` (the trainer's arithmetic: ``U`` and ``A``
    cast to the weight's dtype, decay first, then ``addmm_``) runs in the fused
    tensor's dtype and device. Step order is not checked here: use `FusedReceiver`.

    Args:
        strategy: how a shard (a strict part of the HF weight, i.e. tp > 1) is updated.
            ``'full'`` (default): the matmul runs with the HF weight's full shape on a
            temporary holding this rank's rectangle, which is then copied back; the
            GEMM sees the same shape as `apply_delta`'s, so the bits are the same by
            construction, at the cost of one temporary of the HF weight's size and
            tp-times the (rank-r, cheap) FLOPs. ``'slice'``: the matmul runs on the
            rectangle itself with the matching rows of ``U`` (row-parallel: the
            matching columns of ``A``); least memory and FLOPs, but a BLAS may pick
            another kernel for the smaller shape: on this CPU a 32x8 output differed
            in the last bit while realistic shapes matched. Targets a rank holds whole
            (tp = 1) are always updated in place.

    Raises:
        DeltaMismatchError: sync fields, names or shapes do not fit. Nothing is changed.
        ValueError: unknown ``strategy``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    plan = _validate(fused, delta, config, layout, kept)
    for name, u, s in plan:
        w = s.fused_part(fused[s.fused_name])
        if w.numel() == 0:  # a vocab shard made only of padding rows
            continue
        a = delta_projection(delta, config, name, s.hf_shape[1], kept=kept)
        if tuple(w.shape) == s.hf_shape:
            merge_update(w, u.to(w.device), a.to(w.device), delta.decay)
        elif strategy == "full":
            tmp = torch.zeros(s.hf_shape, dtype=w.dtype, device=w.device)
            part = s.hf_part(tmp)
            part.copy_(w)
            merge_update(tmp, u.to(w.device), a.to(w.device), delta.decay)
            w.copy_(part)
            del tmp
        else:
            merge_update(w, u[s.hf_rows].to(w.device), a[:, s.hf_cols].contiguous().to(w.device), delta.decay)


# ------------------------------------------------------------------ receiver
class FusedReceiver:
    """One tensor-parallel rank of a rollout engine kept current by verified deltas.

    Args:
        params: fused name → the engine's tensors (updated in place, e.g. the
            ``named_parameters()`` of vLLM's model on this rank).
        layout: this rank's `FusedLayout`.
        config: the LoGRA config (sync fields must match the trainer's).
        step: the policy step ``params`` hold (updates applied so far).
        strategy: how shards are updated (see `apply_delta_fused`).

    Protocol (as `logra.parallel`): `apply` accepts only update ``step``; after a failed
    checksum the receiver refuses every delta until `resync`.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], layout: FusedLayout, config: LoGRAConfig,
                 step: int = 0, strategy: str = "full") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.strategy = strategy
        self.params = params
        self.layout = layout
        self.config = config
        self.step = step
        self.needs_resync = False
        self.resyncs = 0
        self.fitted: dict[str, torch.Tensor] = {}  # distribution='inputs': the last carried ones

    def apply(self, delta: PolicyDelta, checksum: str | None = None,
              dense: Mapping[str, torch.Tensor] | None = None) -> None:
        """Merge the next update, then copy ``dense`` (HF-named non-target tensors) and verify.

        Args:
            delta: must be update `step`.
            checksum: the trainer's `expected_fused_checksum` for this rank over
                `checked_names` (None: not verified).
            dense: HF-named tensors trained densely (``non_target='adamw'``/``'sketch'``).

        Raises:
            NeedsResyncError: an earlier checksum failed; call `resync`.
            DeltaGapError: ``delta.step`` is not `step` (nothing changed).
            DeltaMismatchError: the delta or dense tensors do not fit (nothing changed).
            ChecksumMismatchError: applied, but the result differs from the trainer's;
                the receiver now needs a resync.
        """
        if self.needs_resync:
            raise NeedsResyncError("this receiver's weights failed verification; it accepts only a full resync")
        if delta.step != self.step:
            raise DeltaGapError(self.step, delta.step)
        _validate(self.params, delta, self.config, self.layout, self.fitted)
        if dense:
            try:
                plan_copy(self.params, dense, self.layout, strict=False)
            except LayoutError as e:
                raise DeltaMismatchError(f"dense tensors do not fit: {e}") from e
        apply_delta_fused(self.params, delta, self.config, self.layout, self.strategy, self.fitted)
        if delta.projections:
            self.fitted = dict(delta.projections)
        if dense:
            copy_into_fused(self.params, dense, self.layout)
        if checksum is not None:
            got = fused_checksum(self.params, self.checked_names(delta, dense))
            if got != checksum:
                self.needs_resync = True
                raise ChecksumMismatchError(f"checksum mismatch after update {delta.step} on tp rank "
                                            f"{self.layout.tp_rank}: {got} != {checksum}; a full resync is needed")
        self.step = delta.step + 1

    def checked_names(self, delta: PolicyDelta, dense: Mapping[str, torch.Tensor] | Iterable[str] | None = None
                      ) -> list[str]:
        """Fused names an update's checksum covers: those holding a target or a dense tensor."""
        return self.layout.fused_names(list(delta.factors) + list(dense or ()))

    def checksum(self, names: Iterable[str] | None = None) -> str:
        """`fused_checksum` of this rank's tensors (all if ``names`` is None)."""
        return fused_checksum(self.params, names)

    def resync(self, hf_state: Mapping[str, torch.Tensor], step: int, checksum: str | None = None,
               fitted: Mapping[str, torch.Tensor] | None = None) -> None:
        """Full-weight sync: overwrite every fused tensor from an HF state dict, then hold ``step``.

        Args:
            hf_state: every HF parameter (tied ``lm_head`` optional), in the receiver's dtype.
            step: the policy step these weights are.
            checksum: the trainer's `expected_fused_checksum` over all fused tensors of
                this rank (None: not verified).
            fitted: the trainer's fitted projections (`LoGRAOptimizer.fitted_projections`),
                kept for the deltas that follow in place of the receiver's (None: none kept, so
                a delta that needs them must carry them).

        Raises:
            LayoutError: ``hf_state`` does not cover the fused tensors.
            ChecksumMismatchError: the loaded weights differ from the trainer's.
        """
        copy_into_fused(self.params, hf_state, self.layout, strict=True)
        if checksum is not None:
            got = self.checksum()
            if got != checksum:
                self.needs_resync = True
                raise ChecksumMismatchError(f"full weights for step {step} arrived with checksum {got}, "
                                            f"trainer sent {checksum}")
        self.fitted = dict(fitted or {})  # another run's kept projections would merge this run's deltas wrongly
        self.step = step
        self.needs_resync = False
        self.resyncs += 1

