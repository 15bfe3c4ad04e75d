"""Exceptions raised by logra. Each one leaves weights and optimizer state untouched."""

from __future__ import annotations


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


class MissingExtraError(LoGRAError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""
