"""LoRA adapters on our models, read and written in PEFT's names and format.

PEFT's ``LoraConfig`` says what to adapt, in transformers' module names (``q_proj``, ``"all-linear"``,
a regex). Our fused classes hold q/k/v in one ``qkv_proj`` and gate/up in one ``gate_up_proj``, so
PEFT's own layers cannot be injected there by name; instead each adapted linear layer gets a
:class:`~nemo_wrap.models.lora.layers.LoraAdapters` sibling with one low-rank pair per transformers
projection it fuses, whose output a forward hook adds to that projection's rows. The parameters are named so
that PEFT's key of each is a string rewrite (:func:`~nemo_wrap.models.lora.targets.peft_key`), and
they are ordinary parameters of the decoder layers: sharded, initialized and audited like the rest.

When the caller runs PEFT's own ``get_peft_model`` instead (TRL's ``peft_config=``), PEFT's layers
do the arithmetic on parameterless views of the fused layers' projections
(:mod:`~nemo_wrap.models.lora.peft_views`).
"""

from nemo_wrap.models.lora.layers import LoraAdapters, LoraPair
from nemo_wrap.models.lora.peft_views import ProjectionView, add_projection_views
from nemo_wrap.models.lora.settings import LoraSettings, lora_settings
from nemo_wrap.models.lora.switch import adapters_disabled
from nemo_wrap.models.lora.targets import (
    LoraTarget,
    adapter_parallel_entries,
    adapts_output_layer,
    add_lora,
    find_lora_targets,
    fused_parts,
    is_lora_parameter,
    peft_key,
)

__all__ = [
    "LoraAdapters",
    "LoraPair",
    "LoraSettings",
    "LoraTarget",
    "ProjectionView",
    "adapter_parallel_entries",
    "adapters_disabled",
    "adapts_output_layer",
    "add_lora",
    "add_projection_views",
    "find_lora_targets",
    "fused_parts",
    "is_lora_parameter",
    "lora_settings",
    "peft_key",
]
