"""What ``plan --auto`` picks at real scale, from the configs alone (no weights), for the jobs the
published layouts of ``bench_published_layouts`` run: the same model, GPUs, rows per step, tokens
and precision, with the layout left to ``choose_layout``. The table sets its choice beside the
published one, with the predicted peak and the cost model's step overhead of each.

The budget is the named GPU's memory less the 10% margin ``--auto`` keeps. Deep models and
pipeline stages are dry-run at depths 4 and 5 and extrapolated, long 1F1B steps at P + 1 and P + 2
micro-batches, as every prediction is. Goal: a choice that fits for every job; where it differs
from the published layout, the table shows which is cheaper by the cost model (communication and
recomputation; the cost model does not know float8, torch.compile or interleaved schedules).
Run: ``python -m benchmarks --only auto_at_scale``. Slow on 2 cores, about a minute a dry run: the
8B job's search took 500 s, the Qwen3-30B-A3B job's 56 minutes (52 dry runs); the jobs of 32 to
128 GPUs have hundreds of degree combinations and take hours.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks.bench_published_layouts import GIB, MODELS, PUBLISHED, Published
from benchmarks.common import Table


@dataclass(frozen=True)
class Job:
    """A published layout's job: its model, machine and rows per step, laid out by ``--auto``."""

    published: Published
    nproc_per_node: int = 8

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step over every data-parallel rank, as the published layout runs them."""
        layout = self.published
        return layout.rows * layout.micro_batches * layout.data_parallel


def _job(model: str, degrees: str) -> Job:
    return Job(next(layout for layout in PUBLISHED if layout.model == model and layout.degrees() == degrees))


JOBS = [
    _job("Llama-3-8B", "fsdp 8"),
    _job("Qwen3-30B-A3B", "fsdp 8 × ep 8"),
    _job("Llama-3-70B", "fsdp 8 × tp 8 (sequence parallel)"),
    _job("Mixtral-8x7B", "fsdp 4 × pp 8"),
    _job("Llama-3.1-405B", "fsdp 16 × tp 8 (sequence parallel)"),
]


def _row(job: Job) -> list[str]:
    from nemo_wrap.memory import Machine, choose_layout

    layout = job.published
    nodes = max(1, layout.gpus // job.nproc_per_node)
    machine = Machine(min(layout.gpus, job.nproc_per_node), layout.device_gib * GIB, nodes)
    started = time.perf_counter()
    choice = choose_layout(MODELS[layout.model](), machine, job.global_batch, layout.seq_len, layout.options())
    seconds = time.perf_counter() - started
    dry_runs = sum(candidate.peak_bytes is not None for candidate in choice.candidates)
    chosen = choice.chosen
    picked = "nothing fits" if chosen is None else chosen.layout.describe()
    peak = "–" if chosen is None or chosen.peak_bytes is None else f"{chosen.peak_bytes / GIB:.1f}"
    cost = "–" if chosen is None else chosen.cost.describe()
    job_text = f"{job.global_batch} × {layout.seq_len}, {layout.precision}"
    print(layout.model, picked, peak, f"{seconds:.0f} s", flush=True)
    published = layout.degrees()
    return [layout.model, layout.hardware, job_text, published, picked, peak, cost, f"{dry_runs}", f"{seconds:.0f}"]


def table() -> Table:
    result = Table(
        "--auto at real scale",
        ["model", "hardware", "rows × tokens a step", "published", "--auto picks", "its peak GiB",
         "its step overhead", "dry runs", "search s"],
    )  # fmt: skip
    result.rows = [_row(job) for job in JOBS]
    result.note = (
        "`choose_layout` on the model's config with the published job (rows per step over all data-parallel ranks, "
        "tokens, precision, LoRA) and machine (nodes of 8 GPUs of the named memory, 80 GiB where none is named), "
        "budget 90% of it. Step overhead: the cost model's communication and recomputation per step "
        "(docs/how-to/memory.md); not the step time. Search s: seconds on this machine, every dry run included."
    )
    return result


if __name__ == "__main__":
    print(table().markdown())
