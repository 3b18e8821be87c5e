"""What of a PEFT ``LoraConfig`` nemo_wrap honours; anything else set is refused, never ignored."""

from __future__ import annotations

import math
from dataclasses import dataclass

from peft import LoraConfig
from peft.utils.other import get_pattern_key

from nemo_wrap.errors import UnsupportedLoraOptionError

# Fields honoured (or bookkeeping that changes no computation). Every other field must keep
# LoraConfig's default: initializations, layer selection, other variants, … would
# otherwise be silently dropped and train something else than the user asked for.
_HONOURED = frozenset(
    {
        "r",
        "lora_alpha",
        "lora_dropout",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "use_dora",
        "lora_bias",
        "modules_to_save",
        "ensure_weight_tying",
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
class PairShape:
    """One adapter pair's rank and the scale of its output."""

    r: int
    scaling: float


@dataclass(frozen=True)
class LoraSettings:
    """The numbers the adapter pairs use: ``r``/``alpha`` unless a pattern names the projection."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    bias: bool = False  # lora_bias: a bias on lora_B
    dora: bool = False  # use_dora: DoRA's magnitude vector per adapted projection
    modules_to_save: tuple[str, ...] = ()  # modules trained in full and saved whole in the adapter
    ensure_weight_tying: bool = False  # a tied module to save stays tied (trained as one tensor)

    def for_projection(self, name: str) -> PairShape:
        """The pair of transformers' projection ``name`` (``model.layers.0.self_attn.q_proj``): its
        rank and alpha from the first pattern that matches it, as PEFT's ``get_pattern_key`` finds
        it; its scale PEFT's ``alpha / r`` (``alpha / sqrt(r)`` with rank-stabilized LoRA)."""
        ranks, alphas = dict(self.rank_pattern), dict(self.alpha_pattern)
        r = ranks.get(get_pattern_key(list(ranks), name), self.r) if ranks else self.r
        alpha = alphas.get(get_pattern_key(list(alphas), name), self.alpha) if alphas else self.alpha
        return PairShape(r, alpha / (math.sqrt(r) if self.use_rslora else r))


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
            "lora_dropout, use_rslora, rank_pattern, alpha_pattern, use_dora, lora_bias, modules_to_save, "
            "ensure_weight_tying, target_modules, exclude_modules and bias='none')"
        )
    ranks = {"r": config.r, **{f"rank_pattern[{k!r}]": v for k, v in (config.rank_pattern or {}).items()}}
    for where, rank in ranks.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise UnsupportedLoraOptionError(f"LoraConfig.{where} must be a positive integer, got {rank!r}")
    if not 0.0 <= float(config.lora_dropout) < 1.0:
        raise UnsupportedLoraOptionError(f"LoraConfig.lora_dropout must be in [0, 1), got {config.lora_dropout!r}")
    return LoraSettings(
        config.r,
        float(config.lora_alpha),
        float(config.lora_dropout),
        bool(config.use_rslora),
        tuple((config.rank_pattern or {}).items()),
        tuple((k, float(v)) for k, v in (config.alpha_pattern or {}).items()),
        bool(config.lora_bias),
        bool(config.use_dora),
        tuple(config.modules_to_save or ()),
        bool(config.ensure_weight_tying),
    )
