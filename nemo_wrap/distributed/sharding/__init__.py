"""Sharding managers: one module per strategy behind one entry point, :func:`shard_model`.

The DDP and FSDP2 managers shard *in place* and return the same object, so the model stays an
instance of the class it was built as (``PreTrainedModel``, ``NeMoPreTrainedModel``), with
``config``, ``generate`` and ``save_pretrained``: torch's composable ``replicate`` and
``fully_shard`` swap in a generated subclass rather than wrapping. Megatron-FSDP is the documented
exception: it returns its own wrapper, with the model as ``.module``.

Which managers run on the meta model (before materialization) and which need real weights is a
decision of the load plan (:mod:`nemo_wrap.loading.plan`), not of this package.
"""

from __future__ import annotations

from torch import nn

from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.sharding.ddp import apply_ddp
from nemo_wrap.distributed.sharding.fsdp2 import apply_fsdp2
from nemo_wrap.distributed.sharding.megatron_fsdp import apply_megatron_fsdp
from nemo_wrap.distributed.sharding.tensor_parallel import apply_tensor_parallel, check_tensor_parallel_supported

def shard_model(model: nn.Module, setup: DistributedSetup) -> nn.Module:
    """Apply ``setup``'s strategy to ``model`` in place and return it (the same object).

    The setup is recorded on the model as ``nemo_distributed_setup``: the training step reads its
    data-parallel group from there, and ``generate`` knows that its forward holds collectives.
    """
    mesh = setup.device_mesh()
    if setup.strategy == "ddp":
        apply_ddp(model, mesh)
    elif setup.strategy == "fsdp2":
        if setup.uses_tensor_parallel:
            apply_tensor_parallel(model, mesh["tp"])
        if setup.uses_fsdp:
            apply_fsdp2(model, mesh["dp"], setup.options)
    else:
        model.nemo_distributed_setup = setup
        return apply_megatron_fsdp(model, mesh)  # its own wrapper; the model is ``.module``
    model.nemo_distributed_setup = setup
    return model


__all__ = ["check_tensor_parallel_supported", "shard_model"]
