"""Reading a checkpoint into a (possibly sharded) model: each rank fills only its own shards.

For every distinct parameter (and persistent buffer) the rank's local shard is located in global
coordinates (:func:`shard_geometry`), the adapter names which rows of which checkpoint tensors fill
those global rows, and :class:`BlockReader` copies exactly those bytes into the shard's storage —
no full-tensor staging, no collective. Tied parameters are one object after materialization, so
they are read once and reported as tied.
"""

from __future__ import annotations

import itertools
import re

import torch
from torch import nn

from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader, TensorEntry
from nemo_wrap.errors import ShapeMismatchError
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.loading.provenance import Loaded, Missing, Provenance, Tied
from nemo_wrap.state_dict import IdentityAdapter, StateDictAdapter, checkpoint_tensors


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split global indices into maximal step-1 runs: (global start, global stop, local start)."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, index.numel()]
    return [(int(index[a]), int(index[b - 1]) + 1, a) for a, b in zip(starts, stops, strict=True)]


def read_into_model(
    model: nn.Module,
    checkpoint: Checkpoint,
    reader: BlockReader,
    adapter: StateDictAdapter,
) -> tuple[dict[str, Provenance], set[str]]:
    """Fill every local shard from ``checkpoint`` through ``adapter``; return provenance per tensor
    and the checkpoint keys used."""
    transform = "identity" if isinstance(adapter, IdentityAdapter) else type(adapter).__name__
    distinct, tied = checkpoint_tensors(model)
    provenance: dict[str, Provenance] = {}
    used: set[str] = set()
    with torch.no_grad():
        for name, tensor in distinct.items():
            provenance[name] = _read_one(name, tensor, adapter, transform, checkpoint, reader, used)
    for target, source in tied.items():
        provenance[target] = Tied(source)
        used.add(target)  # a checkpoint that also stores the tie target holds the same tensor
    return provenance, used


def _read_one(name, tensor, adapter, transform, checkpoint, reader, used) -> Provenance:
    geometry = shard_geometry(tensor, name)
    global_shape = geometry.global_shape
    all_sources = adapter.hf_sources(name, 0, global_shape[0]) if global_shape else adapter.hf_sources(name, 0, 1)
    keys = tuple(dict.fromkeys(s.hf_key for s in all_sources))
    absent = [key for key in keys if key not in checkpoint.entries and key not in (checkpoint.pickle_tensors or {})]
    if not keys or absent:
        return Missing(keys or (name,))
    if checkpoint.pickle_tensors is not None:
        _copy_from_pickle(name, tensor, geometry, all_sources, checkpoint.pickle_tensors)
    else:
        _check_shapes(name, global_shape, all_sources, checkpoint.entries)
        _read_local_shard(name, tensor, geometry, adapter, checkpoint.entries, reader)
    used.update(keys)
    files = (
        tuple(dict.fromkeys(checkpoint.entries[k].file.name for k in keys))
        if checkpoint.pickle_tensors is None
        else ("pickle",)
    )
    return Loaded(files, keys, transform)


def _check_shapes(name, global_shape, sources, entries: dict[str, TensorEntry]) -> None:
    rows = 0
    for source in sources:
        entry = entries[source.hf_key]
        trailing = tuple(entry.shape[1:]) if entry.shape else ()
        if trailing != tuple(global_shape[1:]) or (entry.shape and source.hf_rows.stop > entry.shape[0]):
            raise ShapeMismatchError(
                f"{entry.file}: tensor {source.hf_key!r} has shape {list(entry.shape)}, which cannot fill "
                f"parameter {name!r} of shape {list(global_shape)}"
            )
        rows += len(range(*source.hf_rows.indices(entry.shape[0] if entry.shape else 1)))
    expected_rows = global_shape[0] if global_shape else 1
    if rows != expected_rows:
        key = sources[0].hf_key
        raise ShapeMismatchError(
            f"{entries[key].file}: tensor {key!r} has shape {list(entries[key].shape)}, but parameter "
            f"{name!r} needs shape {list(global_shape)}"
        )


def _read_local_shard(name, tensor, geometry, adapter, entries, reader) -> None:
    if geometry.is_empty:
        return
    local = local_shard(tensor)
    if not geometry.global_shape:  # a scalar
        reader.read_block_into(entries[adapter.hf_sources(name, 0, 1)[0].hf_key], (), local)
        return
    trailing_runs = [_runs(index) for index in geometry.dim_indices[1:]]
    for row_start, row_stop, local_row in _runs(geometry.dim_indices[0]):
        for source in adapter.hf_sources(name, row_start, row_stop):
            rows_out = slice(
                local_row + source.local_rows.start, local_row + source.local_rows.stop, source.local_rows.step
            )
            for combination in itertools.product(*trailing_runs):
                block = (source.hf_rows, *(slice(g0, g1) for g0, g1, _ in combination))
                out_index = (rows_out, *(slice(l0, l0 + g1 - g0) for g0, g1, l0 in combination))
                reader.read_block_into(entries[source.hf_key], block, local[out_index])


def _copy_from_pickle(name, tensor, geometry, sources, tensors: dict[str, torch.Tensor]) -> None:
    """Explicitly allowed ``.bin`` checkpoints are already in memory: assemble, then take the shard."""
    parts = [tensors[s.hf_key][s.hf_rows] for s in sources]
    if not geometry.global_shape:
        full = parts[0].reshape(())
    else:
        full = torch.empty(geometry.global_shape, dtype=parts[0].dtype)
        for source, part in zip(sources, parts, strict=True):
            full[source.local_rows] = part
    if tuple(full.shape) != geometry.global_shape:
        raise ShapeMismatchError(
            f"pickle checkpoint: {sources[0].hf_key!r} cannot fill {name!r} of shape {list(geometry.global_shape)}"
        )
    if geometry.is_empty:
        return
    local_shard(tensor).copy_(full[torch.meshgrid(*geometry.dim_indices, indexing="ij")])


def matches_any(name: str, patterns) -> bool:
    """transformers' ``_keys_to_ignore_on_load_*`` entries are regular expressions."""
    return any(re.search(pattern, name) for pattern in patterns or ())
