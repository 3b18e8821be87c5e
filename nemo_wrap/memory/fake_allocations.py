"""Large tensors made from sizes alone are fake in the dry run's step too.

The dry run's step runs outside the fake mode, so that what it makes from sizes alone is real:
transformers decides whether to build a full attention mask by whether the positions it makes are
fake (a trace), and a real step builds none. But FSDP's gathered layers, its all-gather and
reduce-scatter buffers and AdamW's state are made from sizes alone too: real, they were the dry
run's whole real cost: gathered weights written by the fake all-gather, and from the embedding on
a forward and backward computed for real through them. One dry run of a rank of an 8B-shaped Llama
cut to 4 layers, on fsdp2 × 8 at 8192 tokens recomputed, took 21 s with them real and 2.4 s with
them fake. Real, they were also the source of the prediction's only errors on the measured
configurations (1% over on FSDP2 and HSDP at 4 × 256 tokens, CP × FSDP at 2 × 1024): exact with
them fake.

The mode below makes a factory's output fake when it has at least ``LARGE_ELEMENTS`` elements —
far more than the positions or masks of a step of up to that many tokens, far fewer than a layer.
It is entered outside the memory tracker (like :mod:`.fake_kernels`), so the tracker counts each
such tensor as the real step's, and in the fake mode the model's storage was made in: a fake tensor
meets only fake tensors of its own mode.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

LARGE_ELEMENTS = 1 << 20

_aten = torch.ops.aten
# each factory, and where its output's size is: a shape among its arguments, or a tensor's
_SHAPE_AT = {
    _aten.empty.memory_format: 0,
    _aten.empty_strided.default: 0,
    _aten.zeros.default: 0,
    _aten.ones.default: 0,
    _aten.full.default: 0,
    _aten.new_empty.default: 1,
    _aten.new_empty_strided.default: 1,
    _aten.new_zeros.default: 1,
    _aten.new_ones.default: 1,
    _aten.new_full.default: 1,
}
_LIKE = frozenset(
    {_aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default}
)


class LargeAllocationsFake(TorchDispatchMode):
    """Factories of at least ``LARGE_ELEMENTS`` elements give ``fake_mode``'s fake tensors (one
    whose template is fake already gives the same)."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_large_allocation(func, args):
            with self.fake_mode:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _is_large_allocation(func: Any, args: tuple[Any, ...]) -> bool:
    if func in _LIKE:
        return bool(args[0].numel() >= LARGE_ELEMENTS)
    return func in _SHAPE_AT and math.prod(int(size) for size in args[_SHAPE_AT[func]]) >= LARGE_ELEMENTS
