"""Malformed, hostile and careless checkpoints: one case per defect, each a directory to load.

Each :class:`Case` turns a copy of a good tiny checkpoint into its defect and names the error the
load must raise and a fragment (the file, key or argument) the message must contain.
``python -m tests.support.hostile_corpus GOOD WORKDIR`` runs every case in this one process, resetting the
peak-RSS mark before each (``/proc/self/clear_refs``), and prints one JSON line per case with the
error, its message, the seconds and the peak RSS above the start of the case.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nemo_wrap import errors
from tests.support.measure import measured


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Any]  # mutates the copy; may return the path to load instead
    error: type[Exception]
    names: str  # a fragment the message must contain: the file, key or argument at fault
    kwargs: dict[str, Any] = field(default_factory=dict)


# -- helpers that mutate a copy ------------------------------------------------------------------
def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _set_tensor(key: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        tensors = _tensors(path)
        tensors[key] = make(tensors[key])
        _save(path, tensors)

    return build


def _header(path: Path) -> tuple[str, bytes]:
    raw = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return raw[8 : 8 + size].decode(), raw[8 + size :]


def _write_header(path: Path, header: str | bytes, data: bytes) -> None:
    encoded = header.encode() if isinstance(header, str) else header
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _edit_header(change: Callable[[str], str]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        header, data = _header(path)
        _write_header(path, change(header), data)

    return build


def _edit_entry(key: str, **updates: Any) -> Callable[[Path], None]:
    def change(header: str) -> str:
        parsed = json.loads(header)
        parsed[key].update(updates)
        return json.dumps(parsed)

    return _edit_header(change)


def _config(**updates: Any) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **updates}))

    return build


def _write(name: str, content: bytes | str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        data = content.encode() if isinstance(content, str) else content
        (path / name).write_bytes(data)

    return build


def _index(shard_for: Callable[[Path], object], name: str = "model.safetensors.index.json") -> Callable[[Path], None]:
    """An index mapping every key to ``shard_for(path)`` (or, when that is a dict, that weight map)."""

    def build(path: Path) -> None:
        keys = list(_tensors(path))
        shard = shard_for(path)
        weight_map = shard if isinstance(shard, dict) else dict.fromkeys(keys, shard)
        (path / name).write_text(json.dumps({"weight_map": weight_map}))

    return build


def _as_pickle(path: Path) -> dict[str, torch.Tensor]:
    tensors = _tensors(path)
    (path / "model.safetensors").unlink()
    return tensors


def _pickle_index(shard_for: Callable[[Path], object]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        tensors = _as_pickle(path)
        torch.save(tensors, path.parent / "outside.bin")
        (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, shard_for(path))}))

    return build


def _fifo_shard(path: Path) -> str:
    os.mkfifo(path / "shard.bin")
    return "shard.bin"


def _pickle_of(make: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        torch.save(make(_as_pickle(path)), path / "pytorch_model.bin")

    return build


def _pickle_bytes(content: bytes) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        _as_pickle(path)
        (path / "pytorch_model.bin").write_bytes(content)

    return build


def _symlink_out(name: str) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        outside = path.parent / f"moved-{name}"
        (path / name).rename(outside)
        (path / name).symlink_to(outside)

    return build


def _symlink_loop(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("model.safetensors")


def _zero_size_overlap(header: str) -> str:
    """A zero-size tensor between two tensors that share bytes (the overlap check must not reset)."""
    parsed = json.loads(header)
    first = parsed["model.norm.weight"]["data_offsets"]
    parsed["empty"] = {"dtype": "F32", "shape": [0], "data_offsets": [first[1], first[1]]}
    parsed["model.layers.0.input_layernorm.weight"]["data_offsets"] = first
    return json.dumps(parsed)


def _many_unused_tensors(path: Path) -> None:
    header, data = _header(path)
    parsed = json.loads(header)
    end = len(data)
    parsed.update({f"extra.{i}": {"dtype": "F32", "shape": [0], "data_offsets": [end, end]} for i in range(50_000)})
    _write_header(path, json.dumps(parsed), data)


def _empties(megabytes: int) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        _, data = _header(path)
        body = ",".join(f'"{i}":{{}}' for i in range(megabytes * 2**20 // 12))
        _write_header(path, "{" + body + "}", data)

    return build


def _string_list_header(path: Path) -> None:
    """15 MB of short strings: under every cap, parsed, then refused by the entry checks."""
    _, data = _header(path)
    _write_header(path, '{"a":[' + ",".join(f'"{i:x}"' for i in range(15 * 2**20 // 9)) + "]}", data)


def _huge_index(path: Path) -> None:
    (path / "model.safetensors.index.json").write_bytes(b'{"weight_map": {' + b" " * (120 * 2**20) + b"}}")


def _long_and_short(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**tensors, "model.embed_tokens.weight": tensors["model.embed_tokens.weight"][:1]}


_DEEP = "[" * 100_000 + "]" * 100_000
_GOOD_HEADER_TAIL = '"model.norm.weight":'

CASES = [
    # -- the original matrix
    Case("missing-path", lambda p: p / "nowhere", errors.CheckpointNotFoundError, "nowhere"),
    Case("no-config", lambda p: (p / "config.json").unlink(), errors.CheckpointNotFoundError, "config.json"),
    Case("config-not-a-causal-lm", _write("config.json", '{"model_type": "resnet"}'), errors.UnsupportedModelError, "config.json"),
    Case("no-weight-files", lambda p: (p / "model.safetensors").unlink(), errors.CheckpointNotFoundError, "no weight files"),
    Case("index-names-a-missing-shard", _index(lambda p: "model-00002-of-00002.safetensors"), errors.CheckpointNotFoundError, "model-00002-of-00002.safetensors"),
    Case("index-shard-escapes", _index(lambda p: "../good.safetensors"), errors.UnsafeCheckpointError, "model.safetensors.index.json"),
    Case("truncated-file", lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-100]), errors.CorruptCheckpointError, "model.safetensors"),
    Case("header-not-json", _edit_header(lambda h: "{not json" + " " * 10), errors.CorruptCheckpointError, "model.safetensors"),
    Case("header-length-beyond-file", lambda p: (p / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}"), errors.CorruptCheckpointError, "model.safetensors"),
    Case("dtype-size-mismatch", _edit_entry("model.norm.weight", dtype="F16"), errors.CorruptCheckpointError, "'model.norm.weight'"),
    Case("unknown-dtype", _edit_entry("model.norm.weight", dtype="F99"), errors.CorruptCheckpointError, "'model.norm.weight'"),
    Case("tensor-shape-mismatch", _set_tensor("model.norm.weight", lambda t: t[:32].clone()), errors.ShapeMismatchError, "model.norm.weight"),
    # -- silently accepted before
    Case("longer-tensor", _set_tensor("model.embed_tokens.weight", lambda t: torch.cat([t, t])), errors.ShapeMismatchError, "model.embed_tokens.weight", {"verify": True}),
    Case("longer-fused-source", _set_tensor("model.layers.0.self_attn.q_proj.weight", lambda t: torch.cat([t, t[:1]])), errors.ShapeMismatchError, "q_proj", {"force_hf": False}),
    Case("pickle-broadcast", _pickle_of(_long_and_short), errors.ShapeMismatchError, "model.embed_tokens.weight", {"allow_pickle": True}),
    Case("integer-tensor", _set_tensor("model.norm.weight", lambda t: t.to(torch.int32)), errors.DTypeMismatchError, "model.norm.weight"),
    Case("bool-tensor", _set_tensor("model.norm.weight", lambda t: t.bool()), errors.DTypeMismatchError, "model.norm.weight"),
    Case("zero-size-between-overlapping", _edit_header(_zero_size_overlap), errors.CorruptCheckpointError, "overlap"),
    Case("duplicate-header-key", _edit_header(lambda h: h[:-1] + "," + h[h.index(_GOOD_HEADER_TAIL):h.index("}", h.index(_GOOD_HEADER_TAIL)) + 1] + "}"), errors.CorruptCheckpointError, "model.norm.weight"),
    Case("bytes-after-the-last-tensor", lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes() + bytes(8)), errors.CorruptCheckpointError, "after the last tensor"),
    Case("metadata-not-strings", _edit_header(lambda h: h.replace('"format":"pt"', '"format":1')), errors.CorruptCheckpointError, "__metadata__"),
    Case("sequence-classification-architecture", _config(architectures=["LlamaForSequenceClassification"]), errors.UnsupportedModelError, "config.json"),
    # -- foreign exceptions before
    Case("header-deep-nesting", _edit_header(lambda h: _DEEP), errors.CorruptCheckpointError, "model.safetensors"),
    Case("index-deep-nesting", _write("model.safetensors.index.json", '{"weight_map": ' + "[" * 5000), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("config-deep-nesting", _write("config.json", "[" * 5000), errors.CorruptCheckpointError, "config.json"),
    Case("header-integer-of-5000-digits", _edit_header(lambda h: h.replace('"data_offsets":[0,', '"data_offsets":[' + "9" * 5000 + ",", 1)), errors.CorruptCheckpointError, "model.safetensors"),
    Case("shard-name-with-nul", _index(lambda p: "model\u0000.safetensors"), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("dtype-a-list", _edit_header(lambda h: h.replace('"F32"', '["F32"]', 1)), errors.CorruptCheckpointError, "model.safetensors"),
    Case("shard-name-a-list", _index(lambda p: ["model.safetensors"]), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("index-not-utf8", _write("model.safetensors.index.json", b'{"weight_map": {"\xff\xfe": "x"}}'), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("index-weight-map-a-list", _write("model.safetensors.index.json", '{"weight_map": []}'), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("shard-name-too-long", _index(lambda p: "x" * 5000 + ".safetensors"), errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("shard-name-component-too-long", _index(lambda p: "x" * 300 + ".safetensors"), errors.CheckpointNotFoundError, "model.safetensors.index.json"),
    Case("config-not-json", _write("config.json", "not json {"), errors.CorruptCheckpointError, "config.json"),
    Case("symlink-loop", _symlink_loop, errors.NeMoWrapError, "model.safetensors"),
    Case("config-negative-size", _config(hidden_size=-64), errors.UnsupportedModelError, "config.json"),
    Case("config-zero-heads", _config(num_attention_heads=0), errors.UnsupportedModelError, "config.json"),
    Case("config-float-size", _config(hidden_size=64.5), errors.UnsupportedModelError, "config.json"),
    Case("config-vocabulary-of-10-to-12", _config(vocab_size=10**12), errors.UnsupportedModelError, "config.json"),
    Case("config-kv-heads-not-dividing", _config(num_key_value_heads=3), errors.UnsupportedModelError, "config.json"),
    Case("pickle-garbage", _pickle_bytes(b"not a pickle"), errors.CorruptCheckpointError, "pytorch_model.bin", {"allow_pickle": True}),
    Case("pickle-not-a-dict", _pickle_of(lambda t: 5), errors.CorruptCheckpointError, "pytorch_model.bin", {"allow_pickle": True}),
    Case("dtype-float8-argument", lambda p: None, errors.InvalidSetupError, "dtype=", {"dtype": torch.float8_e4m3fn}),
    Case("dtype-int-argument", lambda p: None, errors.InvalidSetupError, "dtype=", {"dtype": "int32"}),
    # -- unbounded time or memory before
    Case("header-of-100MB", _empties(100), errors.CorruptCheckpointError, "model.safetensors"),
    Case("header-of-15MB-empty-objects", _empties(15), errors.CorruptCheckpointError, "model.safetensors"),
    Case("header-of-15MB-strings", _string_list_header, errors.CorruptCheckpointError, "model.safetensors"),
    Case("index-of-120MB", _huge_index, errors.CorruptCheckpointError, "model.safetensors.index.json"),
    Case("config-of-a-million-layers", _config(num_hidden_layers=10**6), errors.ShapeMismatchError, "num_hidden_layers"),
    Case("fifo-named-by-a-pickle-index", _pickle_index(_fifo_shard), errors.CheckpointNotFoundError, "shard.bin", {"allow_pickle": True}),
    Case("fifty-thousand-unused-keys", _many_unused_tensors, errors.UnexpectedKeysError, "extra.0"),
    # -- reading outside the directory before
    Case("pickle-index-parent-path", _pickle_index(lambda p: "../outside.bin"), errors.UnsafeCheckpointError, "pytorch_model.bin.index.json", {"allow_pickle": True}),
    Case("pickle-index-absolute-path", _pickle_index(lambda p: str(p.parent / "outside.bin")), errors.UnsafeCheckpointError, "pytorch_model.bin.index.json", {"allow_pickle": True}),
    Case("pickle-index-dev-zero", _pickle_index(lambda p: "/dev/zero"), errors.UnsafeCheckpointError, "pytorch_model.bin.index.json", {"allow_pickle": True}),
    Case("weights-symlinked-outside", _symlink_out("model.safetensors"), errors.UnsafeCheckpointError, "model.safetensors"),
    Case("config-symlinked-outside", _symlink_out("config.json"), errors.UnsafeCheckpointError, "config.json"),
    Case("shard-symlink-loop", lambda p: [(p / "loop.safetensors").symlink_to("loop.safetensors"), _index(lambda q: "loop.safetensors")(p)], errors.CheckpointNotFoundError, "loop.safetensors"),
    Case("index-names-a-directory", lambda p: [(p / "sub").mkdir(), _index(lambda q: "sub")(p)], errors.CheckpointNotFoundError, "sub"),
]


# -- the runner ------------------------------------------------------------------------------------
def run_case(case: Case, good: Path, workdir: Path) -> dict[str, Any]:
    from nemo_wrap import NeMoAutoModelForCausalLM

    path = workdir / case.id
    shutil.copytree(good, path)
    shutil.copy(good / "model.safetensors", workdir / "good.safetensors")
    target = case.build(path)
    target = target if isinstance(target, Path) else path
    error: BaseException | None = None
    with measured() as measurement:
        try:
            NeMoAutoModelForCausalLM.from_pretrained(target, **{"force_hf": True, **case.kwargs})
        except BaseException as caught:  # the point: record whatever escapes
            error = caught
    return {
        "id": case.id,
        "error": None if error is None else type(error).__name__,
        "nemo": isinstance(error, errors.NeMoWrapError),
        "expected": isinstance(error, case.error),
        "message": "" if error is None else str(error),
        "seconds": measurement.seconds,
        "peak_mb": measurement.peak_mb,
    }


def main(good: str, workdir: str) -> None:
    torch.set_num_threads(1)
    for case in CASES:
        print(json.dumps(run_case(case, Path(good), Path(workdir))), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
