"""A consolidated Hugging Face checkpoint written from a model under any strategy.

The result is what transformers itself would write for the unsharded model, so that plain
``AutoModelForCausalLM.from_pretrained`` (and inference servers, converters) can read it:
``config.json`` naming the transformers architecture (never ``NeMo…``/``DDP…``/``FSDP…``),
safetensors with transformers' keys (our fused projections split back through the adapter, a tied
``lm_head`` omitted), several files plus ``model.safetensors.index.json`` above ``max_shard_size``,
``generation_config.json`` and the tokenizer when given.

Every rank calls it. Sharded tensors are gathered one at a time with ``full_tensor()`` in the same
order on every rank; rank 0 streams each into its file and drops it, so its peak is one tensor (one
MoE layer's stacked experts), not a file's worth. transformers'
``save_pretrained`` is not used: called on rank 0 alone under a process group it can hang the other
ranks, and it names the class it is called on. The directory appears atomically
(:mod:`nemo_wrap.checkpoint.atomic`), and rank 0's outcome is every rank's outcome
(:func:`nemo_wrap.distributed.collectives.on_rank_zero`), so all ranks return or raise together.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nemo_wrap.checkpoint.atomic import replace_directory, staged_save
from nemo_wrap.checkpoint.digest import Digests
from nemo_wrap.checkpoint.gather import FullTensors, SavingRanks, TensorInfo, Writable
from nemo_wrap.checkpoint.locate import INDEX_FILE, SINGLE_FILE
from nemo_wrap.checkpoint.manifest import write_weights_manifest
from nemo_wrap.checkpoint.safetensors_stream import SafetensorsStream
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointSaveError, InvalidShardSizeError, UnsupportedSaveOptionError
from nemo_wrap.progress import progress_bar
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors, encoded_weights

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers' default
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def save_hf_checkpoint(
    model: PreTrainedModel,
    save_directory: str | Path,
    architecture: str,
    adapter: StateDictAdapter,
    ranks: SavingRanks,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    """Write ``model`` as one transformers checkpoint at ``save_directory``, replacing what is there.

    ``architecture`` is the transformers class name written to ``config.json``; ``adapter`` turns
    the model's tensors into transformers' keys. In a collective ``ranks.group`` (a sharded model) every
    rank must call it (tensors are gathered collectively and rank 0's outcome is broadcast) and
    rank 0 writes; a process-local group writes here, with no collective. ``state_dict`` (the
    model's parameter names) is written instead of the model's own tensors when given.
    ``max_shard_size`` is bytes or a size like ``"5GB"``/``"500MiB"``;
    a tensor larger than it gets a file of its own. Raises :class:`CheckpointSaveError` on every
    rank if writing fails; the previous checkpoint at ``save_directory`` then stays in place.
    """
    target, group = Path(save_directory).absolute(), ranks.group
    limit = _parse_size(max_shard_size)
    tensors = FullTensors(_tensors_to_write(model, state_dict), ranks.pipeline)
    with staged_save(target, group) as (staged, failure):
        index, digests = _write_files(
            tensors, _plan_files(tensors.info, limit), _hf_keys_converter(adapter), staged, group, failure
        )
        finish = partial(_finish, model, architecture, tensors.info, tokenizer, staged, target, index, digests)
        group.on_rank_zero("writing the config and finishing", finish, failure)


def _write_files(
    tensors: FullTensors,
    files: dict[str, list[str]],
    to_hf: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    staged: Path,
    group: RankGroup,
    failure: Callable[[str], CheckpointSaveError],
) -> tuple[dict[str, Any] | None, Digests]:
    """Gather and write one tensor at a time (rank 0 streams it into its file); the index when
    there are several files, and each file's digest. The files' layouts come from the global
    shapes, on every rank."""
    weight_map: dict[str, str] = {}
    digests: Digests = {}
    total_size = 0
    bar = progress_bar(len(tensors.info), "saving", group.is_writer)
    for filename, names in files.items():
        layout = _hf_layout(tensors, names, to_hf)
        writer = _FileWriter(staged / filename, layout, group.is_writer)
        for name in names:  # same order on every rank: each full_tensor() is a collective
            full = tensors.full(name, group.is_writer)
            if full is not None and group.is_writer:
                writer.write(to_hf(name, full))
            del full  # before the next gather: two whole tensors are never held at once
            bar.update(1)
        digests[filename] = group.on_rank_zero(f"writing {filename}", writer.finish, failure)
        weight_map.update(dict.fromkeys(layout, filename))
        total_size += sum(dtype.itemsize * math.prod(shape) for shape, dtype in layout.values())
    bar.close()
    if len(files) == 1:
        return None, digests
    return {"metadata": {"total_size": total_size}, "weight_map": weight_map}, digests


def _hf_layout(
    tensors: FullTensors, names: list[str], to_hf: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """transformers' keys (shape, dtype) of ``names``, in write order: the conversion run on meta."""
    layout = {}
    for name in names:
        info = tensors.info[name]
        for key, part in to_hf(name, torch.empty(info.shape, dtype=info.dtype, device="meta")).items():
            layout[key] = (tuple(part.shape), part.dtype)
    return layout


class _FileWriter:
    """Rank 0's stream of one file. An error is kept, and raised by :meth:`finish` after the file's
    last gather, so that no other rank is left waiting in a gather the writer abandoned."""

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]], is_writer: bool) -> None:
        self.stream: SafetensorsStream | None = None
        self.error: Exception | None = None
        if is_writer:
            try:
                self.stream = SafetensorsStream(path, layout)
            except Exception as caught:  # an unwritable directory, a dtype safetensors lacks: see finish()
                self.error = caught

    def write(self, parts: dict[str, torch.Tensor]) -> None:
        if self.stream is None or self.error is not None:
            return
        try:
            for key, tensor in parts.items():
                self.stream.write(key, tensor)
        except Exception as caught:  # a full disk, a tensor unlike its announced layout: see finish()
            self.error = caught
            self.stream.abandon()

    def finish(self) -> str:
        """Close the file; return its content digest."""
        if self.error is not None:
            raise self.error
        assert self.stream is not None  # finish runs on the writer, whose stream opened
        self.stream.close()
        return self.stream.digest


def _tensors_to_write(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, Writable]:
    """The model's distinct tensors (tie targets omitted, as transformers does; 4-bit layers'
    weights dequantized), or the same names taken from a given ``state_dict``, which must hold every
    one of them and nothing unknown."""
    distinct, tied = checkpoint_tensors(model)
    encoded = encoded_weights(model)
    if state_dict is None:
        return {**distinct, **encoded}
    if encoded:
        raise UnsupportedSaveOptionError(
            "save_pretrained(state_dict=...) of a model with 4-bit layers: save the model itself (its 4-bit "
            "weights are written dequantized) or its adapter"
        )
    missing = sorted(set(distinct) - set(state_dict))
    unknown = sorted(set(state_dict) - set(distinct) - set(tied))
    if missing or unknown:
        raise CheckpointSaveError(
            f"save_pretrained(state_dict=...): the state dict lacks {missing[:5]} and has unknown keys "
            f"{unknown[:5]} for {type(model).__name__}"
        )
    return {name: state_dict[name] for name in distinct}


def _parse_size(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        if size > 0:
            return size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if match and match.group(2).upper() in _UNITS and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise InvalidShardSizeError(
        f"max_shard_size must be a positive number of bytes or a size such as '5GB' or '500MiB', got {size!r}"
    )


def _hf_keys_converter(adapter: StateDictAdapter) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One full tensor of the model → the transformers tensors it stands for (fused parts and
    merged experts are views of it: each is streamed out, none copied whole)."""
    return lambda name, tensor: adapter.to_hf({name: tensor})


def _plan_files(tensors: Mapping[str, TensorInfo], limit: int) -> dict[str, list[str]]:
    """File name → the names of the tensors it holds, filled greedily in order up to ``limit`` bytes.

    Sizes come from global shapes, so every rank computes the same plan without gathering.
    """
    groups: list[list[str]] = [[]]
    size = 0
    for name, info in tensors.items():
        nbytes = info.nbytes
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    stem = SINGLE_FILE.removesuffix(".safetensors")
    return {f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors": group for i, group in enumerate(groups, start=1)}


def _finish(
    model: PreTrainedModel,
    architecture: str,
    tensors: Mapping[str, TensorInfo],
    tokenizer: PreTrainedTokenizerBase | None,
    staged: Path,
    target: Path,
    index: dict[str, Any] | None,
    digests: Digests,
) -> None:
    """Index, config, generation config, tokenizer and the weights' manifest into ``staged``; then
    swap it in."""
    if index is not None:
        (staged / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(model.config)
    config.architectures = [architecture]
    floating = [t.dtype for t in tensors.values() if t.dtype.is_floating_point]
    if floating:
        config.dtype = floating[0]
    config.save_pretrained(staged)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(staged)
    if tokenizer is not None:
        tokenizer.save_pretrained(staged)
    write_weights_manifest(staged, digests)
    replace_directory(staged, target)
