"""Reading a checkpoint into a (possibly sharded) model: each rank fills only its own shards.

For every distinct parameter (and persistent buffer) the rank's local shard is located in global
coordinates (:func:`shard_geometry`), the adapter names the windows of checkpoint tensors that fill
the tensor (:class:`SourceBlock`), and each window's intersection with the local shard is copied —
by :class:`BlockReader`, exactly those bytes — into the shard's storage: no full-tensor staging, no
collective. Tied parameters are one object after materialization, so they are read once and
reported as tied.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader, TensorEntry
from nemo_wrap.errors import DTypeMismatchError, ShapeMismatchError
from nemo_wrap.initialization.geometry import ShardGeometry, local_shard, shard_geometry
from nemo_wrap.loading.provenance import Loaded, Missing, Provenance, Tied
from nemo_wrap.progress import progress_bar
from nemo_wrap.state_dict import (
    EncodedWeight,
    IdentityAdapter,
    SourceBlock,
    StateDictAdapter,
    checkpoint_tensors,
    encoded_weights,
)

# How many values of a 4-bit layer's rows are held in 16 (or 32) bits at once while they are
# quantized: bitsandbytes' CPU quantizer takes ~14 bytes of temporaries per value (an fp32 copy,
# scaled values, int32 codes), so 1M values cost ~14 MiB at once (32 MiB chunks peaked at 7×
# their size); larger chunks gain no speed (measured on the 1.1B benchmark checkpoint).
ENCODE_CHUNK_VALUES = 2**20

# (checkpoint key, one step-1 slice per checkpoint-tensor dim) → a view of that window of the
# checkpoint tensor, valid inside the ``with`` block
BlockView = Callable[[str, tuple[slice, ...]], AbstractContextManager[torch.Tensor]]


# Called with each tensor just read (name, tensor, its provenance) while its file pages are mapped.
AfterRead = Callable[[str, torch.Tensor, Provenance], None]


def read_into_model(
    model: nn.Module,
    checkpoint: Checkpoint,
    reader: BlockReader,
    adapter: StateDictAdapter,
    show_progress: bool = False,
    after_read: AfterRead | None = None,
) -> tuple[dict[str, Provenance], set[str]]:
    """Fill every local shard from ``checkpoint`` through ``adapter``; return provenance per tensor
    and the checkpoint keys used. ``show_progress``: this rank may show a progress bar.
    ``after_read`` sees each plain tensor right after it is read, before its pages are dropped
    (``verify`` takes its checkpoint side there, from pages still mapped: no second page faults)."""
    transform = "identity" if isinstance(adapter, IdentityAdapter) else type(adapter).__name__
    distinct, tied = checkpoint_tensors(model)
    encoded = encoded_weights(model)
    provenance: dict[str, Provenance] = {}
    used: set[str] = set()
    reading = _Reading(
        checkpoint, adapter, transform, checkpoint_shapes(checkpoint), checkpoint_blocks(checkpoint, reader)
    )
    with torch.no_grad(), progress_bar(len(distinct) + len(encoded), "loading", show_progress) as bar:
        for name, tensor in distinct.items():
            with reader.pages_held() if after_read is not None else nullcontext():
                found = provenance[name] = _read_one(name, tensor, reading)
                if after_read is not None:
                    after_read(name, tensor, found)
            if isinstance(found, Loaded):
                used.update(found.keys)
            bar.update(1)
        for name, layer in encoded.items():
            found = provenance[name] = _read_encoded(name, layer, reading)
            if isinstance(found, Loaded):
                used.update(found.keys)
            bar.update(1)
    for target, source in tied.items():
        provenance[target] = Tied(source)
        used.add(target)  # a checkpoint that also stores the tie target holds the same tensor
    return provenance, used


def checkpoint_blocks(checkpoint: Checkpoint, reader: BlockReader, second_read: bool = False) -> BlockView:
    """Where blocks come from: views of the mapped safetensors files, or of allowed pickle tensors.
    ``second_read``: ``verify``'s, not counted in the reader's ``bytes_read``."""
    if checkpoint.pickle_tensors is not None:
        tensors = checkpoint.pickle_tensors
        return lambda key, window: nullcontext(tensors[key][window])
    entries = checkpoint.entries
    view = reader.reread if second_read else reader.block
    return lambda key, window: view(entries[key], window)


@dataclass(frozen=True)
class _Reading:
    """Where a read takes its values: the checkpoint, the adapter naming its windows (and the
    transform the report names), every key's shape, and the views of the mapped blocks."""

    checkpoint: Checkpoint
    adapter: StateDictAdapter
    transform: str
    shapes: dict[str, tuple[int, ...]]
    view_block: BlockView


def _read_one(name: str, tensor: torch.Tensor, reading: _Reading) -> Provenance:
    geometry = shard_geometry(tensor, name)
    blocks = _checked_blocks(name, geometry.global_shape, tensor.dtype, reading)
    if isinstance(blocks, Missing):
        return blocks
    fill_from_blocks(local_shard(tensor), geometry, blocks, reading.view_block)
    return _loaded(blocks, reading, reading.transform)


def _read_encoded(name: str, layer: EncodedWeight, reading: _Reading) -> Provenance:
    """Fill a layer that holds its weight encoded (4-bit): this rank's rows of the checkpoint tensor,
    a bounded chunk of rows at a time, each encoded into the layer's storage as soon as it is read —
    so no 16-bit copy of the layer's rows is ever whole in memory."""
    shape = layer.weight_shape
    blocks = _checked_blocks(name, shape, layer.weight_dtype, reading)
    if isinstance(blocks, Missing):
        return blocks
    rows, columns = layer.local_rows(), torch.arange(shape[1])
    chunk = max(1, ENCODE_CHUNK_VALUES // shape[1])
    layer.start_encoding()
    for first in range(0, rows.numel(), chunk):
        chunk_rows = rows[first : first + chunk]
        values = torch.empty(chunk_rows.numel(), shape[1], dtype=layer.weight_dtype)
        fill_from_blocks(values, ShardGeometry(shape, (chunk_rows, columns)), blocks, reading.view_block)
        layer.encode_rows(values, first)
    return _loaded(blocks, reading, f"{reading.transform}; {layer.describe()}")


def _checked_blocks(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, reading: _Reading
) -> list[SourceBlock] | Missing:
    """The windows of checkpoint tensors that fill tensor ``name``, checked to fit it exactly and
    to be of a kind its ``dtype`` takes; :class:`Missing` when the checkpoint lacks one of them."""
    blocks = reading.adapter.blocks(name, shape)
    keys = tuple(dict.fromkeys(block.hf_key for block in blocks))
    if not keys or any(key not in reading.shapes for key in keys):
        return Missing(reading.adapter.expected_keys(name))
    check_blocks(name, shape, blocks, reading.shapes, reading.checkpoint)
    _check_dtype_kind(name, dtype, keys, reading.checkpoint)
    return blocks


def _loaded(blocks: list[SourceBlock], reading: _Reading, transform: str) -> Loaded:
    checkpoint = reading.checkpoint
    keys = tuple(dict.fromkeys(block.hf_key for block in blocks))
    files = ("pickle",) if checkpoint.pickle_tensors is not None else _files_of(keys, checkpoint.entries)
    return Loaded(files, keys, transform)


def _check_dtype_kind(name: str, dtype: torch.dtype, keys: tuple[str, ...], checkpoint: Checkpoint) -> None:
    """Floating parameters take floating checkpoint tensors only: a cast from integers or bools
    would load numbers that were never weights, without a word."""
    if not dtype.is_floating_point:
        return
    for key in keys:
        source = checkpoint.pickle_tensors[key].dtype if checkpoint.pickle_tensors is not None else None
        where: object = "pickle checkpoint"
        if source is None:
            source, where = checkpoint.entries[key].dtype, checkpoint.entries[key].file
        if not source.is_floating_point:
            raise DTypeMismatchError(
                f"{where}: tensor {key!r} is {source}, which cannot fill the {dtype} parameter {name!r}"
            )


def checkpoint_shapes(checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key's shape, from the safetensors headers or the allowed pickle tensors."""
    if checkpoint.pickle_tensors is not None:
        return {key: tuple(t.shape) for key, t in checkpoint.pickle_tensors.items()}
    return {key: entry.shape for key, entry in checkpoint.entries.items()}


def _files_of(keys: Iterable[str], entries: dict[str, TensorEntry]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(entries[key].file.name for key in keys))


def check_blocks(
    name: str,
    shape: tuple[int, ...],
    blocks: list[SourceBlock],
    shapes: dict[str, tuple[int, ...]],
    checkpoint: Checkpoint,
) -> None:
    """Raise :class:`ShapeMismatchError` unless every block fits its checkpoint tensor, each
    checkpoint tensor is used whole, and the blocks fill the parameter exactly."""
    used_volume: dict[str, int] = {}
    for block in blocks:
        source_shape = shapes[block.hf_key]
        fits = (
            len(source_shape) == len(block.source)
            and all(s.stop <= size for s, size in zip(block.source, source_shape, strict=True))
            and _extents(block.target)[1 if block.stacked else 0 :] == _extents(block.source)
        )
        if not fits:
            raise _mismatch(checkpoint, block.hf_key, source_shape, name, shape)
        used_volume[block.hf_key] = used_volume.get(block.hf_key, 0) + _volume(block.source)
    for key, volume in used_volume.items():
        if volume != _volume(tuple(slice(0, n) for n in shapes[key])):
            raise _mismatch(checkpoint, key, shapes[key], name, shape)
    if sum(_volume(block.target) for block in blocks) != _volume(tuple(slice(0, n) for n in shape)):
        key = blocks[0].hf_key
        raise _mismatch(checkpoint, key, shapes[key], name, shape)


def _extents(window: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(s.start, s.stop, s.step or 1)) for s in window)


def _volume(window: tuple[slice, ...]) -> int:
    volume = 1
    for extent in _extents(window):
        volume *= extent
    return volume


def _mismatch(
    checkpoint: Checkpoint, key: str, source_shape: tuple[int, ...], name: str, shape: tuple[int, ...]
) -> ShapeMismatchError:
    where = checkpoint.entries[key].file if key in checkpoint.entries else "pickle checkpoint"
    return ShapeMismatchError(
        f"{where}: tensor {key!r} has shape {list(source_shape)}, which cannot fill parameter {name!r} "
        f"of shape {list(shape)}"
    )


def fill_from_blocks(
    local: torch.Tensor, geometry: ShardGeometry, blocks: list[SourceBlock], view_block: BlockView
) -> None:
    """Copy into ``local`` (this rank's shard, laid out by ``geometry``) its part of every block."""
    if geometry.is_empty:
        return
    for block in blocks:
        per_dim = [_dim_runs(index, window) for index, window in zip(geometry.dim_indices, block.target, strict=True)]
        for combination in itertools.product(*per_dim):
            destination = tuple(slice(l0, l0 + step * (n - 1) + 1, step) for l0, step, _, n in combination)
            offsets = tuple(slice(o0, o0 + n) for _, _, o0, n in combination)
            out = local[destination]
            if block.stacked:  # target dim 0 is the stacking index: the checkpoint tensor lacks it
                out, offsets = out[0], offsets[1:]
            source = tuple(
                slice(w.start + o.start, w.start + o.stop) for o, w in zip(offsets, block.source, strict=True)
            )
            with view_block(block.hf_key, source) as data:
                if data.shape != out.shape:  # checked by check_blocks; copy_ would broadcast silently
                    raise ShapeMismatchError(
                        f"{block.hf_key!r}: block {list(data.shape)} does not fit {list(out.shape)}"
                    )
                out.copy_(data)


def _dim_runs(index: torch.Tensor, window: slice) -> list[tuple[int, int, int, int]]:
    """The runs (see :func:`_runs`) of one dimension's local indices inside ``window``.

    Shard index lists are increasing, so a list whose span equals its length is one contiguous
    range: the common case (plain tensors, ``Shard``) takes no tensor operation.
    """
    count = index.numel()
    if (window.step or 1) == 1 and count and int(index[-1]) - int(index[0]) + 1 == count:
        first = int(index[0])
        start, stop = max(first, window.start), min(first + count, window.stop)
        return [(start - first, 1, start - window.start, stop - start)] if start < stop else []
    return _runs(*_intersect(index, window))


def _intersect(index: torch.Tensor, window: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Local positions whose global index lies in ``window``, and their offsets within the window."""
    step = window.step or 1
    inside = (index >= window.start) & (index < window.stop) & ((index - window.start) % step == 0)
    positions = torch.nonzero(inside).flatten()
    return positions, (index[positions] - window.start) // step


def _runs(positions: torch.Tensor, offsets: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Split aligned (local position, window offset) pairs into runs where the offset grows by 1 and
    the position by a constant step: ``(first position, step, first offset, length)``."""
    count = positions.numel()
    if count == 0:
        return []
    position_steps = positions[1:] - positions[:-1]
    offset_steps = offsets[1:] - offsets[:-1]
    breaks = (offset_steps != 1) | (position_steps < 1)
    breaks[1:] |= position_steps[1:] != position_steps[:-1]
    starts = [0, *(torch.nonzero(breaks).flatten() + 1).tolist()]
    stops = [*starts[1:], count]
    runs = []
    for a, b in zip(starts, stops, strict=True):
        step = int(position_steps[a]) if b - a > 1 else 1
        runs.append((int(positions[a]), step, int(offsets[a]), b - a))
    return runs


def matches_any(name: str, patterns: Iterable[Any] | None) -> bool:
    """transformers' ``_keys_to_ignore_on_load_*`` entries are regular expressions."""
    return any(re.search(pattern, name) for pattern in patterns or ())
