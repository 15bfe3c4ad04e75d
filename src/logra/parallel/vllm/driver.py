"""Driver side of LoGRA sync into vLLM: `make_engine` and `VLLMPolicy` (wraps ``LLM.collective_rpc``).

```python
llm = make_engine("policy_dir", dtype="float32")           # an in-process vLLM engine + the extension
engine = VLLMPolicy(llm, config, model=model, optimizer=opt)  # configure
engine.verify()                                               # the engine holds the trainer's weights
delta = opt.apply(opt.propose())
engine.apply(delta)        # only U + seeds (+ dense non-target tensors) cross into the engine
rows = engine.generate(prompt_ids, max_new_tokens=32, eos_token_id=eos, seed=0)
```
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from ..._optional import require
from ...config import LoGRAConfig
from ...delta import PolicyDelta, weights_checksum
from ...errors import ChecksumMismatchError, SyncError
from ...projection import stable_name
from ..wire import encode_tensors

#: what ``worker_extension_cls`` must name
EXTENSION = "logra.parallel.vllm.LoGRAWorkerExtension"


def make_engine(model_dir: str, dtype: str = "float32", seed: int = 0, max_model_len: int | None = None,
                in_process: bool = True, **kwargs: Any) -> Any:
    """A vLLM ``LLM`` over a saved HF policy folder with `LoGRAWorkerExtension` loaded.

    Token-id prompts only (``skip_tokenizer_init``): the trainer tokenizes. Log-probabilities
    are those of the tempered distribution (``logprobs_mode='processed_logprobs'``), as the
    trainer's rollouts record them.

    Args:
        in_process: run the engine core and its one worker in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend='uni'``): starts
            in seconds on a CPU. Otherwise vLLM's default multi-process engine (deltas travel as
            bytes, which it passes intact). A script that starts a multi-process engine needs an
            ``if __name__ == "__main__":`` guard.
        kwargs: passed on to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``).
    """
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs.setdefault("distributed_executor_backend", "uni")
    vllm = require("vllm")
    kwargs.setdefault("enforce_eager", True)
    return track_process_group(lambda: vllm.LLM(
        model=str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len, skip_tokenizer_init=True,
        worker_extension_cls=EXTENSION, logprobs_mode="processed_logprobs", **kwargs))


_OWNS_DIST = "_logra_owns_process_group"


def track_process_group(build: Any) -> Any:
    """``build()`` an ``LLM``, noting whether its in-process worker created this process's
    default torch.distributed group (vLLM's ``uni`` executor does), for `shutdown_engine`."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    llm = build()
    setattr(llm, _OWNS_DIST, not before and dist.is_available() and dist.is_initialized())
    return llm


def shutdown_engine(llm: Any) -> None:
    """Stop an engine; if it created this process's torch.distributed group, destroy that too.

    An in-process engine leaves vLLM's (world-size-1) process group behind after its core
    shuts down, and code that later checks ``torch.distributed.is_initialized()`` (data
    parallelism, rollout workers, HF's TrainingArguments) would take it for its own. Close
    the engine that created the group last when several share one process.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    if getattr(llm, _OWNS_DIST, False):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        setattr(llm, _OWNS_DIST, False)


class VLLMPolicy:
    """A vLLM engine kept equal to a LoGRA trainer's policy by verified deltas.

    Args:
        llm: a ``vllm.LLM`` started with ``worker_extension_cls=EXTENSION`` (see `make_engine`).
        config: the trainer's `LoGRAConfig`.
        step: the policy step the engine's weights hold now (0: the saved initial policy).
        model: the trainer's HF model (optional). With it, `publish` sends the densely
            trained non-target tensors with each delta and attaches the trainer's checksum
            when the engine holds the trainer's dtype; `verify` compares the two.
        optimizer: the trainer's `LoGRAOptimizer` (its ``dense_parameters()`` travel densely,
            and its fitted projections with `load_from_model`).
        verify_every: attach the trainer's checksum to every k-th delta (0 = never).

    Call `verify` once to check that the engine starts from the trainer's weights, or
    `load_from_model` to make it so (after a resume).
    """

    def __init__(self, llm: Any, config: LoGRAConfig, step: int = 0, model: nn.Module | None = None,
                 optimizer: Any = None, verify_every: int = 1) -> None:
        self.llm = llm
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.verify_every = verify_every
        ids = {id(p) for p in optimizer.dense_parameters()} if optimizer is not None else set()
        self.dense_names = [stable_name(n) for n, p in (model.named_parameters() if model is not None else ())
                            if id(p) in ids]
        self._target_names = self._targets() if model is not None else []
        self._call("logra_configure", json.dumps(config.to_dict()), step)
        self.info = json.loads(self._call("logra_info"))
        self.dtype: torch.dtype = getattr(torch, self.info["dtype"])

    def verify(self) -> str:
        """Check that the engine holds the trainer model's target weights; their checksum.

        Raises:
            ValueError: no ``model``, or the engine holds another dtype (nothing to compare bitwise).
            ChecksumMismatchError: the engine's weights differ from the trainer's.
        """
        if not self.comparable:
            raise ValueError(f"the engine holds {self.dtype}, the trainer's targets another dtype (or no model was "
                             "given): its weights cannot be compared bitwise")
        got, want = self.checksum(), self.trainer_checksum()
        if got != want:
            raise ChecksumMismatchError(f"the engine does not hold the trainer's weights: engine {got}, trainer {want}")
        return got

    def load_from_model(self, step: int) -> str:
        """Full resync from the trainer ``model``'s current weights (sent as safetensors bytes) at
        ``step``, with the optimizer's fitted projections (``distribution='inputs'``), if any.

        Raises:
            ValueError: built without ``model``, or without ``optimizer`` for ``distribution='inputs'``.
        """
        if self.model is None:
            raise ValueError("VLLMPolicy was built without the trainer's model")
        if self.optimizer is None and self.config.distribution == "inputs":
            raise ValueError("VLLMPolicy was built without the trainer's optimizer: a full resync of a run with "
                             "fitted projections (distribution='inputs') must send them (resync(..., fitted=...))")
        state = {stable_name(n): p.detach().to(self.dtype).contiguous().cpu() for n, p in self.model.named_parameters()}
        fitted = self.optimizer.fitted_projections() if self.optimizer is not None else None
        return self.resync(st_save(state), step, fitted)

    def _call(self, method: str, *args: Any) -> str:
        """One ``collective_rpc``; every worker must answer the same."""
        results = self.llm.collective_rpc(method, args=args)
        if len(set(results)) != 1:
            raise SyncError(f"{method}: vLLM workers disagree: {results}")
        return results[0]

    def _targets(self) -> list[str]:
        from ...sketch import find_targets

        return sorted(find_targets(self.model, self.config.target_modules, self.config.non_target == "sketch"))

    @property
    def comparable(self) -> bool:
        """Whether the engine holds the trainer model's dtype, so their weights compare bitwise."""
        if self.model is None:
            return False
        params = {stable_name(n): p for n, p in self.model.named_parameters()}
        return all(params[n].dtype == self.dtype for n in self._target_names)

    def trainer_checksum(self) -> str:
        """`weights_checksum` of the trainer model's target weights (needs ``model``)."""
        if self.model is None:
            raise ValueError("VLLMPolicy was built without the trainer's model")
        return weights_checksum(self.model, self._target_names)

    @property
    def step(self) -> int:
        """The policy step the engine holds (asked from the engine)."""
        return json.loads(self._call("logra_info"))["step"]

    def apply(self, delta: PolicyDelta, dense: dict[str, torch.Tensor] | None = None, checksum: bool = True) -> str:
        """Send one update (and the HF-named ``dense`` tensors after it); the engine's checksum
        (``""`` with ``checksum=False`` when the delta carries none: the engine then skips hashing).

        Raises what `LoGRAWorkerExtension.logra_apply_delta` raises (the engine is then unchanged;
        in vLLM's multi-process mode the error arrives wrapped by vLLM).
        """
        dense = delta.dense if dense is None else dense
        dense_bytes = st_save({n: t.detach().contiguous().cpu() for n, t in dense.items()}) if dense else b""
        try:  # the dense part travels as its own bytes, in the engine's dtype
            return self._call("logra_apply_delta", dataclasses.replace(delta, dense={}).to_bytes(), dense_bytes,
                              checksum)
        finally:
            self._weights_changed()

    def _weights_changed(self) -> None:
        """Drop vLLM's prefix cache: its KV blocks were computed with the previous weights and would
        otherwise serve every prompt sharing a cached prefix (measured: 0.26 nats off after 1 update)."""
        self.llm.reset_prefix_cache()

    def publish(self, delta: PolicyDelta) -> dict[str, float]:
        """The trainer's hook (as `RolloutWorkers.publish`): send ``delta`` just applied to ``model``.

        Attaches the trainer's checksum every `verify_every` updates when the engine holds
        the trainer's dtype, so a mismatch is refused in the engine. Returns metrics.
        """
        t0 = time.perf_counter()
        verify = self.comparable and bool(self.verify_every) and delta.step % self.verify_every == 0
        if verify:
            delta = dataclasses.replace(delta, checksum=weights_checksum(self.model, sorted(delta.factors)))
        low_rank = dataclasses.replace(delta, dense={})
        dense = {n: t.to(self.dtype) for n, t in delta.dense.items()}  # the delta's dense part
        self.apply(low_rank, dense, checksum=False)  # verified deltas come back checked; others are not hashed
        dense_bytes = sum(t.numel() * t.element_size() for t in dense.values())
        return {"sync_bytes": low_rank.nbytes + dense_bytes, "time_sync": time.perf_counter() - t0}

    def checksum(self) -> str:
        """The engine's `weights_checksum` of its target weights (HF names)."""
        return self._call("logra_checksum")

    def resync(self, path_or_bytes: str | bytes, step: int,
               fitted: Mapping[str, torch.Tensor] | None = None) -> str:
        """Full-weight sync from a saved policy (folder, safetensors file or bytes) at ``step``.

        ``fitted``: the trainer's fitted projections (`LoGRAOptimizer.fitted_projections`); they
        replace the engine's. ``None`` leaves it none: right for a trainer that has not fitted
        yet or was just resumed (its first delta carries them), refused at the next delta of a
        trainer whose stream has started (pass them, or use `load_from_model`). An engine reused
        for another run never keeps the last run's.
        """
        fitted_bytes = encode_tensors(fitted) if fitted else b""
        try:
            return self._call("logra_load_full", str(path_or_bytes) if not isinstance(path_or_bytes, bytes)
                              else path_or_bytes, step, fitted_bytes)
        finally:
            self._weights_changed()

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_id: int | None,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0
                 ) -> list[tuple[list[int], list[int], list[float], bool]]:
        """Sample one response per prompt from the engine.

        Returns ``(prompt ids, response ids, log-probs of the response tokens at the
        temperature, truncated)`` rows, as `logra.rl.rollout.layout_rollouts` takes them;
        request ``i`` is seeded with ``seed + i``, so a run is reproducible.
        """
        vllm = require("vllm")
        params = [vllm.SamplingParams(
            temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, logprobs=0, seed=seed + i,
            stop_token_ids=[eos_token_id] if eos_token_id is not None else None, detokenize=False)
            for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        rows = []
        for p, out in zip(prompts, outs, strict=True):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [step[t].logprob for step, t in zip(c.logprobs, ids, strict=True)]
            ended = eos_token_id is not None and eos_token_id in ids
            rows.append((list(p), ids, lps, not ended))
        return rows

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log π(token_t | tokens_<t) of every token after the first, from the engine (temperature 1)."""
        vllm = require("vllm")
        sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        outs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
                for o, s in zip(outs, sequences, strict=True)]

    def close(self) -> None:
        """Shut the engine down (frees its memory; see `shutdown_engine`)."""
        if self.llm is not None:
            shutdown_engine(self.llm)
        self.llm = None
