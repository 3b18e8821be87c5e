"""What of a PEFT ``LoraConfig`` nemo_wrap honours; anything else set is refused, never ignored."""

from __future__ import annotations

import math
from dataclasses import dataclass

from peft import LoraConfig

from nemo_wrap.errors import UnsupportedLoraOptionError

# Fields honoured (or bookkeeping that changes no computation). Every other field must keep
# LoraConfig's default: DoRA, rank/alpha patterns, modules_to_save, layer selection, … would
# otherwise be silently dropped and train something else than the user asked for.
_HONOURED = frozenset(
    {
        "r",
        "lora_alpha",
        "lora_dropout",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "task_type",
        "inference_mode",
        "base_model_name_or_path",
        "revision",
        "peft_type",
        "peft_version",
        "auto_mapping",
    }
)


@dataclass(frozen=True)
class LoraSettings:
    """The numbers every adapter pair uses."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool

    @property
    def scaling(self) -> float:
        """PEFT's: ``alpha / r``, or ``alpha / sqrt(r)`` with rank-stabilized LoRA."""
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def lora_settings(config: object) -> LoraSettings:
    """Validate ``config`` (a ``peft.LoraConfig``) and return the settings the layers use."""
    if not isinstance(config, LoraConfig):
        raise UnsupportedLoraOptionError(f"peft_config must be a peft.LoraConfig, got {type(config).__name__}")
    given, default = config.to_dict(), LoraConfig().to_dict()
    unsupported = sorted(k for k, v in given.items() if k not in _HONOURED and v != default.get(k))
    if config.bias != "none":
        unsupported.append("bias")
    if config.task_type not in (None, "CAUSAL_LM"):
        unsupported.append("task_type")
    if unsupported:
        raise UnsupportedLoraOptionError(
            f"LoraConfig sets {unsupported}, which nemo_wrap does not implement (it honours r, lora_alpha, "
            "lora_dropout, use_rslora, target_modules, exclude_modules and bias='none')"
        )
    if not isinstance(config.r, int) or config.r < 1:
        raise UnsupportedLoraOptionError(f"LoraConfig.r must be a positive integer, got {config.r!r}")
    if not 0.0 <= float(config.lora_dropout) < 1.0:
        raise UnsupportedLoraOptionError(f"LoraConfig.lora_dropout must be in [0, 1), got {config.lora_dropout!r}")
    return LoraSettings(config.r, float(config.lora_alpha), float(config.lora_dropout), bool(config.use_rslora))
