"""Every error nemo_wrap raises on purpose derives from :class:`NeMoWrapError`.

Specific classes let callers (and tests) react to a kind of failure without matching message
text; each message names the argument, file or key at fault.
"""

from __future__ import annotations


class NeMoWrapError(Exception):
    """Base class of every error raised deliberately by nemo_wrap."""


class InvalidSetupError(NeMoWrapError, ValueError):
    """A ``DistributedSetup`` argument is invalid (unknown strategy, bad sizes, unknown option)."""


class StrategyUnavailableError(NeMoWrapError, RuntimeError):
    """The requested strategy cannot run here (no CUDA, or its optional package is missing)."""


class DistributedStateError(NeMoWrapError, RuntimeError):
    """The process group is missing, or does not match what the caller asked for."""


class UnsupportedPlacementError(NeMoWrapError, TypeError):
    """A DTensor placement (e.g. ``Partial``) has no per-rank slice of the full tensor to write into.

    Initialization writes each rank's share of a global value; a partial-sum layout has no such
    share, so it is refused instead of producing a tensor whose sum is wrong.
    """


class UnsupportedInitFunctionError(NeMoWrapError, NotImplementedError):
    """An init function was called whose result cannot be computed shard by shard.

    ``orthogonal_`` (a QR of the whole matrix), ``sparse_``, ``eye_``, ``dirac_``, Xavier and
    Kaiming are not used by the supported models; rather than all-gathering or silently falling back
    to a topology-dependent draw, the redirected init names the function and the parameter.
    """


class UnknownInitTargetError(NeMoWrapError, LookupError):
    """An init rule wrote a tensor that is not a parameter or buffer of the model (e.g. a slice).

    On a DTensor, a slice is a gathered copy: writing it changes nothing in the real weight, which
    is the padding-row defect. The message names the module whose rule did it.
    """


class InvalidPaddingIndexError(NeMoWrapError, IndexError):
    """``padding_idx`` lies outside the embedding's rows, or the weight is not a 2-D matrix."""


class TiedWeightLayoutError(NeMoWrapError, ValueError):
    """Two tied parameters are sharded differently, so one cannot be set from the other locally."""


class NotATransformersModelError(NeMoWrapError, TypeError):
    """The class handed to the wrapper is not a ``transformers.PreTrainedModel`` subclass."""
