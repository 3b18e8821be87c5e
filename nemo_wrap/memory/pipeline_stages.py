"""The dry run of one pipeline stage: its schedule driven on a process group that delivers nothing.

On its first step torch's schedule learns what travels between stages from the stages themselves:
a vote passed from stage to stage (does every stage declare its tensors?), then, where one does
not, each stage's output shapes sent to the next as pickled objects. A fake process group delivers
nothing — the vote arrives as 0 and the objects as garbage — so the dry run (1) declares each
stage's tensors (:func:`declared_stage_tensors`) and (2) makes every receive deliver ones
(:class:`ReceivesDeliverOnes`): the vote then says "all declared", and the activations and
gradients received are fake or a few bytes whose values no size depends on. The stage then runs
the real schedule — GPipe's or 1F1B's micro-batches in flight, its receive buffers, its tied
embedding's gradient sum — on fake tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_wrap.distributed.pipeline.runtime import StageTensors
from nemo_wrap.distributed.precision import PrecisionPlan
from nemo_wrap.loading.plan import LossPath


def declared_stage_tensors(config: Any, precision: PrecisionPlan, loss_path: LossPath) -> StageTensors:
    """The tensors between stages as a real step makes them. The hidden states keep the dtype the
    input embedding gives them: the compute dtype where FSDP casts the parameters to it, else the
    parameters' own (autocast leaves the embedding and the residual stream in them)."""
    dtype = precision.compute_dtype if precision.cast_by == "fully_shard" else precision.parameter_dtype
    return StageTensors(config.hidden_size, dtype, config.vocab_size, loss_path is LossPath.CHUNKED)


class ReceivesDeliverOnes(TorchDispatchMode):
    """Within it, every point-to-point receive fills its tensors with ones (see the module's doc)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d.recv_.default:
            for tensor in args[0]:
                tensor.fill_(1)
        return result
