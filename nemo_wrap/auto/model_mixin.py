"""``ShardedModelMixin``: what every model ``NeMoAutoModelForCausalLM`` returns does beyond its class.

A model nemo_wrap loads may be sharded across ranks, stored with fused projections, and wrapped by
torch (``FSDP…``/``DDP…`` class names). Three behaviours of a transformers model change with that,
and live here rather than in the init mixin (which knows nothing of files or ranks):

- ``save_pretrained`` writes one consolidated transformers checkpoint from any strategy, under
  transformers' keys (through the spec's adapter) and transformers' architecture name;
- ``generate`` keeps ranks in lockstep when the forward holds collectives;
- ``load_report`` carries the audit of the load, and ``model_spec`` the architecture's spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nemo_wrap.checkpoint.save import DEFAULT_MAX_SHARD_SIZE, save_hf_checkpoint
from nemo_wrap.loading.provenance import LoadReport
from nemo_wrap.models.spec import ModelSpec
from nemo_wrap.state_dict import StateDictAdapter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ShardedModelMixin:
    """Mixed in first (see :func:`nemo_wrap.auto.classes.loadable_class`) over a class that has
    the init mixin: our own implementation or the ``NeMo<Name>`` wrapper of transformers' class."""

    model_spec: ClassVar[ModelSpec]
    hf_architecture: ClassVar[str]
    load_report: LoadReport | None = None  # set by from_pretrained / from_config

    def state_dict_adapter(self) -> StateDictAdapter:
        """Between this model's parameter names and transformers' checkpoint keys."""
        return self.model_spec.adapter(self)  # type: ignore[arg-type]

    def save_pretrained(
        self,
        save_directory: str | Path,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """Write a consolidated transformers checkpoint, from one process or every rank of a sharded job.

        transformers' own method cannot serve here: it names ``type(self)`` (``NeMo…``, ``FSDP…``)
        as the architecture, would write our fused keys, and on rank 0 alone under a process group
        can hang the others. Under a process group of more than one rank, every rank must call it
        (rank 0 writes); the tokenizer is written when given. See
        :func:`nemo_wrap.checkpoint.save.save_hf_checkpoint`.
        """
        save_hf_checkpoint(
            self,  # type: ignore[arg-type]
            save_directory,
            architecture=self.hf_architecture,
            adapter=self.state_dict_adapter(),
            max_shard_size=max_shard_size,
            tokenizer=tokenizer,
        )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, kept in lockstep across ranks when sharding needs it.

        A model sharded by nemo_wrap across ranks (``nemo_distributed_setup``) runs collectives in
        every forward (FSDP all-gathers, tensor-parallel reductions, DDP buffer syncs), so a rank
        that meets its EOS early must keep stepping until every rank is done, or the others hang.
        transformers turns ``synced_gpus`` on only for its own FSDP; here it defaults to on for
        ours. An explicit ``synced_gpus=`` argument wins.
        """
        setup = getattr(self, "nemo_distributed_setup", None)
        if setup is not None and setup.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        return super().generate(*args, **kwargs)  # type: ignore[misc]
