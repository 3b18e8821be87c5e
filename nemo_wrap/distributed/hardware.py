"""Which 16-bit dtypes a device multiplies at full speed, so the default precision can avoid the rest.

A CPU without native bf16 instructions computes a bf16 matmul through a slow fallback: on one
without AVX512-BF16 or AMX, the lm_head backward of SmolLM2 (``[256, 49152] @ [49152, 576]``) took
24.6 s in bf16 against 0.12 s in fp32, while on one with AMX bf16 it is 4× *faster* than fp32. Most
downloaded checkpoints are bf16, so keeping the checkpoint's dtype by default made training 50–200×
slower on the first kind of machine. The answer is read once from the CPU's feature flags (the
same on every rank of a host, so ranks agree without a collective), or for CUDA from torch; where
neither can tell (no ``/proc/cpuinfo``: macOS, Windows), a small product is timed once.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

# Feature flags (``/proc/cpuinfo``) with which oneDNN computes the dtype natively: x86 AVX512 /
# AMX extensions, and Arm's BF16 and half-precision SIMD.
_CPU_FLAGS = {
    torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    torch.float16: frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}
# Without flags to read: the dtype is fast when its product takes at most this multiple of fp32's
# (native bf16 is faster than fp32; the fallbacks measured were 4–200× slower).
_TIMED_SLOWDOWN_LIMIT = 1.5


def fast_matmul_dtypes(device_type: str) -> frozenset[torch.dtype]:
    """The 16-bit dtypes (of bf16 and fp16) whose matmul on ``device_type`` is not slower than fp32's."""
    if device_type == "cuda":
        return _cuda_fast_dtypes()
    flags = _cpu_flags()
    if flags is None:
        return _timed_fast_dtypes()
    return frozenset(dtype for dtype, names in _CPU_FLAGS.items() if flags & names)


def _cuda_fast_dtypes() -> frozenset[torch.dtype]:
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return frozenset({torch.float16, torch.bfloat16} if native_bf16 else {torch.float16})


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """The feature flags of this host's CPU (x86 ``flags``, Arm ``Features``), or ``None`` off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


@functools.cache
def _timed_fast_dtypes() -> frozenset[torch.dtype]:
    reference = _product_seconds(torch.float32)
    return frozenset(d for d in _CPU_FLAGS if _product_seconds(d) <= _TIMED_SLOWDOWN_LIMIT * reference)


def _product_seconds(dtype: torch.dtype) -> float:
    """The best of a few timings of a ``[128, 512] @ [512, 512]`` product (~1 ms in fp32)."""
    left, right = torch.ones(128, 512, dtype=dtype), torch.ones(512, 512, dtype=dtype)
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        torch.mm(left, right)
        best = min(best, time.perf_counter() - start)
    return best
