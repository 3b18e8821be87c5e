"""What "a step's peak" means here, in one place: torch's ``MemTracker`` over the second of two
steps (the first makes the optimizer's state). The dry run measures its fake step with it, and the
tests and ``benchmarks/bench_memory.py`` the real step they compare the prediction with. The dry
run also takes the peak of the forward and backward apart from the optimizer step's: each grows
with the model's depth at its own rate (:mod:`.step_sampling`).

Two limits of torch's tracker (2.13) are met here rather than refused: it takes one forward of the
root module per tracked region (gradient accumulation runs several, and a pipeline schedule runs
its stage once per micro-batch before their backwards), and it registers a gradient hook on every
parameter, which torch refuses on a parameter that takes no gradient (LoRA's frozen base weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar, overload

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from nemo_wrap.memory.prediction import StepPhase

MicroBatch = Mapping[str, torch.Tensor]
_Item = TypeVar("_Item")


def second_step_peak(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    step: Callable[[Sequence[MicroBatch]], object],
) -> dict[str, int]:
    """Bytes at the peak of the second of two calls of ``step(micro_batches)``, on the device that
    peaks highest: ``"Total"`` and each of torch's categories by its name (``"Parameter"``,
    ``"Optstate"``, ...)."""
    by_phase = second_step_peaks_by_phase(model, optimizer, micro_batches, step)
    return max(by_phase.values(), key=lambda kinds: kinds["Total"])


def second_step_peaks_by_phase(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[MicroBatch],
    step: Callable[[Sequence[MicroBatch]], object],
) -> dict[StepPhase, dict[str, int]]:
    """:func:`second_step_peak` of the forward and backward (until ``optimizer.step`` starts) and of
    the optimizer step (from then on), apart; the higher is the step's peak. A step that does not
    call ``optimizer.step`` has its forward and backward only."""
    step(micro_batches)
    tracker = _StepMemTracker()
    tracker.track_external(model, optimizer)
    peaks: dict[StepPhase, dict[str, int]] = {}

    def optimizer_starts(*_: object) -> None:
        peaks[StepPhase.FORWARD_BACKWARD] = _highest_peak(tracker)
        tracker.restart_peak()

    handle = optimizer.register_step_pre_hook(optimizer_starts)
    try:
        with tracker:
            step(_ModuleStatsResetBetween(micro_batches, tracker))
    finally:
        handle.remove()
    peaks[StepPhase.OPTIMIZER_STEP if peaks else StepPhase.FORWARD_BACKWARD] = _highest_peak(tracker)
    return peaks


def _highest_peak(tracker: MemTracker) -> dict[str, int]:
    snapshot = max(tracker.get_tracker_snapshot("peak").values(), key=lambda device: device["Total"])
    return {getattr(key, "value", key): int(value) for key, value in snapshot.items()}


class _StepMemTracker(MemTracker):
    """torch's tracker, which hooks no gradient of a frozen parameter: before it tracks a module's
    parameters (FSDP swaps in unsharded ones at each forward), each frozen one is marked as hooked
    already, with handles that remove nothing. It is still counted as a parameter. Its peak can
    restart from the current memory, as entering the tracker makes it."""

    def restart_peak(self) -> None:
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {device: snapshot["Total"] for device, snapshot in self._peak_mem_snap.items()}

    def _update_peak_stats(self, peak_state: object) -> None:
        """The step's peak only. torch's tracker also raises every active module's own peak on
        every op, a walk over every module tracked, which nothing here reads: on a pipeline stage
        of sixteen 405B-sized layers over 32 micro-batches it was most of the dry run's time."""
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: object) -> None:
        """A root module's forward again before the backward (a pipeline stage's next micro-batch)
        starts its statistics over, where torch's tracker would take it for a next iteration."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _track_module_params_and_buffers(
        self, module: torch.nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        for parameter in module.parameters():
            if not parameter.requires_grad and parameter not in self._param_to_grad_hook_handles:
                self._param_to_grad_hook_handles[parameter] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


class _NoHook:
    """A hook handle with nothing to remove (the tracker removes its handles on exit)."""

    def remove(self) -> None:
        pass


class _ModuleStatsResetBetween(Sequence[_Item]):
    """The step's micro-batches, clearing the tracker's per-module statistics before each one after
    the first (its backward is over by then). The peak, which is all that is read, is kept."""

    def __init__(self, items: Sequence[_Item], tracker: MemTracker) -> None:
        self._items, self._tracker = items, tracker

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> _Item: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[_Item]: ...
    def __getitem__(self, index: int | slice) -> _Item | Sequence[_Item]:
        return self._items[index]

    def __iter__(self) -> Iterator[_Item]:
        for index, item in enumerate(self._items):
            if index:
                self._tracker.reset_mod_stats()
            yield item
