"""Bad input: a specific error naming the file, key or argument — on every rank, never a hang."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingWeightsError,
    NeMoWrapError,
    RemoteRankError,
    ShapeMismatchError,
    UnexpectedKeysError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("good") / "llama", "llama", "half", tie=False)


@pytest.fixture
def copy(good, tmp_path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(good, target)
    return target


def _load(path, **kwargs):
    return NeMoAutoModelForCausalLM.from_pretrained(path, force_hf=True, **kwargs)


def _rewrite_weights(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nowhere")):
        _load(tmp_path / "nowhere")


def test_no_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no config.json"):
        _load(copy)


def test_config_not_a_causal_lm(copy):
    (copy / "config.json").write_text(json.dumps({"model_type": "resnet"}))
    with pytest.raises(UnsupportedModelError, match="ResNetConfig"):
        _load(copy)


def test_no_weight_files(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="no weight files"):
        _load(copy)


def _make_index(path: Path, shard_name: str) -> None:
    keys = load_file(path / "model.safetensors").keys()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard_name for k in keys}}))


def test_index_naming_a_missing_shard(copy):
    _make_index(copy, "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="model-00002-of-00002.safetensors"):
        _load(copy)


def test_index_shard_escaping_the_directory(copy):
    shutil.copy(copy / "model.safetensors", copy.parent / "outside.safetensors")
    _make_index(copy, "../outside.safetensors")
    with pytest.raises(UnsafeCheckpointError, match=r"escapes the checkpoint directory"):
        _load(copy)


def test_truncated_file(copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors: tensor .* truncated"):
        _load(copy)


def test_header_not_json(copy):
    header = b"{not json"
    (copy / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptCheckpointError, match="header is not valid JSON"):
        _load(copy)


def test_header_length_beyond_file(copy):
    (copy / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="exceeds the file"):
        _load(copy)


def _edit_header(path: Path, edit) -> None:
    data = (path / "model.safetensors").read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(raw) == size
    (path / "model.safetensors").write_bytes(data[:8] + raw + data[8 + size :])


def test_dtype_size_mismatch(copy):
    _edit_header(copy, lambda h: h["model.norm.weight"].update(dtype="F16"))
    with pytest.raises(CorruptCheckpointError, match="'model.norm.weight' spans 256 bytes but dtype F16"):
        _load(copy)


def test_unknown_dtype(copy):
    _edit_header(copy, lambda h: h["model.norm.weight"].update(dtype="F99"))
    with pytest.raises(CorruptCheckpointError, match="'model.norm.weight' has unsupported dtype 'F99'"):
        _load(copy)


def test_tensor_shape_mismatch(copy):
    _rewrite_weights(copy, lambda t: t.update({"model.norm.weight": torch.ones(32)}))
    with pytest.raises(ShapeMismatchError, match=r"'model.norm.weight' has shape \[32\].*\[64\]"):
        _load(copy)


@pytest.mark.parametrize("fused", [False, True], ids=["transformers-class", "fused-class"])
def test_a_tensor_longer_than_its_parameter_is_refused_not_truncated(copy, fused):
    def lengthen(tensors):
        embedding = tensors["model.embed_tokens.weight"]
        tensors["model.embed_tokens.weight"] = torch.cat([embedding, embedding])
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
        tensors["model.layers.0.self_attn.q_proj.weight"] = torch.cat([q, q[:1]])

    _rewrite_weights(copy, lengthen)
    with pytest.raises(ShapeMismatchError, match=r"has shape \[\d+, 64\], which cannot fill"):
        NeMoAutoModelForCausalLM.from_pretrained(copy, force_hf=not fused, verify=True)


def test_a_pickle_tensor_is_never_broadcast_into_a_parameter(copy):
    tensors = load_file(copy / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:1]
    (copy / "model.safetensors").unlink()
    torch.save(tensors, copy / "pytorch_model.bin")
    with pytest.raises(ShapeMismatchError, match=r"'model.embed_tokens.weight' has shape \[1, 64\]"):
        _load(copy, allow_pickle=True)


def test_integer_weights_are_refused_for_float_parameters(copy):
    from nemo_wrap.errors import DTypeMismatchError

    _rewrite_weights(copy, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(DTypeMismatchError, match=r"model.safetensors: tensor 'model.norm.weight' is torch.int32"):
        _load(copy)


def test_unexpected_keys_under_strict_and_tolerated_otherwise(copy):
    _rewrite_weights(copy, lambda t: t.update({"model.extra.weight": torch.ones(3)}))
    with pytest.raises(UnexpectedKeysError, match="model.extra.weight"):
        _load(copy)
    model = _load(copy, strict=False)
    assert model.load_report.unexpected_keys == ("model.extra.weight",)


def test_missing_keys_under_strict_and_initialized_with_reason_otherwise(copy):
    _rewrite_weights(copy, lambda t: [t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("lm_head.weight")])
    with pytest.raises(MissingWeightsError) as excinfo:
        _load(copy)
    assert "lm_head.weight" in str(excinfo.value) and "model.layers.1.mlp.up_proj.weight" in str(excinfo.value)
    model = _load(copy, strict=False, seed=0)
    report = model.load_report
    assert sorted(report.names("initialized")) == ["lm_head.weight", "model.layers.1.mlp.up_proj.weight"]
    assert "strict=False" in report.provenance["lm_head.weight"].describe()
    assert torch.all(model.model.layers[0].mlp.up_proj.weight == 0.5)
    assert model.model.layers[1].mlp.up_proj.weight.std() > 0.01  # initialized, not left as memory


def test_pickle_only_refused_unless_allowed(copy):
    tensors = load_file(copy / "model.safetensors")
    (copy / "model.safetensors").unlink()
    torch.save(tensors, copy / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="pytorch_model.bin.*allow_pickle=True"):
        _load(copy)
    model = _load(copy, allow_pickle=True)
    assert all(torch.all(p == 0.5) for p in model.parameters())
    assert model.load_report.counts()["checkpoint"] == len(tensors)


def test_a_misspelt_keyword_raises_instead_of_vanishing(copy):
    from nemo_wrap import InvalidSetupError

    with pytest.raises(InvalidSetupError, match=r"unknown keyword argument\(s\) \['strit'\].*LlamaConfig"):
        _load(copy, strit=False)
    assert _load(copy, use_cache=False).config.use_cache is False  # a real config attribute overrides


def test_pickle_index_shard_escaping_the_directory(copy):
    """The pickle index gets the path check of the safetensors index, before anything is unpickled."""
    import json

    tensors = load_file(copy / "model.safetensors")
    (copy / "model.safetensors").unlink()
    torch.save(tensors, copy.parent / "outside.bin")
    weight_map = dict.fromkeys(tensors, "../outside.bin")
    (copy / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UnsafeCheckpointError, match=r"pytorch_model.bin.index.json: shard '../outside.bin'.*escapes"):
        _load(copy, allow_pickle=True)


def test_every_error_shares_one_base_class():
    for error in (CheckpointNotFoundError, CorruptCheckpointError, MissingWeightsError, RemoteRankError,
                  ShapeMismatchError, UnexpectedKeysError, UnsafeCheckpointError, UnsupportedModelError):
        assert issubclass(error, NeMoWrapError)


# -- a bad file seen by one rank stops both, within seconds --------------------------------------
def case_one_rank_sees_a_bad_file(good_path: str, bad_path: str):
    path = good_path if dist.get_rank() == 0 else bad_path
    started = time.monotonic()
    try:
        from nemo_wrap import DistributedSetup

        NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=DistributedSetup.build("fsdp2", 2), force_hf=True)
    except NeMoWrapError as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return None, "", time.monotonic() - started


def test_bad_file_on_one_rank_raises_on_both(ranks2, good, copy):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) - 100])
    (rank0_error, _, rank0_seconds), (rank1_error, rank1_message, rank1_seconds) = ranks2.run(
        case_one_rank_sees_a_bad_file, str(good), str(copy), timeout=60
    )
    assert rank1_error == "CorruptCheckpointError" and "truncated" in rank1_message
    assert rank0_error == "RemoteRankError"
    assert max(rank0_seconds, rank1_seconds) < 10


def test_remote_code_is_never_executed(copy):
    """A config asking for its own Python code is refused: trust_remote_code stays off."""
    (copy / "configuration_evil.py").write_text("raise SystemExit('remote code ran')\n")
    (copy / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"},
    }))
    with pytest.raises(UnsupportedModelError, match="config.json"):
        _load(copy)


# -- the Hugging Face cache layout: snapshot files are symlinks into the repository's blobs/ ------
def _cache_layout(hub: Path, source: Path) -> Path:
    """``source``'s files laid out as huggingface_hub caches them; returns the snapshot directory."""
    import hashlib

    repo = hub / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for file in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def test_a_sharded_model_in_the_hub_cache_loads_by_snapshot_path_and_by_id(tmp_path):
    import subprocess
    import sys

    from tests.checkpoints import write_checkpoint

    source = write_checkpoint(tmp_path / "source", "llama", "distinct", tie=False, max_shard_size="40KB")
    assert len(list(source.glob("model-*.safetensors"))) > 1
    snapshot = _cache_layout(tmp_path / "hub", source)
    model = _load(snapshot, verify=True)
    assert model.load_report.verified and model.load_report.counts()["checkpoint"] > 0
    script = "from nemo_wrap import NeMoAutoModelForCausalLM as A; print(A.from_pretrained('org/tiny', verify=True).load_report.verified)"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().endswith("True"), out.stderr[-2000:]


def test_a_symlink_out_of_the_checkpoint_or_its_blobs_is_refused(tmp_path):
    from tests.checkpoints import write_checkpoint

    source = write_checkpoint(tmp_path / "source", "llama", "half", tie=False, max_shard_size="40KB")
    snapshot = _cache_layout(tmp_path / "hub", source)
    shard = sorted(snapshot.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(UnsafeCheckpointError, match="escapes the checkpoint directory"):
        _load(snapshot)
    plain = tmp_path / "plain"
    shutil.copytree(write_checkpoint(tmp_path / "one", "llama", "half", tie=False), plain)
    (plain / "model.safetensors").rename(tmp_path / "moved.safetensors")
    (plain / "model.safetensors").symlink_to(tmp_path / "moved.safetensors")
    with pytest.raises(UnsafeCheckpointError, match="model.safetensors: resolves outside"):
        _load(plain)


# -- a stricter reader: what the reference safetensors parser refuses, and JSON that breaks Python --
def _rewrite_header(path: Path, change) -> None:
    raw = (path / "model.safetensors").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = change(raw[8 : 8 + size].decode())
    encoded = header.encode()
    (path / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + size :])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda h: h.replace('{"__metadata__":{"format":"pt"},', '{"__metadata__":{"format":1},'), "__metadata__"),
        (lambda h: '{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},' + h[1:], None),  # fine: zero-size
        (lambda h: h[:-1] + ',"model.norm.weight":' + h[h.index('"model.norm.weight":') + 20 : h.index("}", h.index('"model.norm.weight":')) + 1] + "}", "repeats the key"),
        (lambda h: "[" * 100000 + "]" * 100000, "RecursionError"),
        (lambda h: h.replace('"F32"', '["F32"]', 1), "unsupported dtype"),
    ],
    ids=["metadata-not-strings", "zero-size-tensor", "duplicate-key", "deep-nesting", "dtype-list"],
)
def test_header_defects_raise_a_corrupt_checkpoint_error_naming_the_file(copy, change, named):
    _rewrite_header(copy, change)
    if named is None:
        _load(copy, strict=False)  # a zero-size tensor is valid safetensors (unused here)
        return
    with pytest.raises(CorruptCheckpointError, match=named) as excinfo:
        _load(copy)
    assert "model.safetensors" in str(excinfo.value)


def test_bytes_after_the_last_tensor_or_an_overlap_are_refused(copy):
    (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes() + b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match=r"8 byte\(s\) after the last tensor"):
        _load(copy)


@pytest.mark.parametrize(
    ("content", "error"),
    [("not json {", CorruptCheckpointError), ("[" * 100000, CorruptCheckpointError)],
    ids=["not-json", "deep-nesting"],
)
def test_a_malformed_config_raises_naming_it(copy, content, error):
    (copy / "config.json").write_text(content)
    with pytest.raises(error, match="config.json"):
        _load(copy)


def test_a_malformed_index_raises_naming_it(copy):
    (copy / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + b"[" * 100000)
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors.index.json: index is not valid JSON"):
        _load(copy)
    (copy / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": ["x"]}}')
    with pytest.raises(CorruptCheckpointError, match="invalid shard file"):
        _load(copy)


@pytest.mark.parametrize("content", [b"not a pickle", b"", b"\x80\x04K\x01."], ids=["garbage", "empty", "an-int"])
def test_a_malformed_pickle_raises_naming_it(copy, content):
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match="pytorch_model.bin"):
        _load(copy, allow_pickle=True)


def test_a_fifo_named_by_a_pickle_index_is_refused_without_blocking(copy):
    tensors = load_file(copy / "model.safetensors")
    (copy / "model.safetensors").unlink()
    os.mkfifo(copy / "shard.bin")
    (copy / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, "shard.bin")}))
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError, match="shard.bin"):
        _load(copy, allow_pickle=True)
    assert time.monotonic() - started < 10
