"""``LoadOptions``: one load request, as one typed, frozen object.

Everything ``from_pretrained`` is asked for besides the checkpoint and the distributed setup. It is
built once — from ``from_pretrained``'s keywords, by the CLI, or held by ``SFTConfig`` — and taken
as it is by ``plan()``, :func:`~nemo_wrap.loading.resolve.resolve_load_plan` and the load pipeline, so
adding an option is one field here plus its use, not a new parameter in every signature on the way.
Values are checked when it is made, naming the keyword.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from nemo_wrap.distributed.precision import Precision, PrecisionName
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.plan import LossPath

_FLAGS = ("strict", "verify", "force_hf", "allow_pickle", "compile")


@dataclass(frozen=True)
class LoadOptions:
    """How to load: each field is the ``from_pretrained`` keyword of the same name.

    - ``dtype``: the parameters' dtype (``"auto"``: the checkpoint's; ``None``: the checkpoint's
      unless the device has no fast matmul in it — bf16 on a CPU without bf16 instructions —
      then fp32, see :func:`~nemo_wrap.distributed.precision.default_parameter_dtype`);
    - ``strict``: raise for missing or unexpected weights instead of initializing or ignoring them;
    - ``verify``: re-read the checkpoint and compare checksums with what every rank holds;
    - ``force_hf``: transformers' class even where nemo_wrap has its own;
    - ``allow_pickle``: read ``.bin`` checkpoints (safetensors otherwise only);
    - ``seed``: seeds whatever is initialized (default: rank 0's ``torch.initial_seed()``);
    - ``peft_config`` / ``adapter``: new LoRA adapters, or a PEFT adapter directory (not both);
    - ``precision``: ``"fp32"``, ``"bf16"`` or ``"bf16-mixed"``;
    - ``compile``: ``torch.compile`` each decoder layer once the model is complete;
    - ``quantization_config``: a ``BitsAndBytesConfig(load_in_4bit=True, ...)``: linear layers held
      in 4 bits, each rank quantizing its rows while reading (QLoRA with ``peft_config``);
    - ``config_overrides``: config attributes to override, as ``(name, value)`` pairs;
    - ``loss``: how ``train_step`` and ``evaluate`` compute the loss: ``"chunked"`` (the default,
      where the model allows it: never the whole logits) or ``"full"`` (transformers' path).
    """

    dtype: torch.dtype | str | None = None
    strict: bool = True
    verify: bool = False
    force_hf: bool = False
    allow_pickle: bool = False
    seed: int | None = None
    peft_config: LoraConfig | None = None
    adapter: str | Path | None = None
    precision: Precision | PrecisionName | None = None  # a word is held as its member
    compile: bool = False
    quantization_config: BitsAndBytesConfig | None = None
    config_overrides: tuple[tuple[str, Any], ...] = ()
    loss: LossPath | str = LossPath.CHUNKED  # "full": the steps compute the whole logits (to compare)

    def __post_init__(self) -> None:
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise InvalidSetupError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.precision is not None:  # a word of the vocabulary, held as its member
            object.__setattr__(self, "precision", Precision.parse(self.precision, "precision"))
        object.__setattr__(self, "loss", LossPath.parse(self.loss, "loss"))
        if self.peft_config is not None and self.adapter is not None:
            raise InvalidSetupError(
                "from_pretrained: pass peft_config (new adapters) or adapter (a directory), not both"
            )

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.config_overrides)
