"""What a model family's own forward lets pipeline and context parallel do.

Family knowledge, kept with the model specs: the distributed layers split any decoder the same way
and ask nothing about families; the load resolver asks these checks, before anything is built,
whether this family's forward survives the split.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from nemo_wrap.errors import UnsupportedModelError

# Families whose backbone forward multiplies inputs_embeds (an embedding multiplier outside the
# embedding module): under pipeline parallel every stage's received hidden states would be scaled.
RESCALES_INPUTS_EMBEDS = frozenset(
    {
        "granite",
        "granitemoe",
        "granitemoeshared",
        "granitemoehybrid",
        "granite_swa",
        "granitemoe_swa",
        "hyperclovax",
        "hrm_text",
    }
)


def check_pipelinable(model_type: str, class_name: str) -> None:
    """Raise :class:`UnsupportedModelError` for a family whose backbone rescales ``inputs_embeds``
    (each pipeline stage runs the backbone's forward on the hidden states it receives)."""
    if model_type in RESCALES_INPUTS_EMBEDS:
        raise UnsupportedModelError(
            f"{class_name} (model_type={model_type!r}): its backbone rescales inputs_embeds, so every "
            "pipeline stage would scale its received hidden states again; pipeline parallel is refused for it"
        )


def check_context_parallel_supported(config: PretrainedConfig, is_custom: bool, class_name: str) -> None:
    """Refuse by name what the context-parallel attention cannot take of a model: logit soft-capping,
    and our fused classes' sliding-window layers (transformers' classes pass their window on)."""
    text = config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError(
            f"{class_name}: attention logit soft-capping (attn_logit_softcapping) is not built under context parallel"
        )
    if is_custom and "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        raise UnsupportedModelError(
            f"{class_name}: our fused class with sliding-window layers is not built under context parallel; "
            "load with force_hf=True (transformers' class passes its window to the attention)"
        )
