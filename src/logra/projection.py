"""Seeded random projections: any process rebuilds the same ``A`` without receiving it.

A projection is ``[r, in]`` with ``E[AᵀA] = I``, so ``S A = G AᵀA`` is an unbiased
estimate of the dense gradient ``G`` from its sketch ``S = G Aᵀ``. Matrices are drawn on
the CPU with a `torch.Generator`, which gives the same bits on every machine, and only
then moved to the weight's device.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re

import torch

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
    gen = torch.Generator(device="cpu").manual_seed(seed)
    signs = torch.randint(0, 2, (rank, in_features), generator=gen, dtype=torch.int8).mul_(2).sub_(1)
    return signs.to(device) if device is not None else signs


def signs_to_projection(signs: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """fp32 projection ``signs / √rank`` from `rademacher_signs` (bitwise `make_projection`'s);
    ``rank`` defaults to the rows of ``signs``."""
    return signs.to(torch.float32).mul_(1.0 / math.sqrt(signs.shape[0] if rank is None else rank))


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """``[rank, in]`` ±1 signs as bits, ``[rank, ⌈in/8⌉]`` uint8 (bit ``j`` of byte ``k`` is 1
    where column ``8k + j`` is +1): an eighth of int8, a thirty-second of fp32."""
    rank, width = signs.shape
    bits = torch.zeros(rank, -(-width // 8) * 8, dtype=torch.uint8, device=signs.device)
    bits[:, :width] = signs > 0
    shifts = torch.arange(8, dtype=torch.uint8, device=signs.device)
    return (bits.view(rank, -1, 8) << shifts).sum(dim=-1, dtype=torch.uint8)


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
