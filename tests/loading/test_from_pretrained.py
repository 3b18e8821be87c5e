"""from_pretrained: every local shard holds the checkpoint, read once, audited — or it fails loudly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.state_dict import checkpoint_tensors
from tests.support.checkpoints import write_checkpoint
from tests.support.shards import local_bytes

STRATEGIES = [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)]
STRATEGY_IDS = ["ddp", "fsdp2", "tp2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for values in ("half", "distinct"):
        for tie in (True, False):
            made[(values, tie)] = str(write_checkpoint(root / f"llama-{values}-{'tied' if tie else 'untied'}", "llama", values, tie))
    made["sharded"] = str(write_checkpoint(root / "llama-sharded", "llama", "distinct", False, max_shard_size="100KB"))
    return made


def _hf_full_state(path: str, model) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the model's own key layout (through its adapter if fused)."""
    from pathlib import Path

    hf = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        hf.update(load_file(file))
    adapter = model.state_dict_adapter()
    return adapter.from_hf(hf) if hasattr(adapter, "from_hf") else hf


def _shard_mismatches(model, expected: dict[str, torch.Tensor]) -> list[str]:
    distinct, _ = checkpoint_tensors(model)
    wrong = []
    for name, tensor in distinct.items():
        geometry = shard_geometry(tensor, name)
        if geometry.is_empty:
            continue
        want = expected[name][torch.meshgrid(*geometry.dim_indices, indexing="ij")]
        if not torch.equal(local_shard(tensor).detach(), want.to(tensor.dtype)):
            wrong.append(name)
    return wrong


def case_load(path, strategy, tp_size, force_hf, tokens):
    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, force_hf=force_hf)
    report = model.load_report
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return dict(
        counts=report.counts(),
        mismatches=_shard_mismatches(model, _hf_full_state(path, model)),
        bytes_read=report.bytes_read,
        local_bytes=local_bytes(model),
        logits=logits,
        is_fused_class=isinstance(model, NeMoCausalLM),
        plan_says_custom=report.plan.is_custom,
    )


TOKENS = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(5))


def _transformers_logits(path: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("force_hf", [False, True], ids=["custom", "hf"])
@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES, ids=STRATEGY_IDS)
def test_uniform_checkpoint_every_shard_is_half(ranks2, checkpoints, strategy, tp_size, force_hf, tie):
    """The field's reproduction: weights all 0.5 must arrive as 0.5, everywhere, never random."""
    for result in ranks2.run(case_load, checkpoints[("half", tie)], strategy, tp_size, force_hf, TOKENS):
        assert result["is_fused_class"] is result["plan_says_custom"] is (not force_hf)
        assert result["mismatches"] == []
        assert result["counts"]["initialized"] == 0 and result["counts"]["missing"] == 0
        assert result["counts"]["tied"] == (1 if tie else 0)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("force_hf", [False, True], ids=["custom", "hf"])
@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES, ids=STRATEGY_IDS)
def test_distinct_checkpoint_shards_at_their_offsets_and_logits_match(ranks2, checkpoints, strategy, tp_size, force_hf, tie):
    path = checkpoints[("distinct", tie)]
    expected_logits = _transformers_logits(path)
    results = ranks2.run(case_load, path, strategy, tp_size, force_hf, TOKENS)
    for result in results:
        assert result["mismatches"] == []
        torch.testing.assert_close(result["logits"], expected_logits, atol=1e-5, rtol=0)
        # read exactly once: each rank read the bytes of its own shards, no more, no less
        assert result["bytes_read"] == result["local_bytes"]
    if strategy == "fsdp2" and tp_size == 1:
        total = sum(t.numel() * t.element_size() for t in load_file(f"{path}/model.safetensors").values())
        assert sum(r["bytes_read"] for r in results) == total  # every byte read once, job-wide


def test_sharded_index_checkpoint_loads_in_one_process(checkpoints):
    path = checkpoints["sharded"]
    model = NeMoAutoModelForCausalLM.from_pretrained(path, force_hf=True)
    assert len(model.load_report.plan.steps) == 5
    assert _shard_mismatches(model, _hf_full_state(path, model)) == []
    files = {p.files[0] for p in model.load_report.provenance.values() if p.kind == "checkpoint"}
    assert len(files) > 1, "the fixture must really be split over several files"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=TOKENS).logits, _transformers_logits(path), atol=1e-5, rtol=0)


def case_verify(path, strategy, tp_size, corrupt_rank):
    from nemo_wrap.errors import LoadVerificationError

    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, force_hf=True, verify=True)
    verified = model.load_report.verified
    # Now damage one rank's shards and verify again: it must be caught everywhere. One bit of one
    # element flipped in one tensor; two unequal elements of another swapped (same values, wrong place).
    from pathlib import Path

    import torch.distributed as dist

    from nemo_wrap.checkpoint.locate import open_checkpoint
    from nemo_wrap.distributed.collectives import RankGroup
    from nemo_wrap.loading.verify import verify_load

    flipped = local_shard(model.model.layers[1].self_attn.o_proj.weight).view(-1)
    swapped = local_shard(model.model.layers[0].mlp.down_proj.weight).view(-1)
    if dist.get_rank() == corrupt_rank:
        with torch.no_grad():
            flipped.view(torch.int32)[3] ^= 1
            assert swapped[0] != swapped[1]
            swapped[[0, 1]] = swapped[[1, 0]].clone()
    distinct, _ = checkpoint_tensors(model)
    try:
        checkpoint = open_checkpoint(Path(path))
        verify_load(distinct, model.load_report.provenance, model.state_dict_adapter(), checkpoint, RankGroup.job())
    except LoadVerificationError as error:
        return verified, str(error)
    return verified, None


def case_loader_misplaces_values(path, strategy, tp_size, sabotaged_rank):
    """The loader itself goes wrong on one rank (two values of one tensor land in each other's place,
    one bit of another flips) while ``verify`` takes its checkpoint side during that same read:
    every rank must still raise, naming both tensors. Returns (error, checksums taken while reading)."""
    import torch.distributed as dist

    from nemo_wrap.auto import pipeline
    from nemo_wrap.errors import LoadVerificationError
    from nemo_wrap.loading import read

    def sabotaged(name, tensor, reading):
        found = original(name, tensor, reading)
        local = local_shard(tensor).detach().view(-1)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == sabotaged_rank and local.numel() > 1:
            if name == "model.layers.0.mlp.down_proj.weight":
                local[[0, 1]] = local[[1, 0]].clone()
            elif name == "model.layers.1.self_attn.o_proj.weight":
                local.view(torch.int32)[3] ^= 1
        return found

    taken = []
    original, read._read_one = read._read_one, sabotaged
    original_verify = pipeline.verify_load

    def spy(*args):
        taken.append(len(args[-1]))
        return original_verify(*args)

    pipeline.verify_load = spy
    setup = None if strategy is None else DistributedSetup.build(strategy, 2, tp_size=tp_size)
    try:
        NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, force_hf=True, verify=True)
    except LoadVerificationError as error:
        return str(error), taken
    finally:
        read._read_one, pipeline.verify_load = original, original_verify
    return None, taken


def test_verify_taken_while_reading_catches_a_loader_that_misplaces_values(checkpoints):
    error, taken = case_loader_misplaces_values(checkpoints[("distinct", False)], None, 1, 0)
    assert error is not None and "2 tensor(s) differ" in error
    assert "model.layers.1.self_attn.o_proj.weight" in error and "model.layers.0.mlp.down_proj.weight" in error
    assert taken and taken[0] > 10  # one process: every tensor's checkpoint side was taken during the read


@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES, ids=STRATEGY_IDS)
def test_verify_while_reading_on_2_ranks_catches_one_rank_s_loader(ranks2, checkpoints, strategy, tp_size):
    results = ranks2.run(case_loader_misplaces_values, checkpoints[("distinct", False)], strategy, tp_size, 1)
    for error, taken in results:
        assert error is not None and "2 tensor(s) differ" in error
        assert "model.layers.1.self_attn.o_proj.weight" in error and "model.layers.0.mlp.down_proj.weight" in error
    assert all(t[0] > 0 for _, t in results)  # each rank took its share of the checksums while reading


@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES, ids=STRATEGY_IDS)
def test_verify_proves_the_load_and_catches_a_damaged_shard(ranks2, checkpoints, strategy, tp_size):
    for verified, error in ranks2.run(case_verify, checkpoints[("distinct", False)], strategy, tp_size, 1):
        assert verified is True
        assert error is not None and "2 tensor(s) differ" in error
        assert "model.layers.1.self_attn.o_proj.weight" in error and "model.layers.0.mlp.down_proj.weight" in error


def test_hub_id_resolves_through_a_prepopulated_offline_cache(checkpoints, tmp_path):
    """A hub id, no network: huggingface_hub's cache layout, HF_HUB_OFFLINE=1, a fresh process."""
    import os
    import shutil
    import subprocess
    import sys

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(checkpoints[("half", False)], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    script = (
        "from nemo_wrap.auto import NeMoAutoModelForCausalLM\n"
        "m = NeMoAutoModelForCausalLM.from_pretrained('tiny-org/tiny-llama', force_hf=True)\n"
        "print(m.load_report.counts()['checkpoint'], all(bool((p == 0.5).all()) for p in m.parameters()))\n"
    )
    environment = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split() == ["21", "True"]  # 2 layers × 9 + embedding + norm + untied lm_head
    environment["HF_HUB_CACHE"] = str(tmp_path / "empty")
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment, timeout=120)
    assert completed.returncode != 0 and "CheckpointNotFoundError" in completed.stderr
    assert "tiny-org/tiny-llama" in completed.stderr


def test_report_summary_is_logged_once(checkpoints, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="nemo_wrap"):
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoints[("half", True)])
    summaries = [r.getMessage() for r in caplog.records if r.name == "nemo_wrap" and "load report" in r.getMessage()]
    assert summaries == [model.load_report.summary()]
    assert "15 tensors — 14 checkpoint, 1 tied" in summaries[0]  # our fused Llama: 2 × 6 + embedding + norm
