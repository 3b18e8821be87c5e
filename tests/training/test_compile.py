"""``compile=True``: each decoder layer runs compiled, and training is that of the eager model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import InvalidSetupError
from tests.support.checkpoints import write_checkpoint

IDS = torch.arange(2 * 16).reshape(2, 16) * 5 % 257


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("compile") / "llama", "own-llama", "distinct", tie=False))


def _losses(path: str, compile_layers: bool, setup: DistributedSetup | None = None) -> dict:
    """Three AdamW steps; the losses, and whether the layers ran as one compiled graph."""
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, compile=compile_layers).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counters.clear()
    losses = []
    for _ in range(3):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers]
    return {
        "losses": losses,
        "compiled_layers": compiled,
        "graphs": counters["stats"]["unique_graphs"],
        "plan": str(model.load_report.plan),
    }


def test_compiled_layers_train_like_eager_ones_in_one_process(checkpoint):
    eager, compiled = _losses(checkpoint, False), _losses(checkpoint, True)
    assert not any(eager["compiled_layers"]) and eager["graphs"] == 0
    assert all(compiled["compiled_layers"]) and compiled["graphs"] >= 1  # the layers share their graphs
    assert "compile each decoder layer with torch.compile" in compiled["plan"]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)


def test_compile_with_tensor_parallel_is_refused_before_loading(checkpoint):
    with pytest.raises(InvalidSetupError, match=r"compile=True does not compose with tp_size=2"):
        NeMoAutoModelForCausalLM.plan(checkpoint, DistributedSetup.build("fsdp2", 2, tp_size=2), compile=True)


def case_compiled(path: str, strategy: str) -> tuple[dict, dict]:
    setup = DistributedSetup.build(strategy, dist.get_world_size())
    return _losses(path, False, setup), _losses(path, True, setup)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_compiled_layers_train_like_eager_ones_on_2_ranks(ranks2, checkpoint, strategy):
    for eager, compiled in ranks2.run(case_compiled, checkpoint, strategy):
        assert all(compiled["compiled_layers"]) and compiled["graphs"] >= 1
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
