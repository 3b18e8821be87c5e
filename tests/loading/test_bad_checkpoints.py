"""Bad input: a specific error naming the file, key or argument — on every rank, never a hang."""

from __future__ import annotations

import json
import os
import shutil
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
from tests.support.checkpoints import write_checkpoint


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


@pytest.fixture(params=["sharded", "single-file"])
def hub(request, tmp_path) -> Path:
    """A hub cache holding ``org/tiny`` (distinct values), sharded or in one file."""
    shard_size = "40KB" if request.param == "sharded" else None
    source = write_checkpoint(tmp_path / "source", "llama", "distinct", tie=False, max_shard_size=shard_size)
    assert (len(list(source.glob("*.safetensors"))) > 1) == (shard_size is not None)
    _cache_layout(tmp_path / "hub", source)
    return tmp_path / "hub"


def _snapshot(hub: Path) -> Path:
    return next((hub / "models--org--tiny" / "snapshots").iterdir())


def _expected(hub: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _snapshot(hub).glob("*.safetensors"):
        tensors.update(load_file(file))
    return tensors


def test_a_cached_model_loads_by_snapshot_path_and_by_hub_id(hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    expected = _expected(hub)
    for path in (_snapshot(hub), "org/tiny"):
        model = _load(path, verify=True)
        assert model.load_report.verified
        assert all(torch.equal(p, expected[name]) for name, p in model.state_dict().items())


def case_load_from_the_hub_cache(hub: str, snapshot: str) -> list[tuple[bool, int]]:
    """fsdp2 on every rank, by snapshot path and by hub id: verified, and this rank's bytes read."""
    import huggingface_hub.constants as constants

    from nemo_wrap import DistributedSetup

    saved = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = hub, True
    try:
        setup = DistributedSetup.build("fsdp2", dist.get_world_size())
        models = [_load(path, distributed_setup=setup, verify=True) for path in (snapshot, "org/tiny")]
    finally:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = saved
    return [(m.load_report.verified, m.load_report.bytes_read) for m in models]


def test_a_cached_model_loads_under_fsdp2_on_2_ranks(ranks2, hub):
    total = sum(t.numel() * 4 for t in _expected(hub).values())
    results = ranks2.run(case_load_from_the_hub_cache, str(hub), str(_snapshot(hub)), timeout=120)
    for rank in results:
        assert [verified for verified, _ in rank] == [True, True]
    assert sum(rank[0][1] for rank in results) == total  # each rank read its own rows, once


def test_a_symlink_out_of_the_checkpoint_or_its_blobs_is_refused(tmp_path):
    from tests.support.checkpoints import write_checkpoint

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


def test_a_zero_size_tensor_is_valid_safetensors(copy):
    tensors = load_file(copy / "model.safetensors")
    save_file({**tensors, "extra.empty": torch.zeros(0)}, copy / "model.safetensors", metadata={"format": "pt"})
    model = _load(copy, strict=False)
    assert model.load_report.unexpected_keys == ("extra.empty",)
    assert all(torch.all(p == 0.5) for p in model.parameters())
