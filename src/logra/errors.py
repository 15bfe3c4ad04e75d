"""Exceptions raised by logra. Each one leaves weights and optimizer state untouched."""

from __future__ import annotations

from pathlib import Path


class LoGRAError(Exception):
    """Base class of every logra error."""


class NonFiniteSketchError(LoGRAError, FloatingPointError):
    """A sketch or gradient holds NaN/Inf (usually a NaN/Inf loss); nothing was changed."""


class StaleProposalError(LoGRAError):
    """A proposal was applied to an optimizer that did not make it, or after another step."""


class DeltaMismatchError(LoGRAError):
    """A policy delta does not fit the model or config it is applied to, or is out of order."""


class KLPredictionError(LoGRAError):
    """The predicted KL is non-finite or negative, or there is nothing to probe."""


class CheckpointError(LoGRAError):
    """A run's checkpoint is missing, or one of its files is missing, truncated, changed since
    it was written or does not fit the model; nothing was loaded.

    Attributes:
        path: the file (or folder) at fault.
    """

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        super().__init__(f"checkpoint: {path} {problem}; nothing was loaded")


class MissingExtraError(LoGRAError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


class ProjectionMismatchError(LoGRAError):
    """Ranks drew different projections (or sketch different targets); their sketches cannot be summed."""


class RankMismatchError(LoGRAError):
    """Data-parallel ranks hold different weights: one summed step would keep them apart."""


class SyncError(LoGRAError):
    """A policy-sync link failed or a peer broke the protocol."""


class HandshakeError(SyncError):
    """A worker was refused at handshake: its model or LoGRA config differs from the trainer's.

    Attributes:
        field: what differs (``'config.rank'``, ``'parameter names'``, ``'shape of <name>'``, ...).
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class NoWorkersLeftError(SyncError):
    """Every rollout worker is lost or refused; the trainer's own state is intact."""


class TrainerLostError(SyncError):
    """A worker lost its link to the trainer (the trainer died or timed out)."""


class LinkError(SyncError):
    """A send or receive on one point-to-point link of policy sync failed or timed out."""


class LayoutError(LoGRAError, ValueError):
    """A model, tensor-parallel setting or parameter name that the vLLM layout cannot express."""


class DeltaGapError(DeltaMismatchError):
    """A delta whose step is not the next one (a gap, a reorder or a duplicate).

    Attributes:
        have: updates the receiver holds.
        got: the delta's step.
    """

    def __init__(self, have: int, got: int) -> None:
        kind = "gap" if got > have else "stale (already applied)"
        super().__init__(f"out-of-order delta ({kind}): receiver holds the policy after {have} updates, "
                         f"delta is update {got}; only update {have} is accepted (a gap needs a full resync)")
        self.have, self.got = have, got


class ChecksumMismatchError(DeltaMismatchError):
    """The fused state's checksum differs from the trainer's expectation after an update."""


class NeedsResyncError(DeltaMismatchError):
    """The receiver's weights are known to be wrong; only `FusedReceiver.resync` is accepted."""


class WorkerError(LoGRAError, RuntimeError):
    """A benchmark worker process exited without a result.

    Attributes:
        method: the method it measured.
        returncode: its exit status (negative: killed by that signal).
        last_line: the last line it printed (for a Python exception, ``Type: message``).
    """

    def __init__(self, method: str, returncode: int, last_line: str) -> None:
        self.method, self.returncode, self.last_line = method, returncode, last_line
        super().__init__(f"worker for {method!r} failed with exit code {returncode}: {last_line}")
