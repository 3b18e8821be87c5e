"""Data-parallel batches over labelled rows: once per epoch, resumable exactly, evaluated like one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint.resume import load_checkpoint, save_checkpoint
from nemo_wrap.data import DataParallelBatches, LabelledExample, as_rows
from nemo_wrap.training import evaluate, train_step
from tests.support.checkpoints import write_checkpoint

ROW_LENGTH = 24


def _examples(count: int = 13) -> list[LabelledExample]:
    generator = torch.Generator().manual_seed(0)
    examples = []
    for index in range(count):
        ids = torch.randint(4, 257, (int(torch.randint(5, 12, (1,), generator=generator)),), generator=generator)
        ids[0] = index + 4  # a row's first token tells which example it is
        labels = [-100] * 2 + ids[2:].tolist()  # a "prompt" of two tokens
        examples.append(LabelledExample(tuple(ids.tolist()), tuple(labels)))
    return examples


def test_every_row_once_per_epoch_and_equal_steps_per_rank():
    rows = as_rows(_examples(), ROW_LENGTH, pad_token_id=0, pack=False)
    for ranks in (1, 2, 4):
        seen = []
        for rank in range(ranks):
            batches = DataParallelBatches(rows, micro_batch_size=2, seed=3, dp_rank=rank, dp_size=ranks)
            steps = batches.rest_of_epoch()
            assert len(steps) == batches.steps_per_epoch == batches.state_dict()["step_in_epoch"]
            seen += [int(first) for step in steps for mb in step for first in mb["input_ids"][:, 0] if first]
        assert sorted(seen) == [i + 4 for i in range(13)]


def case_train_and_resume(path: str, directory: str, rows) -> tuple[list[float], list[float]]:
    """Six steps uninterrupted (a checkpoint after three), then three steps resumed from it."""
    setup = DistributedSetup.build("fsdp2", dist.get_world_size())

    def start():
        model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = DataParallelBatches(rows, 2, seed=7, dp_rank=dist.get_rank(), dp_size=2, accumulation=2)
        return model, optimizer, batches

    model, optimizer, batches = start()
    steps = iter(batches)
    uninterrupted = []
    for step in range(6):  # 2 steps per epoch here: the checkpoint falls mid-epoch
        if step == 3:
            save_checkpoint(directory, model, optimizer, step, data=batches)
        uninterrupted.append(train_step(model, optimizer, next(steps)).loss)
    model, optimizer, batches = start()
    assert load_checkpoint(directory, model, optimizer, data=batches) == 3
    steps = iter(batches)
    return uninterrupted[3:], [train_step(model, optimizer, next(steps)).loss for _ in range(3)]


def test_a_run_resumed_mid_epoch_reproduces_the_uninterrupted_losses_on_2_ranks(ranks2, tmp_path):
    path = write_checkpoint(tmp_path / "base", "own-llama", "distinct", tie=False)
    rows = as_rows(_examples(), ROW_LENGTH, pad_token_id=0, pack=True)
    for uninterrupted, resumed in ranks2.run(case_train_and_resume, str(path), str(tmp_path / "ckpt"), rows):
        assert resumed == uninterrupted  # exactly: the same batches and the same state


def case_evaluate(path: str, rows) -> float:
    setup = DistributedSetup.build("fsdp2", dist.get_world_size())
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup)
    batches = DataParallelBatches(rows, micro_batch_size=3, seed=0, dp_rank=dist.get_rank(), dp_size=2)
    return evaluate(model, [mb for step in batches.rest_of_epoch() for mb in step])


def test_evaluation_on_2_ranks_equals_one_process(ranks2, tmp_path):
    path = write_checkpoint(tmp_path / "base", "own-llama", "distinct", tie=False)
    rows = as_rows(_examples(), ROW_LENGTH, pad_token_id=0, pack=False)  # unequal token counts per row
    expected = evaluate(NeMoAutoModelForCausalLM.from_pretrained(path), rows)
    values = ranks2.run(case_evaluate, str(path), rows)
    assert values[0] == values[1] == pytest.approx(expected, rel=1e-6)


def test_a_data_position_from_other_data_is_refused():
    from nemo_wrap.errors import TrainingDataError

    rows = as_rows(_examples(), ROW_LENGTH, pad_token_id=0, pack=False)
    state = DataParallelBatches(rows, 2, seed=7).state_dict()
    with pytest.raises(TrainingDataError, match="seed 7 over 13 rows"):
        DataParallelBatches(rows[:-1], 2, seed=7).load_state_dict(state)


def case_rows_seen_in_one_epoch(rows) -> list[int]:
    batches = DataParallelBatches(rows, micro_batch_size=2, seed=3, dp_rank=dist.get_rank(), dp_size=2)
    steps = batches.rest_of_epoch()
    return [int(first) for step in steps for mb in step for first in mb["input_ids"][:, 0] if first]


def test_every_row_once_per_epoch_on_2_ranks(ranks2):
    rows = as_rows(_examples(), ROW_LENGTH, pad_token_id=0, pack=False)
    seen = ranks2.run(case_rows_seen_in_one_epoch, rows)
    assert sorted(seen[0] + seen[1]) == [i + 4 for i in range(13)] and not set(seen[0]) & set(seen[1])
