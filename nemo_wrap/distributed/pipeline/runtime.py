"""What a loaded pipeline stage needs at run time: its groups, and torch's stage and schedules.

The engine is torch's (``torch.distributed.pipelining``): a ``PipelineStage`` over the stage's
:class:`~nemo_wrap.distributed.pipeline.stage_model.PipelineStageModule` and a ``ScheduleGPipe`` or
``Schedule1F1B``. torch infers the tensors that travel between stages on a schedule's first step
and keeps them, so one schedule is kept per micro-batch shape (and per train/eval). Where they are
declared instead (:class:`StageTensors`: the memory prediction's dry run, whose fake process group
carries no inference), torch takes them as given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from nemo_wrap.distributed.collectives import collective_device
from nemo_wrap.distributed.pipeline.layout import PipelineSchedule, StageLayout
from nemo_wrap.distributed.pipeline.stage_model import PipelineStageModule

_SCHEDULE_CLASSES = {PipelineSchedule.GPIPE: ScheduleGPipe, PipelineSchedule.ONE_F_ONE_B: Schedule1F1B}
LossFunction = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class StageTensors:
    """What travels between stages, declared: hidden states of ``hidden_size`` in ``dtype`` between
    every two stages; the last stage's output is its chunked loss sum (one fp32 value) when
    ``chunked_loss``, else the logits over ``vocab_size``."""

    hidden_size: int
    dtype: torch.dtype
    vocab_size: int
    chunked_loss: bool

    def of_stage(self, layout: StageLayout, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's input and output for micro-batches of ``rows × tokens``, as meta tensors."""
        hidden = torch.empty(rows, tokens, self.hidden_size, dtype=self.dtype, device="meta", requires_grad=True)
        ids = torch.empty(rows, tokens, dtype=torch.long, device="meta")
        inputs = ids if layout.is_first else hidden
        if not layout.is_last:
            return inputs, hidden
        shape = (1,) if self.chunked_loss else (rows, tokens, self.vocab_size)
        output = torch.empty(shape, dtype=torch.float32 if self.chunked_loss else self.dtype, device="meta")
        return inputs, output.requires_grad_()


@dataclass
class PipelineRuntime:
    """One rank's stage: where it sits, who it talks to, and the schedules that drive it.

    - ``stage_ranks``: the global ranks of every stage (index = stage), each listed in mesh order;
    - ``group``: this rank's ``pp`` group (one rank per stage, same data);
    - ``stage_group``: the ranks of this rank's stage (they shard the stage's tensors among them);
    - ``tie_group``: the first and last stage's ranks at this mesh position, when the LM head is the
      tied input embedding (their gradients for it are summed), else ``None``.
    """

    schedule: PipelineSchedule
    module: PipelineStageModule
    stage_ranks: tuple[tuple[int, ...], ...]
    group: dist.ProcessGroup
    stage_group: dist.ProcessGroup
    tie_group: dist.ProcessGroup | None
    declared: StageTensors | None = None
    _schedules: dict[tuple, PipelineScheduleSingle] = field(default_factory=dict, repr=False)

    @property
    def layout(self) -> StageLayout:
        """What this stage holds (its module's layout)."""
        return self.module.layout

    def schedule_for(
        self, shape: tuple[int, ...], micro_batches: int, loss_fn: LossFunction | None
    ) -> PipelineScheduleSingle:
        """The schedule for micro-batches of ``shape``: training (``loss_fn``) or forward-only."""
        key = (shape, micro_batches, loss_fn is None)
        if key not in self._schedules:
            device = collective_device()
            inputs, outputs = (None, None) if self.declared is None else self.declared.of_stage(self.layout, *shape)
            index, stages = self.layout.index, self.layout.stages
            stage = PipelineStage(self.module, index, stages, device, inputs, outputs, group=self.group)
            name = self.schedule if loss_fn is not None else PipelineSchedule.GPIPE
            self._schedules[key] = _SCHEDULE_CLASSES[name](stage, micro_batches, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]


def build_runtime(
    module: PipelineStageModule,
    schedule: PipelineSchedule | str,
    mesh_ranks: torch.Tensor,
    pp_group: dist.ProcessGroup,
    tied: bool,
) -> PipelineRuntime:
    """Create the stage's groups (collectively: every rank creates every group, in one order)."""
    stages = mesh_ranks.shape[0]
    per_stage = [tuple(int(r) for r in mesh_ranks[index].flatten().tolist()) for index in range(stages)]
    rank = dist.get_rank()
    stage_group = None
    for ranks in per_stage:
        created = dist.new_group(list(ranks))
        stage_group = created if rank in ranks else stage_group
    tie_group = None
    if tied:
        for first, last in zip(per_stage[0], per_stage[-1], strict=True):
            created = dist.new_group([first, last])
            tie_group = created if rank in (first, last) else tie_group
    assert stage_group is not None  # every rank is in one stage
    return PipelineRuntime(PipelineSchedule(schedule), module, tuple(per_stage), pp_group, stage_group, tie_group)
