"""Where torch's fake kernels are stricter than its CPU kernels, for the dry run's step only.

torch 2.13's fake (meta) kernel of ``aten._grouped_mm`` — the mixture-of-experts matmul that
transformers' experts run — takes bfloat16 only, as the CUDA kernel does, while the CPU kernel
takes float32 too: a float32 MoE step runs for real on CPU and fails on fake tensors. The mode
below computes such a product's fake output in bfloat16 and gives it back in the inputs' dtype:
same shapes, same output bytes as the real op. It is entered outside the memory tracker, so the
tracker sees the op's output and not the casts (which a real run does not make). A mode, active
around the dry run's step alone, rather than a patch of torch's kernel registry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode


class GroupedMatmulInAnyFloat(TorchDispatchMode):
    """Fake ``_grouped_mm`` of float32 (or float16) inputs, through its bfloat16 fake kernel."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.ops.aten._grouped_mm.default or not _needs_bfloat16(args[:2]):
            return func(*args, **kwargs)
        output_dtype = kwargs.get("out_dtype") or args[0].dtype  # the real op's
        return func(*(_as_bfloat16(argument) for argument in args), **kwargs).to(output_dtype)


def _as_bfloat16(argument: Any) -> Any:
    if isinstance(argument, torch.Tensor) and argument.is_floating_point():
        return argument.to(torch.bfloat16)
    return argument


def _needs_bfloat16(matrices: tuple[Any, ...]) -> bool:
    return any(isinstance(m, FakeTensor) and m.is_floating_point() and m.dtype != torch.bfloat16 for m in matrices)
