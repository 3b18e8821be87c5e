"""Bad input: a specific error naming the file, key or argument — on every rank, never a hang."""

from __future__ import annotations

import json
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
