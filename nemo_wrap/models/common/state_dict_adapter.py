"""Translation between transformers' checkpoint keys and our fused-projection keys.

Our models differ from transformers' only in two fused projections per layer
(``self_attn.qkv_proj`` ← ``q_proj, k_proj, v_proj``; ``mlp.gate_up_proj`` ← ``gate_proj, up_proj``,
weights and biases alike) and in ``lm_head.weight``, which checkpoints of tied models omit. Every
other key is the same name and tensor on both sides.

A rank that owns part of a fused weight should not read whole q/k/v tensors to build it:
:meth:`FusedStateDictAdapter.hf_sources` says which rows of which checkpoint tensors land where in a
row range of ours. Columns are never fused, so a column slice (``o_proj``/``down_proj`` under
row-parallel sharding) is the same column slice of the checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
from transformers import PreTrainedConfig

from nemo_wrap.errors import CheckpointKeyError
from nemo_wrap.models.common.layouts import GateUpLayout, QKVLayout
from nemo_wrap.state_dict import SourceBlock

LM_HEAD_KEY = "lm_head.weight"
EMBEDDING_KEY = "model.embed_tokens.weight"

# Our fused module name → transformers' module names, in the order the layout takes them.
_FUSED_MODULES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class HFSource(NamedTuple):
    """Rows ``hf_rows`` of checkpoint tensor ``hf_key`` fill rows ``local_rows`` of a requested range.

    ``local_rows`` counts from the start of the range (row ``row_start`` of our tensor is local row
    0) and may be strided (step 2 for ``gate_up_proj``), so ``buffer[local_rows] = hf[hf_rows]``.
    """

    hf_key: str
    hf_rows: slice
    local_rows: slice


@dataclass(frozen=True)
class _Fusion:
    """One fused key of ours: its layout and the checkpoint keys of its parts, in layout order."""

    layout: QKVLayout | GateUpLayout
    hf_keys: tuple[str, ...]


class FusedStateDictAdapter:
    """The adapter of our fused Llama-family decoders (Llama, Qwen2, Qwen3 alike).

    Maps whole state dicts both ways, and row ranges of one key to checkpoint rows.

    ``to_hf`` and ``from_hf`` are exact inverses on every key: ``from_hf(to_hf(sd))`` has the same
    keys and bitwise-equal tensors as ``sd``. For a config with ``tie_word_embeddings``, ``to_hf``
    drops ``lm_head.weight`` (as transformers' checkpoints do) and ``from_hf`` restores it as the
    embedding tensor itself.
    """

    def __init__(self, config: PreTrainedConfig) -> None:
        self.tie_word_embeddings = bool(config.tie_word_embeddings)
        self._layouts: dict[str, QKVLayout | GateUpLayout] = {
            "self_attn.qkv_proj": QKVLayout.from_config(config),
            "mlp.gate_up_proj": GateUpLayout.from_config(config),
        }

    # -- whole state dicts --------------------------------------------------------------------
    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our keys → transformers' keys; fused tensors are split into contiguous parts."""
        hf_state_dict = {}
        for key, tensor in state_dict.items():
            if key == LM_HEAD_KEY and self.tie_word_embeddings:
                continue
            fusion = self._fusion(key)
            if fusion is None:
                hf_state_dict[key] = tensor
            else:
                hf_state_dict.update(zip(fusion.hf_keys, fusion.layout.unfuse(tensor), strict=True))
        return hf_state_dict

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Transformers' keys → ours; raises :class:`CheckpointKeyError` naming a missing part."""
        state_dict = {}
        for hf_key, tensor in hf_state_dict.items():
            key = self._fused_key_of(hf_key)
            if key is None:
                state_dict[hf_key] = tensor
            elif key not in state_dict:
                fusion = cast(_Fusion, self._fusion(key))  # ``key`` is a fused key: never None
                missing = [part for part in fusion.hf_keys if part not in hf_state_dict]
                if missing:
                    raise CheckpointKeyError(f"checkpoint lacks {missing}, needed with {hf_key!r} to build {key!r}")
                state_dict[key] = fusion.layout.fuse(*(hf_state_dict[part] for part in fusion.hf_keys))
        if LM_HEAD_KEY not in state_dict:
            if not self.tie_word_embeddings:
                raise CheckpointKeyError(
                    f"checkpoint lacks {LM_HEAD_KEY!r} and the config does not tie word embeddings"
                )
            if EMBEDDING_KEY not in state_dict:
                raise CheckpointKeyError(f"checkpoint lacks {EMBEDDING_KEY!r}, the tied source of {LM_HEAD_KEY!r}")
            state_dict[LM_HEAD_KEY] = state_dict[EMBEDDING_KEY]
        return state_dict

    # -- one key, a range of rows ---------------------------------------------------------------
    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        """The row windows of checkpoint tensors that fill our ``key`` (all other dimensions whole)."""
        trailing = tuple(slice(0, size) for size in shape[1:])
        blocks = []
        for source in self.hf_sources(key, 0, shape[0] if shape else 1):
            target_rows = source.local_rows  # the range starts at row 0: local rows are global rows
            if shape:
                blocks.append(SourceBlock(source.hf_key, (target_rows, *trailing), (source.hf_rows, *trailing)))
            else:
                blocks.append(SourceBlock(source.hf_key, (), ()))
        return blocks

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return tuple(self.hf_keys(key))

    def hf_keys(self, key: str) -> list[str]:
        """The checkpoint keys whose rows make up our ``key``."""
        fusion = self._fusion(key)
        return list(fusion.hf_keys) if fusion is not None else [self._plain_source(key)]

    def hf_sources(self, key: str, row_start: int, row_stop: int) -> list[HFSource]:
        """Which checkpoint rows fill rows ``[row_start, row_stop)`` of our tensor ``key``.

        For a 1-D tensor (bias, norm weight) rows are elements. Raises
        :class:`CheckpointKeyError` unless ``0 <= row_start <= row_stop`` (and, for a fused key,
        ``row_stop`` is within its rows).
        """
        if not 0 <= row_start <= row_stop:
            raise CheckpointKeyError(f"row range [{row_start}, {row_stop}) of {key!r} is not a valid range")
        fusion = self._fusion(key)
        if fusion is None:
            if row_start == row_stop:
                return []
            return [HFSource(self._plain_source(key), slice(row_start, row_stop), slice(0, row_stop - row_start))]
        if row_stop > fusion.layout.rows:
            raise CheckpointKeyError(
                f"row range [{row_start}, {row_stop}) of {key!r} exceeds its {fusion.layout.rows} rows"
            )
        return [
            HFSource(fusion.hf_keys[source.part], source.part_rows, source.local_rows)
            for source in fusion.layout.sources(row_start, row_stop)
        ]

    # -- key arithmetic --------------------------------------------------------------------------
    def _plain_source(self, key: str) -> str:
        """The checkpoint key of an unfused key of ours (the tied lm_head reads the embedding)."""
        return EMBEDDING_KEY if key == LM_HEAD_KEY and self.tie_word_embeddings else key

    def _fusion(self, key: str) -> _Fusion | None:
        """``model.layers.3.self_attn.qkv_proj.bias`` → its layout and the three q/k/v bias keys."""
        module, _, tensor_name = key.rpartition(".")
        for fused, parts in _FUSED_MODULES.items():
            if module.endswith("." + fused):
                prefix = module[: -len(fused)]
                return _Fusion(self._layouts[fused], tuple(f"{prefix}{part}.{tensor_name}" for part in parts))
        return None

    def _fused_key_of(self, hf_key: str) -> str | None:
        """``model.layers.3.mlp.up_proj.weight`` → ``model.layers.3.mlp.gate_up_proj.weight``; else None."""
        module, _, tensor_name = hf_key.rpartition(".")
        for fused, parts in _FUSED_MODULES.items():
            for part in parts:
                if module.endswith("." + part):
                    return f"{module[: -len(part)]}{fused}.{tensor_name}"
        return None
