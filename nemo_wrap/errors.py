"""Every error nemo_wrap raises on purpose derives from :class:`NeMoWrapError`.

Specific classes let callers (and tests) react to a kind of failure without matching message
text; each message names the argument, file or key at fault.
"""

from __future__ import annotations

from collections.abc import Iterable

_NAMES_SHOWN = 20


def summarize(names: Iterable[str], limit: int = _NAMES_SHOWN) -> str:
    """``names`` for an error message, the first ``limit`` of them then a count: a header with a
    million keys must not make a 10 MB message."""
    listed = list(names)
    shown = ", ".join(repr(name) for name in listed[:limit])
    return shown if len(listed) <= limit else f"{shown} and {len(listed) - limit} more"


class NeMoWrapError(Exception):
    """Base class of every error raised deliberately by nemo_wrap."""


class InvalidSetupError(NeMoWrapError, ValueError):
    """A ``DistributedSetup`` argument is invalid (unknown strategy, bad sizes, unknown option)."""


class DuplicateRegistrationError(NeMoWrapError, ValueError):
    """A strategy or architecture is registered under a name that is already taken."""


class UnsupportedSetupError(NeMoWrapError, NotImplementedError):
    """A valid setup whose parallelism a load cannot run yet (context, expert parallel)."""


class StrategyUnavailableError(NeMoWrapError, RuntimeError):
    """The requested strategy cannot run here (no CUDA, or its optional package is missing)."""


class DistributedStateError(NeMoWrapError, RuntimeError):
    """The process group is missing, or does not match what the caller asked for, or the launcher
    started it in a way that cannot work (a multi-node restart that would hang)."""


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


class InvalidInitArgumentError(NeMoWrapError, TypeError):
    """An argument of ``initialize_weights`` is invalid: ``seed`` not an integer, ``loaded_names``
    a single string, or naming something that is not a parameter or buffer of the model."""


class ShardingError(NeMoWrapError, RuntimeError):
    """A model cannot be sharded as asked (no tensor-parallel plan, incompatible head counts)."""


class UnsupportedModelError(NeMoWrapError, ValueError):
    """The config does not describe a causal LM that nemo_wrap can build."""


class UnsupportedModelConfigError(NeMoWrapError, ValueError):
    """A model config asks for a feature our model classes do not implement (e.g. a RoPE type)."""


class CheckpointKeyError(NeMoWrapError, LookupError):
    """A state-dict key is missing, unknown to the adapter, or a row range does not fit its tensor."""


class InvalidModelInputError(NeMoWrapError, ValueError):
    """A model forward got an invalid combination of inputs (e.g. both or neither of ``input_ids`` and
    ``inputs_embeds``)."""


class CheckpointNotFoundError(NeMoWrapError, FileNotFoundError):
    """The checkpoint path, its config, or a weight file it names does not exist."""


class CorruptCheckpointError(NeMoWrapError, ValueError):
    """A weight file is structurally invalid (header, offsets, dtypes, sizes) or a tensor does not fit."""


class UnsafeCheckpointError(NeMoWrapError, ValueError):
    """A checkpoint asks for something unsafe: pickle files, or shard paths outside its directory."""


class MissingWeightsError(NeMoWrapError, KeyError):
    """``strict`` loading found parameters neither in the checkpoint nor legitimately initialized."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(NeMoWrapError, KeyError):
    """``strict`` loading found checkpoint tensors that no parameter consumes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(NeMoWrapError, ValueError):
    """A checkpoint tensor's shape differs from the parameter it should fill."""


class DTypeMismatchError(NeMoWrapError, TypeError):
    """A checkpoint tensor's dtype kind cannot fill the parameter (integers or bools into floats)."""


class RemoteRankError(NeMoWrapError, RuntimeError):
    """Another rank failed during a step all ranks run together; this rank stops with it."""


class LoadVerificationError(NeMoWrapError, RuntimeError):
    """``verify=True`` found tensors whose checksums differ from the checkpoint's."""


class CheckpointSaveError(NeMoWrapError, RuntimeError):
    """Writing a checkpoint failed; raised on every rank together, naming the directory and the step.

    The previous checkpoint at that directory, if any, is left in place.
    """


class UnsupportedSaveOptionError(NeMoWrapError, ValueError):
    """A ``save_pretrained`` option transformers has but nemo_wrap cannot honour (pickle output,
    pushing to the hub, variants, DCP output), or a keyword neither knows."""


class InvalidShardSizeError(NeMoWrapError, ValueError):
    """``max_shard_size`` is neither a positive number of bytes nor a size such as ``"5GB"``."""


class DataError(NeMoWrapError, ValueError):
    """Training or evaluation data cannot be used; the message names the file (or data set) and,
    where one is at fault, the line or row. Every rank reads the data before its first collective,
    so every rank raises it (the command line exits with status 2), and none waits for the others."""


class TrainingDataError(DataError):
    """A training text file is missing, not UTF-8 text, or too short to fill one batch on every rank."""


class TokenizerNotFoundError(NeMoWrapError, FileNotFoundError):
    """A checkpoint directory holds no tokenizer that transformers can load, and the job needs one."""


class UnsupportedLoraOptionError(NeMoWrapError, ValueError):
    """A ``LoraConfig`` sets something nemo_wrap does not implement (DoRA, rank patterns, a bias
    mode, …), or targets a layer type other than ``nn.Linear``: refused rather than ignored."""


class LoraTargetError(NeMoWrapError, LookupError):
    """``target_modules`` matches no linear layer of the model."""


class AdapterMismatchError(NeMoWrapError, ValueError):
    """An adapter directory does not fit the model: another base architecture, other shapes, or
    tensors that adapt nothing."""


class ChatTemplateError(DataError):
    """A tokenizer has no chat template, or one whose rendering of a conversation's prefix is not a
    prefix of the whole, so assistant turns cannot be located (and would be mislabelled)."""


class ChatDataError(DataError):
    """A row of a fine-tuning data set is malformed: not JSON, too long a line, unknown format,
    missing column, wrong roles, an empty assistant turn. The message names the file (or data set)
    and the line (JSON Lines) or row."""


class PreferenceDataError(DataError):
    """A row of a preference data set is malformed: no chosen/rejected column, a completion that
    is not one assistant turn, an implicit prompt the two conversations do not share, formats
    mixed. The message names the file (or data set) and the line (JSON Lines) or row."""


class LaunchError(NeMoWrapError, RuntimeError):
    """A job started with ``nemo_wrap.notebook.launch`` failed on a rank (the message carries that
    rank's traceback), ran past its ``timeout``, or was given an invalid ``nproc``."""


class PipelineUsageError(NeMoWrapError, RuntimeError):
    """A pipelined model was called as a whole model: each rank holds one stage, so a forward, a
    ``generate`` or a loss needs the schedule (``train_step`` / ``evaluate``)."""


class UnsupportedQuantizationError(NeMoWrapError, ValueError):
    """A ``quantization_config`` asks for what nemo_wrap cannot honour (8-bit, another quant type or
    storage, a layer that cannot be quantized by rows, a parallelism it does not compose with):
    refused before any weight is read, never half-applied."""


class MissingExtraError(NeMoWrapError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra that
    brings it (``pip install "nemo_wrap[qlora]"``)."""


class RecipeError(NeMoWrapError, ValueError):
    """A recipe (a ``--config`` YAML file or a command-line override) names an unknown key, gives a
    value of the wrong type or a bad value; the message names the key and where it was set (the
    file and line, or the flag). Nothing has been loaded yet."""


class CheckpointMismatchError(NeMoWrapError, ValueError):
    """A resumable checkpoint does not fit the model and optimizer it is loaded into: another model
    (keys missing, unexpected, or of other shapes), LoRA adapters on one side only, or an optimizer
    entry the checkpoint lacks. Raised on every rank before anything is loaded; the message names
    the directory, a few of the differing keys and how many differ."""


class PeerTimeoutError(NeMoWrapError, RuntimeError):
    """A collective failed because another rank did not answer within the process group's timeout
    (hung, stopped, cut off) or left the job; the message names what was waiting (the step), this
    rank and the timeout, with the backend's own message appended."""


class PeerLostError(NeMoWrapError, RuntimeError):
    """A collective failed because another rank vanished (its process died: killed, crashed, out of
    memory). Raised on every surviving rank; the message names the rank that is gone, what was
    being done (loading, step N, an evaluation, a save) and this rank."""


class PreemptedError(NeMoWrapError, RuntimeError):
    """The run stopped on request (SIGTERM) after a step every rank agreed on, and wrote a resumable
    checkpoint there; ``step`` and ``checkpoint`` say which. Not a failure: rerun with
    ``--resume auto`` (the command line exits with status 75, EX_TEMPFAIL)."""

    def __init__(self, message: str, step: int, checkpoint: str) -> None:
        super().__init__(message, step, checkpoint)  # all in args: it pickles (a launched rank's error)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return str(self.args[0])


class MemoryPredictionError(NeMoWrapError, NotImplementedError):
    """The memory prediction cannot trace this layout (named) on fake tensors."""
