"""A run saved under fsdp2 on 2 ranks resumes on another topology and continues the uninterrupted run.

Why compare with one process: a step's loss is the mean over its whole global batch, and every
data-parallel rank here takes its slice of the same global batches, so a run on any topology follows
the one-process run on those batches. A resumed run must continue it: the first loss after the
resume needs the weights restored, the second the AdamW moments and step counts too. The restored
state is also compared, tensor by tensor and in full, with what the 2-rank run saved: resharding
copies, so it must be bit-identical.

Topologies (the checkpoint's data-parallel degree is 2): fsdp2 on 4 ranks (dp 4), fsdp2 × tp on a
2×2 mesh (dp 2), HSDP on 2×2 (dp 4), tensor parallel alone on 2 ranks (dp 1), and one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint import load_checkpoint, save_checkpoint
from nemo_wrap.training import train_step
from tests.support.tiny_models import tiny_config

SEED = 1234
ROWS = 4  # rows of a global batch: every data-parallel degree here (1, 2, 4) divides it
# name: (strategy, world size, DistributedSetup.build keywords); None: one process
LAYOUTS = {
    "fsdp2-2": ("fsdp2", 2, {}),
    "fsdp2-4": ("fsdp2", 4, {}),
    "fsdp2-tp": ("fsdp2", 4, {"tp_size": 2}),
    "hsdp": ("fsdp2", 4, {"dp_replicate_size": 2}),
    "tp": ("fsdp2", 2, {"tp_size": 2}),
    "one-process": None,
}
RTOL = 1e-5


def _setup(layout: str) -> DistributedSetup | None:
    entry = LAYOUTS[layout]
    if entry is None:
        return None
    strategy, world_size, keywords = entry
    return DistributedSetup.build(strategy, world_size, **keywords)


def _build(layout: str, seed: int):
    setup = _setup(layout)
    config = tiny_config("own-llama", tie_word_embeddings=False)
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), setup


def _step(model, optimizer, setup: DistributedSetup | None, step: int) -> float:
    """One step on this data-parallel rank's rows of the global batch of ``step``."""
    rows = torch.randint(4, 257, (ROWS, 12), generator=torch.Generator().manual_seed(1000 + step))
    dp_rank, dp_size = (0, 1) if setup is None else (setup.dp_rank(), setup.dp_size)
    share = ROWS // dp_size
    batch = {"input_ids": rows[dp_rank * share : (dp_rank + 1) * share]}
    return train_step(model, optimizer, [batch], max_grad_norm=1.0).loss


def _full(value: torch.Tensor) -> torch.Tensor:
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _full_state(model, optimizer) -> dict[str, torch.Tensor] | None:
    """The whole weights and AdamW state, by name (gathered on every rank, kept on rank 0 only)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    full = {f"model.{name}": _full(value) for name, value in model_state.items()}
    for name, moments in optimizer_state["state"].items():
        full.update({f"optimizer.{name}.{key}": _full(value) for key, value in moments.items()})
    return full if not dist.is_initialized() or dist.get_rank() == 0 else None


def case_train_and_save(directory: str) -> dict:
    model, optimizer, setup = _build("fsdp2-2", SEED)
    losses = [_step(model, optimizer, setup, step) for step in (1, 2)]
    save_checkpoint(directory, model, optimizer, step=2)
    return {"losses": losses, "state": _full_state(model, optimizer)}


def case_resume(directory: str, layout: str) -> dict:
    """Build from another seed on ``layout``, load, compare the state, train steps 3 and 4."""
    model, optimizer, setup = _build(layout, SEED + 1)
    step = load_checkpoint(directory, model, optimizer)
    state = _full_state(model, optimizer)
    return {"step": step, "state": state, "losses": [_step(model, optimizer, setup, s) for s in (3, 4)]}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted run in one process: the losses of steps 1 to 4."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optimizer, setup = _build("one-process", SEED)
        return [_step(model, optimizer, setup, step) for step in (1, 2, 3, 4)]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved(ranks2, tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume_topology") / "checkpoint"
    results = ranks2.run(case_train_and_save, str(directory))
    return directory, results


def _check(result: dict, saved_state: dict[str, torch.Tensor], reference: list[float], where: str) -> None:
    assert result["step"] == 2, where
    if result["state"] is not None:  # rank 0: every weight and optimizer tensor exactly as saved
        assert result["state"].keys() == saved_state.keys(), where
        for name, tensor in saved_state.items():
            assert torch.equal(result["state"][name], tensor), (where, name)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference[2:]), rtol=RTOL, atol=0)


def test_the_saved_run_follows_the_one_process_run(saved, reference):
    _, results = saved
    for rank, result in enumerate(results):
        actual, expected = torch.tensor(result["losses"]), torch.tensor(reference[:2])
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=0, msg=f"rank {rank}")
    assert sorted(p.name for p in saved[0].iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "nemo_wrap_manifest.json",
    ]


@pytest.mark.parametrize("layout", ["fsdp2-4", "fsdp2-tp", "hsdp"])
def test_resume_on_four_ranks(ranks4, saved, reference, layout):
    directory, results = saved
    for rank, result in enumerate(ranks4.run(case_resume, str(directory), layout)):
        _check(result, results[0]["state"], reference, f"{layout}, rank {rank}")


def test_resume_under_tensor_parallel_alone(ranks2, saved, reference):
    directory, results = saved
    for rank, result in enumerate(ranks2.run(case_resume, str(directory), "tp")):
        _check(result, results[0]["state"], reference, f"tp, rank {rank}")


def test_resume_in_one_process(saved, reference, one_thread):
    directory, results = saved
    _check(case_resume(str(directory), "one-process"), results[0]["state"], reference, "one process")
