"""Gradient sketches: the backward pass of a target produces ``S = G Aᵀ``, never ``G``.

A target layer ``Y = X Wᵀ`` is re-routed so that its forward pass saves only
``P = X Aᵀ`` (``[N, r]``) instead of ``X`` (``[N, in]``), and its backward pass adds
``Hᵀ P`` into a fp32 sketch ``[out, r]`` while passing ``dX = H W`` through unchanged.
The weight itself has ``requires_grad=False``: autograd keeps no dense gradient and no
full input for it. All sketches are row blocks of one ``[Σ out, r]`` buffer, so zeroing,
clipping and all-reduce are single operations.

Embeddings (``non_target='sketch'``) work the same way: their gradient is a scatter of
``H`` rows, so their sketch is a scatter-add of ``H Aᵀ`` rows. Tied input/output
embeddings are one target with one projection and one sketch.

Which weights are targets (`find_targets`): the ``nn.Linear`` layers (subclasses included)
whose names match ``target_modules``; the entry `DECODER_LINEAR` selects every one inside
the model's decoder blocks, fused (``qkv_proj``, ``query_key_value``) or not. `SketchSet`
logs once what it sketches and which 2-D weights it leaves to ``non_target``
(`describe_targets`).
"""

from __future__ import annotations

import logging
import re
import types
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from .projection import materialize, projection_key, stable_name

_REGEX_CHARS = set("^$*+?[](){}|\\")

#: The ``target_modules`` entry selecting every 2-D ``nn.Linear`` weight (subclasses
#: included, fused or not) inside the model's decoder blocks (`decoder_blocks`). On Llama /
#: Qwen / Mistral models it selects exactly ``q/k/v/o_proj, gate/up/down_proj``, in the
#: same order. A hyphen cannot occur in a module name, so it never matches one by name.
DECODER_LINEAR = "decoder-linear"

LOG = logging.getLogger(__name__)


@dataclass(eq=False)
class SketchTarget:
    """One sketched weight ``[out, in]`` and everything the method keeps for it.

    Attributes:
        name: stable parameter name (wrapper prefixes removed); keys seeds and deltas.
        weight: the parameter (``requires_grad=False`` while sketched).
        sketch: ``[out, r]`` fp32 view into the shared sketch buffer.
        stored_projection: the projection in force as stored (set by the optimizer): an
            fp32 ``[r, in]`` matrix, or the signs of a Rademacher projection packed as bits
            (uint8 ``[r, ⌈in/8⌉]``, 1 bit per entry instead of 32; `projection` rebuilds the
            fp32 matrix when it is used).
        modules: the modules that read this weight (two for tied embeddings).
    """

    name: str
    weight: nn.Parameter
    sketch: torch.Tensor
    stored_projection: torch.Tensor | None = None
    modules: list[nn.Module] = field(default_factory=list)
    # Σ over tokens of x² per input channel ([in]) and the token count ([1]), views into
    # the shared buffer, while input statistics are collected; None otherwise.
    input_sq: torch.Tensor | None = None
    input_count: torch.Tensor | None = None
    # With shared projections: the cache of ``X Aᵀ`` this target's input group shares.
    shared_input: _SharedInput | None = None
    # (eps, D, decay) while a forward-mode KL probe perturbs this target.
    _probe: tuple[torch.Tensor, torch.Tensor, float] | None = None
    # A leaf that requires grad, so autograd runs our backward even when nothing
    # upstream of the layer is trainable (frozen embeddings).
    _anchor: torch.Tensor = field(default_factory=lambda: torch.zeros((), requires_grad=True))

    @property
    def projection(self) -> torch.Tensor | None:
        """The ``[r, in]`` fp32 projection in force (a fresh tensor when stored as bits)."""
        a = self.stored_projection
        return a if a is None else materialize(a, self.in_features)

    @projection.setter
    def projection(self, value: torch.Tensor | None) -> None:
        self.stored_projection = value

    @property
    def out_features(self) -> int:
        """Rows of the weight (``out``; ``vocab`` for an embedding)."""
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        """Columns of the weight (``in``; the hidden size for an embedding)."""
        return self.weight.shape[1]


class _SharedInput:
    """``P = X Aᵀ`` of the last input seen by a group of targets that read the same tensor
    with the same projection (q/k/v, gate/up): computed by the first member, reused by the
    others, dropped after the last (so it never outlives the forward pass)."""

    def __init__(self, members: int) -> None:
        self.members = members
        self._key: tuple[weakref.ref, int] | None = None  # (input, id of the stored projection)
        self._p: torch.Tensor | None = None
        self._uses = 0

    def project(self, x: torch.Tensor, target: SketchTarget) -> torch.Tensor:
        stored = id(target.stored_projection)
        if self._key is not None and self._key[0]() is x and self._key[1] == stored:
            p = self._p
        else:
            p = F.linear(x, target.projection.to(x.dtype))
            self._key, self._p, self._uses = (weakref.ref(x), stored), p, 0
        self._uses += 1
        if self._uses >= self.members:
            self._key = self._p = None
        return p


class _SketchedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, weight, target):
        if target.input_sq is not None:
            flat = x.detach().reshape(-1, x.shape[-1])
            # a fused fp32 reduction: no [N, in] temporary
            target.input_sq.add_(torch.linalg.vector_norm(flat, dim=0, dtype=torch.float32).square())
            target.input_count.add_(flat.shape[0])
        y = F.linear(x, weight)
        with record_function("logra.project"):  # named ranges: `logra bench memory` times them
            if target.shared_input is not None:
                p = target.shared_input.project(x, target)
            else:
                p = F.linear(x, target.projection.to(x.dtype))
        ctx.save_for_backward(p, weight)
        ctx.target = target
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, h):
        p, weight = ctx.saved_tensors
        sketch = ctx.target.sketch
        with record_function("logra.sketch"):
            # fp32 accumulation: sketches of several micro-batches are summed in place.
            sketch.addmm_(h.reshape(-1, h.shape[-1]).T.float(), p.reshape(-1, p.shape[-1]).float())
        dx = None
        if ctx.needs_input_grad[0]:
            dx = h.matmul(weight.to(h.dtype)).to(ctx.x_dtype)
        return dx, None, None, None


class _SketchedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, anchor, weight, target, padding_idx):
        ctx.save_for_backward(ids)
        ctx.target = target
        ctx.projection = target.projection
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, h):
        (ids,) = ctx.saved_tensors
        with record_function("logra.sketch"):
            hp = h.reshape(-1, h.shape[-1]).float() @ ctx.projection.T
            ids = ids.reshape(-1)
            if ctx.padding_idx is not None:
                # The dense gradient of the padding row is zero by definition.
                keep = ids != ctx.padding_idx
                ids, hp = ids[keep], hp[keep]
            ctx.target.sketch.index_add_(0, ids, hp)
        return None, None, None, None, None


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # module.weight, not t.weight: wrappers such as FSDP swap in the gathered weight.
    t: SketchTarget = module._logra_target
    w = module.weight
    if t.stored_projection is None and (t._probe is not None or torch.is_grad_enabled()):
        raise RuntimeError(f"LoGRA target {t.name} has no projection yet: with distribution='inputs', call "
                           "LoGRAOptimizer.fit_projections(batches) before the first forward with gradients "
                           "(and, with refresh windows, before the first of each window)")
    if t._probe is not None:
        eps, d, decay = t._probe
        y = F.linear(x, w)
        # d/dε of X W(ε)ᵀ with W(ε) = (1 - ε·decay) W - ε D A.
        change = F.linear(F.linear(x, t.projection.to(x.dtype)), d.to(x.dtype))
        if decay:
            change = change + decay * y
        y = y - eps * change
    elif torch.is_grad_enabled():
        y = _SketchedLinear.apply(x, t._anchor, w, t)
    else:
        return F.linear(x, w, module.bias)
    return y if module.bias is None else y + module.bias.to(y.dtype)


def _embedding_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    t: SketchTarget = module._logra_target
    w = module.weight
    if t._probe is not None:
        eps, d, decay = t._probe
        y = F.embedding(ids, w, module.padding_idx)
        change = F.embedding(ids, d) @ t.projection
        if decay:
            change = change + decay * y
        return y - eps * change.to(y.dtype)
    if torch.is_grad_enabled():
        return _SketchedEmbedding.apply(ids, t._anchor, w, t, module.padding_idx)
    return F.embedding(ids, w, module.padding_idx)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        if set(pattern) & _REGEX_CHARS:
            if re.search(pattern, name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def decoder_blocks(model: nn.Module) -> list[str]:
    """Module names of the model's decoder blocks, in order.

    A block is an item of an outermost ``nn.ModuleList`` whose items all hold submodules:
    ``model.layers.<i>`` (Llama, Qwen2, Phi-3), ``model.decoder.layers.<i>`` (OPT),
    ``transformer.h.<i>`` (Falcon, GPT-2). Lists of leaf layers (per-layer projections kept
    outside the blocks) and lists nested inside a block (experts) are not blocks.
    """
    lists: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer in lists):
            continue
        if isinstance(module, nn.ModuleList) and len(module) and all(
                next(item.children(), None) is not None for item in module):
            lists.append(name)
    return [f"{name}.{i}" if name else str(i) for name in lists for i in range(len(model.get_submodule(name)))]


def _check_linear(module_name: str, module: nn.Linear) -> None:
    """Refuse an ``nn.Linear`` (subclass) whose weight is not a floating-point ``[out, in]`` matrix
    (packed quantized weights): its sketch and update would be meaningless."""
    w = module.weight
    if not (w.is_floating_point() and tuple(w.shape) == (module.out_features, module.in_features)):
        raise ValueError(
            f"target {module_name!r} is a {type(module).__name__} whose weight is {w.dtype} {list(w.shape)}, not a "
            f"floating-point [out_features={module.out_features}, in_features={module.in_features}] matrix "
            "(a quantized layer?); LoGRA sketches full-precision weights. Leave it out of target_modules.")


def find_targets(
    model: nn.Module, patterns: tuple[str, ...], embeddings: bool = False
) -> dict[str, list[tuple[str, nn.Module]]]:
    """Map each target weight's stable name to the ``(module name, module)`` pairs using it.

    Targets are ``nn.Linear`` layers (subclasses included: Falcon's ``FalconLinear``) whose
    stable name matches one of ``patterns`` (a suffix, a regular expression, or
    `DECODER_LINEAR` for every one inside `decoder_blocks`), in ``model.named_modules()``
    order, then the embeddings if ``embeddings``.

    Raises:
        ValueError: nothing matches (the message lists the model's ``nn.Linear`` layer
            names), `DECODER_LINEAR` finds no decoder blocks, a matched module is not an
            ``nn.Linear`` (e.g. GPT-2's ``Conv1D``) or its weight is not a floating-point
            ``[out, in]`` matrix.
    """
    found: dict[int, tuple[str, list[tuple[str, nn.Module]]]] = {}
    param_names = {id(p): stable_name(n) for n, p in model.named_parameters(remove_duplicate=True)}
    by_name = tuple(p for p in patterns if p != DECODER_LINEAR)
    blocks: tuple[str, ...] = ()
    if DECODER_LINEAR in patterns:
        blocks = tuple(decoder_blocks(model))
        if not blocks:
            raise ValueError(
                f"target_modules entry {DECODER_LINEAR!r}: {type(model).__name__} has no decoder blocks (an "
                "nn.ModuleList of layers); name the layers to sketch in target_modules instead")

    def add(module_name: str, module: nn.Module) -> None:
        key = id(module.weight)
        entry = found.setdefault(key, (param_names[key], []))
        if all(m is not module for _, m in entry[1]):
            entry[1].append((module_name, module))

    for module_name, module in model.named_modules():
        name = stable_name(module_name)
        if not name:
            continue
        in_block = isinstance(module, nn.Linear) and any(
            module_name == b or module_name.startswith(b + ".") for b in blocks)
        if not in_block and not _matches(name, by_name):
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"target {module_name!r} is a {type(module).__name__}, not an nn.Linear; LoGRA "
                "sketches nn.Linear weights (and embeddings with non_target='sketch'). Narrow "
                "target_modules, or convert the layer (GPT-2's Conv1D stores Wᵀ) to nn.Linear."
            )
        _check_linear(module_name, module)
        add(module_name, module)
    if not found:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        others = sorted({type(m).__name__ for m in model.modules()
                         if len(list(m.children())) == 0 and not isinstance(m, nn.Linear)})
        raise ValueError(
            f"no module matches target_modules={patterns}. nn.Linear layers (subclasses included) in this model "
            f"end in: {linear or 'none'}; other leaf module types: {others}"
        )
    if embeddings:
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            module = getattr(model, getter, lambda: None)()
            if module is None:
                continue
            if not isinstance(module, (nn.Embedding, nn.Linear)):
                raise ValueError(f"{getter}() returned a {type(module).__name__}; cannot sketch it")
            if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
                raise ValueError("embeddings with max_norm or scale_grad_by_freq cannot be sketched")
            module_name = next(n for n, m in model.named_modules() if m is module)
            add(module_name, module)
    return {name: modules for name, modules in found.values()}


def target_module_names(model: nn.Module, patterns: tuple[str, ...]) -> list[str]:
    """The full names of the modules `find_targets` selects, in order: what peft's
    ``LoraConfig(target_modules=...)`` needs to adapt exactly LoGRA's layers (peft reads list
    entries as name suffixes and knows neither regular expressions nor `DECODER_LINEAR`)."""
    return [name for modules in find_targets(model, patterns).values() for name, _ in modules]


_NON_TARGET_FATE = {"freeze": "frozen", "adamw": "trained by AdamW", "sketch": "trained by AdamW"}


def describe_targets(model: nn.Module, targets: list[str] | dict[str, object], non_target: str | None = None) -> str:
    """One line: the weights sketched and the 2-D weights left to ``non_target``.

    Layer indices are folded (``model.layers.*.mlp.down_proj.weight ×28``), so the line
    stays short for deep models; parameters that are not 2-D (norms, biases) are counted.
    """
    chosen = set(targets)
    fold = re.compile(r"(?<=\.)\d+(?=\.)")

    def folded(names: list[str]) -> str:
        counts: dict[str, int] = {}
        for n in names:
            key = fold.sub("*", n)
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(k if c == 1 else f"{k} ×{c}" for k, c in counts.items()) or "none"

    params = [(stable_name(n), p) for n, p in model.named_parameters()]
    rest_2d = [n for n, p in params if n not in chosen and p.dim() == 2]
    other = sum(1 for n, p in params if n not in chosen and p.dim() != 2)
    mode = f"non_target={non_target!r} ({_NON_TARGET_FATE[non_target]})" if non_target else "non_target"
    return (f"LoGRA sketches {len(chosen)} weights of {type(model).__name__}: {folded(list(targets))}; left to "
            f"{mode}: {len(rest_2d)} other 2-D weights ({folded(rest_2d)}) and {other} parameters that are not 2-D "
            "(norms, biases)")


def check_materialized(model: nn.Module) -> None:
    """Refuse a model whose parameters or buffers are on the ``meta`` device (shapes, no values).

    Raises:
        ValueError: naming the first such tensor.
    """
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"{kind} {stable_name(name)} is on the meta device (a shape without values): load or "
                    "materialize the weights (e.g. model.to_empty(device=...) then load_state_dict) before "
                    "building the LoGRA optimizer")


def _check_forward(module_name: str, module: nn.Linear) -> None:
    """A subclass of ``nn.Linear`` that overrides ``forward`` must still compute ``x Wᵀ + b``:
    the sketch replaces its forward with exactly that, so anything else would change the model."""
    w = module.weight
    if type(module).forward is nn.Linear.forward or w.is_meta or type(w) not in (torch.Tensor, nn.Parameter):
        return  # plain forward; or no local values to run it on (sharded DTensor)
    with torch.no_grad():  # a fixed input, no RNG draw: the run's random stream is untouched
        x = torch.linspace(-1, 1, 2 * w.shape[1], device=w.device).reshape(2, -1).to(w.dtype)
        theirs, ours = module.forward(x), F.linear(x, w, module.bias)
    low = w.dtype in (torch.bfloat16, torch.float16)
    scale = float(ours.abs().max().float()) + 1e-12
    if theirs.shape != ours.shape or not torch.allclose(theirs.float(), ours.float(), rtol=1e-2 if low else 1e-4,
                                                        atol=(1e-2 if low else 1e-5) * scale):
        raise ValueError(
            f"target {module_name!r} is a {type(module).__name__} whose forward is not x Wᵀ + b; sketching it would "
            "replace that forward and change the model. Leave it out of target_modules.")


class SketchSet:
    """The sketched targets of one model and their shared fp32 sketch buffer.

    Installing re-routes each target module's forward (see the module docstring) and
    sets ``requires_grad=False`` on its weight; `remove` undoes both. With
    ``input_statistics``, every target read by an ``nn.Linear`` also sums the squares of
    its inputs per channel and counts its tokens, in trailing rows of the same buffer, so
    one all-reduce of `buffer` still carries everything a data-parallel update needs.

    Construction refuses, before changing anything, a model on the ``meta`` device
    (`check_materialized`) and an ``nn.Linear`` subclass whose forward is not ``x Wᵀ + b``;
    it then logs `describe` once (logger ``logra.sketch``, level INFO). ``non_target`` (the
    ``LoGRAConfig`` option) only words that line.
    """

    def __init__(self, model: nn.Module, patterns: tuple[str, ...], rank: int, embeddings: bool = False,
                 input_statistics: bool = False, share_inputs: bool = False, non_target: str | None = None) -> None:
        check_materialized(model)
        groups = find_targets(model, patterns, embeddings)
        for modules in groups.values():
            for module_name, module in modules:
                if isinstance(module, nn.Linear):
                    _check_forward(module_name, module)
        weights = {name: modules[0][1].weight for name, modules in groups.items()}
        devices = {w.device for w in weights.values()}
        if len(devices) != 1:
            raise ValueError(f"sketched weights must share one device, found {sorted(map(str, devices))}")
        for name, w in weights.items():
            if w.dim() != 2:
                raise ValueError(f"target {name} has a {w.dim()}-D weight; only 2-D weights are sketched")
            if rank > w.shape[1]:
                raise ValueError(f"rank {rank} exceeds the input size {w.shape[1]} of target {name}")
        kept = sum(rank * (w.shape[0] + w.shape[1]) for w in weights.values())
        if kept >= sum(w.numel() for w in weights.values()):
            warnings.warn(
                f"rank {rank}: the sketches and projections ({kept:,} values) are as large as the dense gradients "
                "they replace; choose a rank well below the layers' input sizes to save memory",
                stacklevel=3,
            )
        total = sum(w.shape[0] for w in weights.values())
        readers = {n for n, modules in groups.items() if any(isinstance(m, nn.Linear) for _, m in modules)}
        stats = sum(weights[n].shape[1] + 1 for n in readers) if input_statistics else 0
        self.rank = rank
        #: ``[Σ out (+ statistics rows), r]``: every sketch, then the input statistics if any.
        self.buffer = torch.zeros(total + -(-stats // rank), rank, dtype=torch.float32, device=devices.pop())
        #: the ``[Σ out, r]`` rows holding the sketches
        self.sketch_rows = self.buffer[:total]
        self.targets: dict[str, SketchTarget] = {}
        stat_flat, stat_offset = self.buffer[total:].view(-1), 0
        groups_of: dict[str, list[SketchTarget]] = {}
        offset = 0
        for name, modules in groups.items():
            w = weights[name]
            view = self.buffer[offset: offset + w.shape[0]]
            offset += w.shape[0]
            target = SketchTarget(name, w, view, modules=[m for _, m in modules])
            if stats and name in readers:
                n_in = w.shape[1]
                target.input_sq = stat_flat[stat_offset: stat_offset + n_in]
                target.input_count = stat_flat[stat_offset + n_in: stat_offset + n_in + 1]
                stat_offset += n_in + 1
            self.targets[name] = target
            if share_inputs and name in readers and (key := projection_key(name, True)) != name:
                groups_of.setdefault(key, []).append(target)
            w.requires_grad_(False)
            w.grad = None
            for module in target.modules:
                forward = _embedding_forward if isinstance(module, nn.Embedding) else _linear_forward
                module._logra_target = target
                module.forward = types.MethodType(forward, module)
        for members in groups_of.values():
            if len({t.in_features for t in members}) != 1:
                raise ValueError(f"shared projections: {[t.name for t in members]} have different input sizes")
            cache = _SharedInput(len(members))
            for t in members:
                t.shared_input = cache
        self._description = describe_targets(model, list(self.targets), non_target)
        LOG.info(self._description)

    def describe(self) -> str:
        """What is sketched and which 2-D weights are left to ``non_target`` (logged at construction)."""
        return self._description

    def remove(self) -> None:
        """Restore the original forwards and make the weights trainable again."""
        for target in self.targets.values():
            target.weight.requires_grad_(True)
            for module in target.modules:
                del module.forward
                del module._logra_target

    def zero_(self) -> None:
        """Zero every sketch and input statistic (one fill of the shared buffer)."""
        self.buffer.zero_()

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per target, its rows of a ``[Σ out, r]`` buffer laid out like the sketch buffer
        (optimizer state kept in sketch coordinates)."""
        out, offset = {}, 0
        for name, target in self.targets.items():
            rows = target.sketch.shape[0]  # fixed at install (a row-sharded weight may be swapped in)
            out[name] = buffer[offset: offset + rows]
            offset += rows
        return out

    @contextmanager
    def probing(self, eps: torch.Tensor, directions: dict[str, torch.Tensor], decay: float) -> Iterator[None]:
        """Within the block, every target computes ``W(ε) = (1 - ε·decay) W - ε D A``.

        With a forward-mode dual ``eps`` (primal 0, tangent 1) the model's outputs are
        unchanged and their tangents are the directional derivative along the proposal.
        """
        try:
            for name, target in self.targets.items():
                target._probe = (eps, directions[name], decay)
            yield
        finally:
            for target in self.targets.values():
                target._probe = None
