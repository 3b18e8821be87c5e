"""``ModelState``: what nemo_wrap knows about a model it returned, as one typed attribute.

Every model of the classes ``NeMoAutoModelForCausalLM`` returns has a ``nemo_state``, which the
load pipeline fills in: the setup it was sharded with (the
training step finds its data-parallel group there, ``generate`` knows its forward holds
collectives, ``save_pretrained`` that saving is collective), the audit of its load, the LoRA
configuration of the adapters it carries (and the ties its ``modules_to_save`` undid), and the
pipeline stage it is (if pipelined). One declared attribute replaces names attached from outside
and read back with ``getattr``.

It lives in :mod:`nemo_wrap.loading`, the layer that knows all its parts (the load report is the
load's); training, which reads a model's setup and pipeline stage, sits above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from peft import LoraConfig

from nemo_wrap.distributed.pipeline.runtime import PipelineRuntime
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.loading.provenance import LoadReport


@dataclass
class ModelState:
    """Filled in by the load pipeline, step by step; ``None`` where a step did not apply."""

    setup: DistributedSetup = field(default_factory=DistributedSetup.single_process)
    load_report: LoadReport | None = None
    lora_config: LoraConfig | None = None  # the adapters' config, as PEFT saves it
    pipeline: PipelineRuntime | None = None  # this rank's pipeline stage; None: the whole model is here
    untied: dict[str, str] = field(default_factory=dict)  # ties modules_to_save undid (PEFT's copy), target → source


@runtime_checkable
class HasModelState(Protocol):
    """A model nemo_wrap built (the classes ``NeMoAutoModelForCausalLM`` returns)."""

    nemo_state: ModelState


def setup_of(model: object) -> DistributedSetup:
    """The setup ``model`` was sharded with by nemo_wrap; a single process's for any other model."""
    return model.nemo_state.setup if isinstance(model, HasModelState) else DistributedSetup.single_process()


def loss_plan_of(model: object) -> LossPlan:
    """How the steps compute ``model``'s loss: its load plan's choice; the full logits for a model
    nemo_wrap did not load (whose head and forward it knows nothing of)."""
    report = model.nemo_state.load_report if isinstance(model, HasModelState) else None
    return report.plan.loss if report is not None else LossPlan(LossPath.FULL, "not loaded by nemo_wrap")


def pipeline_of(model: object) -> PipelineRuntime | None:
    """The pipeline stage ``model`` is, or None for a model that is whole on this rank."""
    return model.nemo_state.pipeline if isinstance(model, HasModelState) else None
