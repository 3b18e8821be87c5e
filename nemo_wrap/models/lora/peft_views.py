"""PEFT's own ``get_peft_model`` on our fused classes: transformers' projections as PEFT sees them.

PEFT finds what to adapt by module name, and it cannot adapt part of a fused layer (its
maintainers say so: q and v of one ``qkv_proj`` is "currently not possible"). TRL's
``SFTTrainer(peft_config=...)`` and most tutorials call ``get_peft_model`` on the model they are
given, so on our fused Llama ``target_modules=["q_proj", "v_proj"]`` would find nothing.

So each fused layer of a process-local model gets one :class:`ProjectionView` sibling per
transformers projection it holds (``self_attn.q_proj`` beside ``self_attn.qkv_proj``), named as in
transformers' class. A view holds no parameters and outputs zeros; PEFT wraps it in its own
``lora.Linear``, whose output is then PEFT's low-rank delta alone, and a forward hook on the fused
layer adds that delta to the projection's rows. PEFT's layer does all LoRA arithmetic (scaling,
dropout, several adapters, ``disable_adapter``), and its saved adapter has transformers' keys, so
plain PEFT over transformers' class loads it. Our own adapters (``peft_config=`` on
``from_pretrained``) skip the views.

Views are not added to sharded models: parameters PEFT adds after sharding would be neither
sharded nor synchronized, so there ``get_peft_model`` finding nothing (PEFT's own error) is the
right outcome; ``peft_config=`` on ``from_pretrained`` is the way.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.errors import UnsupportedLoraOptionError
from nemo_wrap.models.lora.layers import Placement


class ProjectionView(nn.Linear):
    """One transformers projection (``q_proj``) inside a fused layer of ours, for PEFT to wrap.

    An ``nn.Linear`` to PEFT's dispatch, without parameters of its own: ``weight`` is the fused
    layer's (PEFT reads its device and dtype to place new adapters), ``forward`` returns zeros of
    the projection's width, so the wrapper's output is its delta. Merging through PEFT fails on
    the shape mismatch, loudly; the trained adapter is saved in transformers' keys instead.
    """

    def __init__(self, fused: nn.Linear, out_features: int) -> None:
        nn.Module.__init__(self)
        self.in_features = fused.in_features
        self.out_features = out_features
        self.register_parameter("bias", None)  # PEFT's bias="none"; the fused layer adds its own bias
        self.__dict__["_fused"] = fused  # a reference, not a submodule: no second state-dict entry

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]  # a parameter in nn.Linear; here the fused one
        return self.__dict__["_fused"].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features)

    def init_own_parameters(self) -> None:
        """Nothing to initialize: the fused layer's weight is initialized (or read) as itself."""


def add_projection_views(model: nn.Module, fused_parts: dict[str, list[tuple[str, Placement]]]) -> None:
    """Give every fused layer (``{layer name: [(transformers projection name, placement), ...]}``,
    two parts or more) a :class:`ProjectionView` sibling per part, and the hook adding their
    PEFT deltas to its output."""
    for layer_name, parts in fused_parts.items():
        layer = model.get_submodule(layer_name)
        assert isinstance(layer, nn.Linear)  # fused_parts finds linear layers only
        parent_name, _, leaf = layer_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        views = []
        for part, placement in parts:
            view_name = part.rpartition(".")[2]
            parent.add_module(view_name, ProjectionView(layer, max(rows.stop for rows, _ in placement)))
            views.append((view_name, placement))
        layer.register_forward_hook(partial(_add_peft_deltas, parent, leaf, tuple(views)))


def _add_peft_deltas(
    parent: nn.Module,
    leaf: str,
    views: tuple[tuple[str, Placement], ...],
    layer: nn.Module,
    args: tuple[Any, ...],
    output: torch.Tensor,
) -> torch.Tensor:
    """Forward hook of a fused layer: its output plus the delta of each view PEFT has wrapped."""
    wrapped = [(getattr(parent, name), placement) for name, placement in views]
    wrapped = [(view, placement) for view, placement in wrapped if isinstance(view, BaseTunerLayer)]
    if isinstance(parent.get_submodule(leaf), BaseTunerLayer):
        names = ", ".join(name for name, _ in views)
        raise UnsupportedLoraOptionError(
            f"PEFT adapted the fused layer {leaf} as a whole (its target_modules name it, as 'all-linear' does): "
            f"list transformers' projections ({names}, ...) instead, or pass peft_config to from_pretrained"
        )
    if not wrapped:
        return output
    if isinstance(output, DTensor):
        raise UnsupportedLoraOptionError(
            "PEFT adapters added after sharding are not sharded: pass peft_config to from_pretrained"
        )
    x = args[0]
    placed = torch.zeros_like(output)
    for view, placement in wrapped:
        delta = view(x)
        for part_rows, layer_rows in placement:
            placed[..., layer_rows] = placed[..., layer_rows] + delta[..., part_rows]
    return output + placed
