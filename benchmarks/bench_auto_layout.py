"""``plan --auto`` against reality: six CPU scenarios, each with a device-memory budget that the plain
fsdp2 layout exceeds. ``choose_layout`` picks the cheapest layout predicted to fit; that layout then
runs for real (fresh torchrun jobs on gloo ranks) and torch's ``MemTracker`` measures every rank's
tensor peak over the second of two steps, which must stay under the budget. The last scenario's
budget is one nothing meets: there the smallest candidate runs, and must exceed it.

Models: SmolLM2-135M's shape (30 layers, 9 heads: tensor parallel over 2 or 4 is refused), and a
30M-class Llama (4 layers, hidden 512, vocabulary 8,192). Goal: every chosen layout under its
budget on every rank; the impossible budget exceeded by the smallest candidate.
Run: ``python -m benchmarks.bench_auto_layout``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.bench_memory import llama_30m, load_options
from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_auto_layout"
_MIB = 2**20
_LAYOUT_VARIABLE = "BENCH_AUTO_LAYOUT"


@dataclass(frozen=True)
class Scenario:
    """A model, a machine, a job (rows per step of ``seq_len`` tokens, LoRA or not) and the device
    memory as a share of the plain fsdp2 layout's predicted peak (below 0.9: plain is over)."""

    label: str
    model: str  # smollm2 | llama30m
    nproc_per_node: int
    nnodes: int
    global_batch: int
    seq_len: int
    budget_share: float
    lora: bool = False

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


SCENARIOS = {
    "smollm2": Scenario("SmolLM2-135M shape, 4 ranks, 8 × 256 tokens", "smollm2", 4, 1, 8, 256, 0.8),
    "two_ranks": Scenario("30M, 2 ranks, 8 × 512 tokens", "llama30m", 2, 1, 8, 512, 0.6),
    "two_nodes": Scenario("30M, 2 nodes × 2 ranks, 16 × 256 tokens", "llama30m", 2, 2, 16, 256, 0.7),
    "long": Scenario("30M, 2 ranks, 2 × 4096 tokens", "llama30m", 2, 1, 2, 4096, 0.6),
    "lora": Scenario("30M with LoRA r 16, 2 ranks, 8 × 512 tokens", "llama30m", 2, 1, 8, 512, 0.5, lora=True),
    "impossible": Scenario("30M, 2 ranks, 8 × 512 tokens, nothing fits", "llama30m", 2, 1, 8, 512, 0.2),
}


def _config(model: str) -> Any:
    from transformers import LlamaConfig

    if model == "smollm2":
        return LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
    return llama_30m(tied=False)


def _options(scenario: Scenario) -> Any:
    return load_options(scenario.lora)


def measure(kind: str) -> dict[str, Any]:
    """This rank's tensor peak in the second of two real steps of the layout in the environment."""
    import torch

    from nemo_wrap import initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.memory import Layout
    from nemo_wrap.memory.tracking import second_step_peak
    from nemo_wrap.training import train_step

    scenario = SCENARIOS[kind]
    layout = Layout(**json.loads(os.environ[_LAYOUT_VARIABLE]))
    initialize_distributed()
    model = NeMoAutoModelForCausalLM.from_config(
        _config(scenario.model), layout.setup(scenario.world_size), options=_options(scenario)
    )
    if layout.activation_checkpointing:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.vocab_size
    rows = torch.randint(0, vocab, (layout.micro_batch, scenario.seq_len), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": rows}] * layout.accumulation
    peak = second_step_peak(model, optimizer, batches, lambda given: train_step(model, optimizer, given))
    return {"peak": peak["Total"]}


def table() -> Table:
    result = Table(
        "`plan --auto`: the chosen layout run for real",
        ["budget (MiB)", "plain fsdp2 predicted", "chosen layout", "predicted", "measured, per rank", "search"],
    )
    for kind, scenario in SCENARIOS.items():
        result.rows.append(_row(kind, scenario))
    result.note = (
        "Budget: the device memory less the 10% margin `--auto` keeps for what is not counted. Measured: "
        "torch's MemTracker over the second of two real steps of the layout (fresh torchrun jobs, gloo; two "
        "nodes run as four local ranks). Where nothing fits, the smallest candidate is run instead (in italics). "
        "Search: the wall time of `choose_layout`, its dry runs included."
    )
    return result


def _row(kind: str, scenario: Scenario) -> list[str]:
    from nemo_wrap.memory import Layout, Machine, choose_layout, predict_memory

    config, options = _config(scenario.model), _options(scenario)
    plain = Layout("fsdp2", scenario.global_batch // scenario.world_size, 1)
    plain_peak = predict_memory(config, plain.setup(scenario.world_size), plain.shape(scenario.seq_len), options)
    device_memory = int(plain_peak.peak_bytes * scenario.budget_share)
    machine = Machine(scenario.nproc_per_node, device_memory, scenario.nnodes)
    started = time.perf_counter()
    choice = choose_layout(config, machine, scenario.global_batch, scenario.seq_len, options)
    search = time.perf_counter() - started
    run = choice.chosen or choice.smallest
    if run is None or run.peak_bytes is None:
        return [scenario.label, f"{choice.budget / _MIB:.1f}", "", "every layout refused", "", "", f"{search:.0f} s"]
    environment = {_LAYOUT_VARIABLE: json.dumps(dataclasses.asdict(run.layout))}
    measured = [row["peak"] for row in run_measure(MODULE, kind, scenario.world_size, env=environment)]
    under = all(peak <= choice.budget for peak in measured)
    verdict = ("under" if under else "OVER") if choice.chosen else ("over, as said" if not under else "UNDER")
    name = run.layout.describe() if choice.chosen else f"*{run.layout.describe()}*"
    return [
        scenario.label,
        f"{choice.budget / _MIB:.1f}",
        f"{plain_peak.peak_bytes / _MIB:.1f}",
        name,
        f"{run.peak_bytes / _MIB:.1f}",
        f"{' / '.join(f'{peak / _MIB:.1f}' for peak in measured)} ({verdict})",
        f"{search:.0f} s",
    ]


if __name__ == "__main__":
    measure_main(measure, table)
