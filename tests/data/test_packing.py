"""A packed row computes what its examples compute one by one — in train mode, default arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.data import LabelledExample, pack_examples
from nemo_wrap.training import train_step
from tests.support.tiny_models import tiny_config

LENGTHS = (5, 7, 4)


def _examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(4, 257, (n,), generator=generator) for n in LENGTHS]


def _packed(examples: list[torch.Tensor], padding: int = 0) -> dict[str, torch.Tensor]:
    """One row packed by the library: the examples side by side (then ``padding`` pad tokens)."""
    labelled = [LabelledExample(tuple(e.tolist()), tuple(e.tolist())) for e in examples]
    rows = pack_examples(labelled, max_length=sum(LENGTHS) + padding, pad_token_id=0)
    assert len(rows) == 1 and rows[0]["position_ids"][0, LENGTHS[0]] == 0
    return rows[0]


def _compare(model, padding: int = 0) -> tuple[float, float, float]:
    """Max logit difference, and the packed and one-by-one mean token losses (train mode)."""
    model.train()
    examples = _examples()
    batch = _packed(examples, padding)
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    logits = packed.logits[0]
    start, difference, loss_sum = 0, 0.0, 0.0
    for example in examples:
        alone = model(input_ids=example.unsqueeze(0), labels=example.unsqueeze(0))
        difference = max(difference, float((logits[start : start + len(example)] - alone.logits[0]).abs().max()))
        loss_sum += float(alone.loss) * (len(example) - 1)
        start += len(example)
    packed_loss = float(model(**batch).loss)
    return difference, packed_loss, loss_sum / sum(n - 1 for n in LENGTHS)


KINDS = [("own-llama", False), ("own-qwen3", False), ("llama", True)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random weights large enough (std 0.15) that attending across examples moves the logits by ~6."""
    root = tmp_path_factory.mktemp("packing")
    for kind, _ in KINDS:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config(kind, initializer_range=0.15)).save_pretrained(root / kind)
    return {kind: root / kind for kind, _ in KINDS}


@pytest.mark.parametrize(("kind", "force_hf"), KINDS, ids=[k for k, _ in KINDS])
def test_a_packed_row_equals_its_examples_in_one_process(checkpoints, kind, force_hf):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoints[kind], force_hf=force_hf)
    assert model.config.use_cache  # the default that used to create a cache and leak across examples
    difference, packed_loss, expected_loss = _compare(model)
    assert difference < 1e-5
    assert packed_loss == pytest.approx(expected_loss, rel=1e-5)
    batch = _packed(_examples())  # the test can fail: with a cache, transformers' mask ignores the packing
    leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0, 5:12]
    alone = model(input_ids=_examples()[1].unsqueeze(0)).logits[0]
    assert (leaky - alone).abs().max() > 1.0
    difference, packed_loss, expected_loss = _compare(model, padding=6)  # a padded row learns the same
    assert difference < 1e-5 and packed_loss == pytest.approx(expected_loss, rel=1e-5)


def case_packed_row(path: str, force_hf: bool, tp: int) -> tuple[float, float, float]:
    setup = DistributedSetup.build("fsdp2", dist.get_world_size(), tp_size=tp)
    return _compare(NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, force_hf=force_hf))


@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "tp2"])
@pytest.mark.parametrize(("kind", "force_hf"), KINDS, ids=[k for k, _ in KINDS])
def test_a_packed_row_equals_its_examples_on_2_ranks(ranks2, checkpoints, kind, force_hf, tp):
    for difference, packed_loss, expected_loss in ranks2.run(case_packed_row, str(checkpoints[kind]), force_hf, tp):
        assert difference < 1e-5
        assert packed_loss == pytest.approx(expected_loss, rel=1e-5)


def test_train_step_keeps_position_ids(checkpoints):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoints["own-llama"])
    batch = _packed(_examples())
    _, _, expected_loss = _compare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    assert train_step(model, optimizer, [batch]).loss == pytest.approx(expected_loss, rel=1e-5)
