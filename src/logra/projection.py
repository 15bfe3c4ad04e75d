"""Projections: seeded random ones, which any process rebuilds without receiving them, and
ones fitted to the inputs, which travel with the policy delta.

`Projector` keeps the projections in force for an optimizer; `build_projection` rebuilds
one on a receiver through the same drawing and unpacking, bit for bit. With
``distribution='inputs'`` the projections of linear targets are instead fitted to their
inputs (`Projector.fit`) and travel with the policy delta: they cannot be rebuilt from a seed.

A projection is ``[r, in]`` with ``E[AᵀA] = I``, so ``S A = G AᵀA`` is an unbiased
estimate of the dense gradient ``G`` from its sketch ``S = G Aᵀ``. Matrices are drawn on
the CPU with a `torch.Generator`, which gives the same bits on every machine, and only
then moved to the weight's device. Where Rademacher projections change between updates,
`Projector` draws the next ones on host threads as soon as an update is installed, so the
draw runs while the next rollout, forward and backward do (on a GPU the host is otherwise
idle then).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from .config import LoGRAConfig
    from .sketch import SketchTarget

# Prefixes that wrappers (torch.compile, DDP, FSDP, activation checkpointing, PEFT) add
# to parameter names; the seed must not depend on how a model happens to be wrapped.
_WRAPPER_PREFIXES = re.compile(
    r"(^|\.)(_orig_mod|module|_fsdp_wrapped_module|_checkpoint_wrapped_module|base_model\.model)\."
)


def stable_name(name: str) -> str:
    """``name`` with wrapper prefixes (``module.``, ``_orig_mod.``, FSDP/checkpoint) removed."""
    previous = None
    while previous != name:
        previous, name = name, _WRAPPER_PREFIXES.sub(r"\1", name)
    return name


#: Layers of a Llama / Qwen / Mistral decoder layer that read the same input tensor;
#: with ``LoGRAConfig.share_projections`` each group shares one projection.
SHARED_INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def projection_key(name: str, shared: bool = False) -> str:
    """The name a target's projection is drawn for: its stable name or, with ``shared``
    and a member of a `SHARED_INPUT_GROUPS` group, the group's (``...self_attn.q_proj+k_proj+v_proj.weight``)."""
    name = stable_name(name)
    if not shared:
        return name
    parts = name.split(".")
    leaf = len(parts) - 2 if parts[-1] in ("weight", "bias") and len(parts) > 1 else len(parts) - 1
    for group in SHARED_INPUT_GROUPS:
        if parts[leaf] in group:
            parts[leaf] = "+".join(group)
            return ".".join(parts)
    return name


def projection_index(update_index: int, refresh: bool, refresh_every: int) -> int:
    """Which projection is in force after ``update_index`` applied updates."""
    if not refresh:
        return 0
    return (update_index // refresh_every) * refresh_every


def projection_seed(base_seed: int, index: int, name: str) -> int:
    """A 63-bit seed from the base seed, the projection index and the layer's stable name."""
    key = f"{base_seed}:{index}:{stable_name(name)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def rademacher_signs(rank: int, in_features: int, seed: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[rank, in_features]`` int8 signs (±1) of a Rademacher projection: the
    projection `make_projection` draws with the same seed is these signs times 1/√rank."""
    signs = _rademacher_bits(rank, in_features, seed).mul_(2).sub_(1)
    return signs.to(device) if device is not None else signs


def _rademacher_bits(rank: int, in_features: int, seed: int) -> torch.Tensor:
    """``[rank, in_features]`` int8 on the CPU: 1 where `rademacher_signs` is +1, else 0."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (rank, in_features), generator=gen, dtype=torch.int8)


def signs_to_projection(signs: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """fp32 projection ``signs / √rank`` from `rademacher_signs` (bitwise `make_projection`'s);
    ``rank`` defaults to the rows of ``signs``."""
    return signs.to(torch.float32).mul_(1.0 / math.sqrt(signs.shape[0] if rank is None else rank))


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """``[rank, in]`` ±1 signs as bits, ``[rank, ⌈in/8⌉]`` uint8 (bit ``j`` of byte ``k`` is 1
    where column ``8k + j`` is +1, or 1 for 0/1 bits): an eighth of int8, a thirty-second of fp32."""
    # numpy's packbits is one C loop, ~30x faster than shifts and a sum in torch
    bits = np.packbits((signs > 0).cpu().numpy(), axis=1, bitorder="little")
    return torch.from_numpy(bits).to(signs.device)


@functools.cache
def _byte_table(rank: int, device: torch.device) -> torch.Tensor:
    """``[256, 8]`` fp32: row ``b`` holds the eight entries ``±1/√rank`` that byte ``b`` encodes."""
    byte = torch.arange(256, dtype=torch.uint8, device="cpu")
    bits = (byte.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device="cpu")) & 1
    return signs_to_projection(bits.to(torch.int8).mul_(2).sub_(1), rank).to(device)


def unpack_projection(bits: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 projection ``±1/√rank`` of `pack_signs`'s bits (bitwise `make_projection`'s)."""
    # a byte → eight entries lookup: one gather instead of shifts, masks and arithmetic
    a = _byte_table(bits.shape[0], bits.device)[bits.int()].view(bits.shape[0], -1)
    return a if a.shape[1] == in_features else a[:, :in_features].contiguous()


def make_projection(
    rank: int,
    in_features: int,
    seed: int,
    distribution: str = "rademacher",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw one fp32 projection ``[rank, in_features]`` with ``E[AᵀA] = I``.

    Rademacher entries are ±1/√rank, Gaussian entries N(0, 1/rank). ``'orthogonal'`` rows
    are orthonormal, scaled by √(in/rank): ``AᵀA`` is then exactly the identity at
    ``rank == in_features`` (the sketch loses nothing) and an unbiased estimate of it below.
    They come from a float64 QR decomposition, so unlike the other two they are bitwise
    equal across machines only where the LAPACK library agrees (same torch build).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if distribution == "rademacher":
        a = signs_to_projection(rademacher_signs(rank, in_features, seed))
    elif distribution == "gaussian":
        a = torch.randn(rank, in_features, generator=gen, dtype=torch.float32).mul_(1.0 / math.sqrt(rank))
    elif distribution == "orthogonal":
        if rank > in_features:
            raise ValueError(f"orthogonal projections need rank <= in_features, got {rank} > {in_features}")
        g = torch.randn(in_features, rank, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        # sign fix: makes Q unique (Haar-distributed) whatever sign convention LAPACK uses
        q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
        a = (q.T * math.sqrt(in_features / rank)).to(torch.float32)
    else:
        raise ValueError(f"unknown projection distribution {distribution!r} (rademacher | gaussian | orthogonal)")
    return a.to(device) if device is not None else a


# ----------------------------------------------------------------------------- the one builder
def _stored_projection(rank: int, in_features: int, seed: int, distribution: str,
                       device: torch.device | str | None) -> torch.Tensor:
    """A projection as kept in memory: a Rademacher one as packed sign bits (1/32 of fp32),
    the others as the fp32 matrix."""
    if distribution == "rademacher":
        return pack_signs(_rademacher_bits(rank, in_features, seed)).to(device)
    return make_projection(rank, in_features, seed, distribution, device)


@functools.cache
def _draw_pool() -> ThreadPoolExecutor:
    """The process's host threads for drawing projections ahead (started on first use)."""
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="logra-projection")


# a forked child has none of the parent's threads: it must start its own pool
os.register_at_fork(after_in_child=_draw_pool.cache_clear)


class _DrawnAhead(NamedTuple):
    """The stored Rademacher projections of one projection index, being drawn on host threads."""

    index: int
    pid: int  # the process that started the jobs: a forked child cannot wait on them
    jobs: list[Future[dict[str, torch.Tensor]]]

    def serves(self, index: int) -> bool:
        """Whether these jobs draw projection ``index`` for this process."""
        return self.index == index and self.pid == os.getpid()

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


def _draw_ahead(config: LoGRAConfig, index: int, widths: dict[str, int]) -> _DrawnAhead:
    """Start drawing the packed Rademacher signs of projection ``index`` for ``widths``
    (projection key → in_features) on the host, one ``{key: bits}`` job per thread torch may
    use (``torch.get_num_threads()``): the draw is a serial kernel and a numpy loop, so the
    threads run side by side."""
    rank, seed = config.rank, config.seed

    def draw(keys: list[str]) -> dict[str, torch.Tensor]:
        return {key: _stored_projection(rank, widths[key], projection_seed(seed, index, key), "rademacher", None)
                for key in keys}

    keys = sorted(widths, key=widths.__getitem__, reverse=True)  # widest first: even shares
    threads = max(1, min(torch.get_num_threads(), len(keys)))
    return _DrawnAhead(index, os.getpid(), [_draw_pool().submit(draw, keys[i::threads]) for i in range(threads)])


def materialize(stored: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 ``[r, in]`` matrix of a stored projection (unpacks sign bits; fp32 as is)."""
    return unpack_projection(stored, in_features) if stored.dtype == torch.uint8 else stored


def build_projection(config: LoGRAConfig, name: str, index: int, in_features: int,
                     device: torch.device | str | None = None,
                     column_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 projection of target ``name`` with projection index ``index``, times its
    column scales if given: what the trainer merged with, bit for bit.

    This and `Projector` go through the same drawing and unpacking, so every receiver
    (`logra.apply_delta`, rollout workers, the vLLM layout) rebuilds the trainer's bits.
    A target fitted to its inputs (``distribution='inputs'``) has no seeded projection: its
    receivers take the one the delta stream carried (`logra.delta.delta_projection`).
    """
    key = projection_key(name, config.share_projections)
    seed = projection_seed(config.seed, index, key)
    a = materialize(_stored_projection(config.rank, in_features, seed, seeded_distribution(config), device),
                    in_features)
    return a if column_scale is None else a * column_scale.to(a.device)


def seeded_distribution(config: LoGRAConfig) -> str:
    """The distribution of the projections drawn from seeds: ``config.distribution``, or
    Rademacher for the targets that ``'inputs'`` does not fit (embeddings)."""
    return "rademacher" if config.distribution == "inputs" else config.distribution


# ----------------------------------------------------------------------------- fitted to inputs
#: Inputs up to this width get the exact second moment ``Σ x xᵀ`` (float64, ``in²`` values:
#: 128 MiB at 4096, held during the fit only); wider ones a one-pass Nyström sketch of it.
EXACT_MOMENT_MAX = 4096
#: The fit holds at most this many bytes of moments at once (at least one layer input's):
#: it runs the batches once per share of the layer inputs rather than hold every moment.
FIT_MOMENT_BYTES = 256 * 2**20


class InputMoment:
    """The second moment ``Σ x xᵀ`` of one layer's input tokens and its top principal subspace.

    Up to `EXACT_MOMENT_MAX` input features it is accumulated exactly in float64. Wider, it
    is kept as ``Y = Σ x xᵀ Ω`` with a seeded Gaussian ``Ω`` (``[in, 2r]``): a Nyström
    approximation of the moment (Tropp et al., 2017), exact where the inputs span at most
    ``2r`` directions, in ``in·2r`` values instead of ``in²``.
    """

    @staticmethod
    def nbytes(in_features: int, rank: int) -> int:
        """Bytes an `InputMoment` of this width and rank holds (its moment and sketch matrix)."""
        width = min(in_features, 2 * rank)
        return 8 * (in_features * in_features if in_features <= EXACT_MOMENT_MAX else 2 * in_features * width)

    def __init__(self, in_features: int, rank: int, seed: int, device: torch.device | str | None = None) -> None:
        self.rank = rank
        width = min(in_features, 2 * rank)
        self.omega: torch.Tensor | None = None
        if in_features > EXACT_MOMENT_MAX:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self.omega = torch.randn(in_features, width, generator=gen, dtype=torch.float64).to(device)
        self.moment = torch.zeros(in_features, in_features if self.omega is None else width,
                                  dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate the tokens ``x`` (``[N, in]``)."""
        x = x.double()
        self.moment.addmm_(x.T, x if self.omega is None else x @ self.omega)
        self.tokens += x.shape[0]

    def top_subspace(self) -> torch.Tensor:
        """``[in, r]`` float64 orthonormal basis of the moment's top-``r`` eigenvectors."""
        if self.omega is None:
            return torch.linalg.eigh(self.moment)[1][:, -self.rank:]
        y, omega = self.moment, self.omega
        # a shift by a tiny multiple of ‖Y‖ keeps the Cholesky factor of ΩᵀY defined when the
        # inputs span fewer than 2r directions; it moves no eigenvector
        shift = math.sqrt(y.shape[0]) * torch.finfo(torch.float64).eps * float(torch.linalg.matrix_norm(y))
        y = y + shift * omega
        core = omega.T @ y
        chol = torch.linalg.cholesky((core + core.T) / 2)
        b = torch.linalg.solve_triangular(chol, y.T, upper=False).T  # Y L⁻ᵀ: the moment is B Bᵀ
        return torch.linalg.svd(b, full_matrices=False)[0][:, : self.rank]


def fitted_projection(basis: torch.Tensor) -> torch.Tensor:
    """The fp32 projection ``√(in/r)·Qᵀ`` (``[r, in]``) of an orthonormal ``[in, r]`` basis
    ``Q``: the scale of ``'orthogonal'``, so that ``AᵀA = I`` at ``r = in``."""
    return (basis.T * math.sqrt(basis.shape[0] / basis.shape[1])).to(torch.float32)


def _record_tokens(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The ``[N, in]`` tokens of a layer input ``x``, without padding where ``mask`` fits it."""
    if mask is not None and tuple(mask.shape) == tuple(x.shape[:-1]):
        return x[mask]
    return x.reshape(-1, x.shape[-1])


class Projector:
    """The projections in force for one optimizer's sketch targets, and everything tied to them.

    It owns the projection index (which seeds are in force), the stored projections (packed
    sign bits where possible), the column scales ``c`` of ``LoGRAConfig.column_scale='input'``
    and the input statistics they come from, and the cache of ``A Aᵀ``. `install` draws
    the projections for a given number of applied updates and, on request, returns the old
    and new bases that state kept in sketch coordinates needs to follow them. Each `install`
    also starts drawing, on host threads, the Rademacher projections one update later if
    they will differ (refresh after every update, or the last update of a window), so that
    their draw overlaps the next update's work; the next `install` takes those very bits.

    With ``distribution='inputs'`` and refresh windows, a new window's projections are fitted
    to the inputs then: `install` at a window's first update leaves the fitted targets without
    a projection (so that no gradient is sketched against the last window's) until `fit`
    installs the window's, and with them the seeded ones.

    Attributes:
        index: the projection index in force (None before the first `install`).
        column_scales: per target, the ``c`` of the projection in force (``A·diag(c)``).
        fitted_index: the projection index the fitted projections were fitted for (None
            before the first `fit`).
    """

    def __init__(self, config: LoGRAConfig, targets: dict[str, SketchTarget]) -> None:
        self.config = config
        self.targets = targets
        self.index: int | None = None
        self.column_scales: dict[str, torch.Tensor] = {}
        # per target read by nn.Linear: a running mean of its squared inputs per channel
        self.input_means = {n: torch.zeros_like(t.input_sq) for n, t in targets.items() if t.input_sq is not None}
        self.input_updates = 0
        # A Aᵀ by id of the stored projection (kept with it): formed once per projection in
        # force where projections stay for several updates
        self._grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the next index's packed signs while they are drawn: r·in/8 bytes of host memory per
        # projection (fp32 ones, 32x more, are not drawn ahead)
        self._ahead: _DrawnAhead | None = None
        self._widths: dict[str, int] = {}
        for name, target in targets.items():
            self._widths.setdefault(projection_key(name, config.share_projections), target.in_features)
        # distribution='inputs': the targets whose projection is fitted (nn.Linear readers
        # only) by projection key, and once `fit` has run the fitted fp32 projections by input
        # group (`projection_key(name, True)`: q/k/v, and gate/up, read one input and share one)
        self.fitted_keys: dict[str, SketchTarget] = {}
        if config.distribution == "inputs":
            for name, target in targets.items():
                if target.modules and all(isinstance(m, nn.Linear) for m in target.modules):
                    self.fitted_keys.setdefault(projection_key(name, config.share_projections), target)
        self.fitted: dict[str, torch.Tensor] = {}
        self.fitted_index: int | None = None
        self._refit_due = False  # a window started: its projections await `fit`
        #: the targets whose projection is fitted to their inputs (empty unless ``'inputs'``)
        self.fitted_names = [n for n in targets if projection_key(n, config.share_projections) in self.fitted_keys]

    def _input_groups(self) -> dict[str, SketchTarget]:
        """Input group → a fitted target that reads it (the one whose module `fit` hooks)."""
        readers: dict[str, SketchTarget] = {}
        for key, target in self.fitted_keys.items():
            readers.setdefault(projection_key(key, True), target)
        return readers

    @property
    def needs_fit(self) -> bool:
        """Whether projections are to be fitted (``distribution='inputs'``): not fitted yet, or
        a refresh window started and awaits its own."""
        return bool(self.fitted_keys) and (not self.fitted or self._refit_due)

    def fit(self, model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], updates: int = 0,
            beta2: float = 0.0, bases: bool = False) -> tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]] | None]:
        """Fit the projection of every input group to the inputs ``model`` sees on ``batches``
        and install them for ``updates`` applied updates (0, or a refresh window's first);
        returns the number of tokens (padding excluded) they were fitted on and what `install`
        returns (``bases``: the transfer of a first moment; at a refit the old basis of a fitted
        target is ``(A_old A_oldᵀ)⁻¹ A_old``, see `install`).

        Each batch is passed as ``model(**batch)`` without gradients. Where a batch has an
        ``attention_mask`` of the inputs' leading shape, padded tokens are left out. Layers
        that read one input tensor (`SHARED_INPUT_GROUPS`: q/k/v, gate/up) share one moment
        and one fitted tensor, whether or not ``share_projections`` is set: their moments
        would be the same bits. The batches run once per share of the layer inputs whose
        moments fit in `FIT_MOMENT_BYTES` (each input's moment is the same bits whichever
        pass records it). An input group that saw fewer tokens than the rank is fitted and
        warned about: its other rows span directions no input showed.

        Raises:
            ValueError: a layer of a group reads another input than the group's first (as
                cross-attention's k/v do), or no layer saw a token.
        """
        batches = list(batches)
        index = self.index_after(updates)
        readers = self._input_groups()
        # every module of a group, the reader first: the others are checked to read its input
        members: dict[str, list[nn.Module]] = {g: [t.modules[0]] for g, t in readers.items()}
        for name in self.fitted_names:
            group = members[projection_key(name, True)]
            group.extend(m for m in self.targets[name].modules if all(m is not k for k in group))
        shares: list[list[str]] = [[]]
        held = 0
        for group, t in readers.items():
            size = InputMoment.nbytes(t.in_features, self.config.rank)
            if shares[-1] and held + size > FIT_MOMENT_BYTES:
                shares.append([])
                held = 0
            shares[-1].append(group)
            held += size
        fitted: dict[str, torch.Tensor] = {}
        tokens = 0
        scarce: dict[str, int] = {}  # input groups that saw fewer tokens than the rank
        for share in shares:
            moments = {g: InputMoment(readers[g].in_features, self.config.rank,
                                      projection_seed(self.config.seed, index, g), readers[g].weight.device)
                       for g in share}
            self._record(model, batches, {g: members[g] for g in moments}, moments)
            empty = [g for g, moment in moments.items() if not moment.tokens]
            if empty:
                raise ValueError(f"fitting projections: {len(empty)} layers saw no input tokens (first: {empty[0]}); "
                                 "do the batches run through the model's forward?")
            fitted.update({g: fitted_projection(moment.top_subspace()) for g, moment in moments.items()})
            tokens = max(tokens, *(moment.tokens for moment in moments.values()))
            scarce.update({g: moment.tokens for g, moment in moments.items() if moment.tokens < self.config.rank})
        if scarce:
            first, seen = next(iter(scarce.items()))
            warnings.warn(f"{len(scarce)} projections fitted on fewer input tokens than the rank {self.config.rank} "
                          f"(first: {first}, {seen} tokens): their other rows span directions no input showed. "
                          "Fit on more prompts (logra train fits on one update's)", stacklevel=3)
        outgoing = self.fitted
        self.fitted, self.fitted_index, self._refit_due = fitted, index, False
        if not outgoing:  # the first fit: install everything afresh (the fitted targets had none)
            self.index = None
        return tokens, self.install(updates, beta2, bases=bases, outgoing=outgoing)

    @staticmethod
    def _record(model: nn.Module, batches: list[Mapping[str, torch.Tensor]], modules: dict[str, list[nn.Module]],
                moments: dict[str, InputMoment]) -> None:
        """Run ``model`` over ``batches`` without gradients, adding the input tokens (padding
        left out) of each group's first module to its moment.

        Raises:
            ValueError: another module of a group read another input (cross-attention's
                ``k_proj``/``v_proj`` read the encoder's states): one moment cannot serve them.
        """
        mask: torch.Tensor | None = None
        seen: dict[str, list[list[tuple]]] = {}

        def recorder(group: str, i: int):
            def record(module: nn.Module, args: tuple) -> None:
                x = args[0].detach()
                if i == 0:
                    moments[group].add(_record_tokens(x, mask))
                # a fingerprint of the input's values (a module given a copy of it still matches),
                # reduced in its own dtype (no float64 copy) and compared as hex (NaN == NaN)
                fingerprint = (tuple(x.shape), float(x.sum()).hex(), float(torch.linalg.vector_norm(x)).hex())
                seen.setdefault(group, [[] for _ in modules[group]])[i].append(fingerprint)
            return record

        handles = [m.register_forward_pre_hook(recorder(g, i)) for g, ms in modules.items() for i, m in enumerate(ms)]
        try:
            with torch.no_grad():
                for batch in batches:
                    m = batch.get("attention_mask")
                    mask = m.bool() if m is not None else None
                    seen.clear()
                    model(**batch)
                    for group, inputs in seen.items():
                        # a layer not called in this forward (a KV-shared layer with a cache) is no evidence
                        other = next((i for i in range(1, len(inputs)) if inputs[i] and inputs[i] != inputs[0]),
                                     None)
                        if other is not None:
                            names = {id(m): n for n, m in model.named_modules()}
                            raise ValueError(
                                f"fitting projections: {names.get(id(modules[group][other]))} reads another input "
                                f"than {names.get(id(modules[group][0]))} (as "
                                "cross-attention's k_proj/v_proj read the encoder's states); "
                                "distribution='inputs' fits one projection per input that q/k/v or gate/up share. "
                                "Use a seeded distribution ('rademacher', the paper's) for this model")
        finally:
            for h in handles:
                h.remove()

    def index_after(self, updates: int) -> int:
        """The projection index in force after ``updates`` applied updates."""
        return projection_index(updates, self.config.refresh, self.config.refresh_every)

    def install(self, updates: int, beta2: float, scales: dict[str, torch.Tensor] | None = None,
                bases: bool = False, outgoing: Mapping[str, torch.Tensor] | None = None,
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Put the projections in force after ``updates`` updates on every target.

        ``scales``: the column scales of the new projections (default: from the input
        statistics, with decay ``beta2``). Returns None if the projections in force do not
        change, or if a refresh window of fitted projections starts (its fitted targets are
        left without a projection until `fit`); else, with ``bases``, per target
        ``(A_old·diag(c_old)⁻¹, A_new·diag(c_new))`` (a first moment's transfer needs them),
        without, an empty dict. A fitted target's old basis is ``(A_old A_oldᵀ)⁻¹ A_old =
        (r/in)·A_old`` instead (from ``outgoing``, the fitted projections `fit` replaced): its
        rows are orthogonal, so the transfer ``m·(A_old A_oldᵀ)⁻¹A_old·A_newᵀ`` re-expresses
        the gradient estimate ``m`` stands for exactly, where two fitted windows' subspaces
        overlap most; seeded projections keep ``m·A_old·A_newᵀ``, that transfer's expectation.
        """
        index = self.index_after(updates)
        if index == self.index:
            self._draw_ahead(updates)
            return None
        if self.fitted and index != self.fitted_index:
            for name in self.fitted_names:
                self.targets[name].projection = None
            self._refit_due = True
            return None
        cfg = self.config
        scales = self.next_column_scales(beta2) if scales is None else scales
        ahead, self._ahead = self._ahead, None
        host: dict[str, torch.Tensor] = {}
        if ahead is not None and ahead.serves(index):
            host = {key: bits for job in ahead.jobs for key, bits in job.result().items()}
        elif ahead is not None:
            ahead.cancel()
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        drawn: dict[str, torch.Tensor] = {}  # by projection key: shared members share the tensor
        for name, target in self.targets.items():
            key = projection_key(name, cfg.share_projections)
            old = target.projection if bases else None  # rebuilt only where it is used
            if key in self.fitted_keys:  # None until fitted: a sketched forward refuses it
                drawn[key] = self.fitted.get(projection_key(key, True))
                if bases:
                    old = outgoing[projection_key(key, True)] * (cfg.rank / target.in_features)
            elif key in host:
                drawn[key] = host.pop(key).to(target.weight.device)
            elif key not in drawn:
                seed = projection_seed(cfg.seed, index, key)
                drawn[key] = _stored_projection(cfg.rank, target.in_features, seed, seeded_distribution(cfg),
                                                target.weight.device)
            stored = drawn[key]
            if name in scales:
                stored = materialize(stored, target.in_features) * scales[name]
            target.projection = stored
            if bases:
                if name in self.column_scales:
                    old = old / self.column_scales[name].square()
                out[name] = (old, target.projection)
        self.column_scales = scales
        self.index = index
        self._grams = {}
        self._draw_ahead(updates)
        return out

    def _draw_ahead(self, updates: int) -> None:
        """Start drawing the Rademacher projections in force after ``updates + 1`` updates if
        they differ from those in force (and are not being drawn already)."""
        following = self.index_after(updates + 1)
        if self.config.distribution != "rademacher" or following == self.index:
            return
        if self._ahead is not None:
            if self._ahead.serves(following):
                return
            self._ahead.cancel()
        self._ahead = _draw_ahead(self.config, following, self._widths)

    def gram(self, name: str) -> torch.Tensor:
        """``A Aᵀ`` (``[r, r]``) of target ``name``'s projection in force. Kept while the
        projections stay (fixed, or refresh windows); with a refresh after every update
        formed anew each time, so that no two exist at once."""
        target = self.targets[name]
        if self.config.refresh and self.config.refresh_every == 1:
            a = target.projection
            return a @ a.T
        source = target.stored_projection
        entry = self._grams.get(id(source))
        if entry is None or entry[0] is not source:
            a = target.projection
            entry = self._grams[id(source)] = (source, a @ a.T)
        return entry[1]

    def fold_input_statistics(self, beta2: float) -> None:
        """Fold this update's mean squared inputs into the running means (decay ``beta2``)."""
        for name, mean in self.input_means.items():
            target = self.targets[name]
            count = float(target.input_count)
            if count:
                mean.mul_(beta2).add_(target.input_sq, alpha=(1.0 - beta2) / count)
        self.input_updates += 1  # the sums are zeroed with the sketches

    def next_column_scales(self, beta2: float) -> dict[str, torch.Tensor]:
        """``c = (C / mean(C) + 0.1)^(-1/4)`` per target from the bias-corrected running means."""
        if not self.input_updates:
            return {}
        correction = 1.0 - beta2 ** self.input_updates
        scales = {}
        for name, mean in self.input_means.items():
            c = mean / correction
            # the floor keeps silent channels from amplifying the projection's noise without bound
            scales[name] = (c / c.mean().clamp_min(torch.finfo(torch.float32).tiny)).add_(0.1).pow_(-0.25)
        return scales

    def memory(self) -> list[torch.Tensor]:
        """The stored projections (shared ones once), input statistics, column scales, Grams."""
        shared = {id(t.stored_projection): t.stored_projection for t in self.targets.values()
                  if t.stored_projection is not None}
        return [*shared.values(), *self.input_means.values(), *self.column_scales.values(),
                *(gram for _, gram in self._grams.values())]

    def state_dict(self) -> dict[str, Any]:
        """The input statistics, the column scales in force and the fitted projections
        (seeded projections are rebuilt)."""
        return {
            "input_means": {n: v.clone() for n, v in self.input_means.items()},
            "input_updates": self.input_updates,
            "column_scales": {n: v.clone() for n, v in self.column_scales.items()},
            "fitted_projections": {k: v.clone() for k, v in self.fitted.items()},
            "fitted_index": self.fitted_index,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` if `load_state` would refuse ``state`` (nothing is changed)."""
        if set(state.get("input_means", {})) != set(self.input_means):
            raise ValueError("optimizer state and this optimizer disagree on column_scale (input statistics)")
        for name, c in state.get("column_scales", {}).items():
            if name not in self.targets or c.shape != (self.targets[name].in_features,):
                raise ValueError(f"optimizer state's column scale for {name} does not fit this model")
        fitted, groups = state.get("fitted_projections", {}), self._input_groups()
        if fitted and set(fitted) != set(groups):
            raise ValueError(f"optimizer state's fitted projections ({len(fitted)}) are not those of this "
                             f"model's inputs ({len(groups)})")
        for group, a in fitted.items():
            if a.shape != (self.config.rank, groups[group].in_features):
                raise ValueError(f"optimizer state's fitted projection for {group} is {tuple(a.shape)}: it does "
                                 "not fit this model")

    def load_state(self, state: dict[str, Any], updates: int, beta2: float) -> None:
        """Restore `state_dict`'s entries and install the saved projections for ``updates``."""
        for name, mean in state.get("input_means", {}).items():
            self.input_means[name].copy_(mean)
        self.input_updates = state.get("input_updates", 0)
        # the saved scales, not fresh ones: they define the projection in force
        scales = {n: c.to(self.targets[n].weight.device) for n, c in state.get("column_scales", {}).items()}
        groups = self._input_groups()
        self.fitted = {g: a.to(groups[g].weight.device) for g, a in state.get("fitted_projections", {}).items()}
        # states from before refresh windows of fitted projections had the one of index 0
        self.fitted_index = state.get("fitted_index", 0) if self.fitted else None
        self.index, self._refit_due = None, False
        if self.fitted and self.fitted_index != self.index_after(updates):
            # saved between a window's last update and its fit: the last window's projections
            # in force (a first moment's transfer starts from them), the refit due
            self.install(self.fitted_index, beta2, scales=scales)
        self.install(updates, beta2, scales=scales)
