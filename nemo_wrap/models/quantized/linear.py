"""``QuantizedLinear``: a linear layer that bitsandbytes holds in 4 bits, stored as whole rows.

bitsandbytes quantizes a weight flattened row by row, in blocks of 64 values that each keep their
absolute maximum (absmax). When ``in_features`` is a multiple of 64 no block crosses a row, so rows
``[a, b)`` of the 4-bit weight are exactly the quantization of rows ``[a, b)`` of the weight on
their own. The layer therefore keeps bitsandbytes' bytes in row-shaped parameters — ``weight_packed``
``[out, in/2]`` (two 4-bit values a byte) and ``weight_absmax`` ``[out, in/64]`` — which FSDP2
shards by rows like any weight: each rank quantizes only the rows it holds while reading, and FSDP
all-gathers the 4-bit bytes, never a 16-bit copy. The computation is bitsandbytes' own
``matmul_4bit`` (its autograd function keeps the 4-bit weight, not a dequantized one, for the
backward), so the layer computes what transformers' ``Linear4bit`` computes from the same bytes.

Double quantization (bitsandbytes' ``compress_statistics``) stores the absmax in 8 bits, in blocks
of 256 around the mean of a whole weight's absmax. transformers applies it to each projection's
weight, so a fused layer of ours (``qkv_proj``) does it per projection (its ``parts``): the same
bytes as transformers' q, k and v. It needs every row's absmax, so it runs once after the read
(:meth:`QuantizedLinear.finish_encoding`, one all-gather of the fp32 absmax per layer); its scales,
means and 8-bit code are small and held whole on every rank, and the forward turns the 8-bit absmax
back into fp32 with bitsandbytes' ``dequantize_blockwise`` (what its nested kernels compute, exactly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.errors import ShardingError
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.models.lora.layers import Placement, row_index
from nemo_wrap.models.quantized.engine import bitsandbytes_functional, bitsandbytes_root
from nemo_wrap.models.quantized.settings import BLOCK_SIZE, STATISTICS_BLOCK_SIZE, QuantizationSettings
from nemo_wrap.state_dict import EncodedWeight


class QuantizedLinear(EncodedWeight):
    """``y = x @ dequantize(W)^T + b`` with ``W`` in 4 bits; frozen (adapters train beside it).

    ``weight_dtype`` is the dtype of the model's other weights: the one a merged or full save writes
    the dequantized weight in, and the one the checkpoint's rows are cast to before quantizing (as
    transformers does). The bias, when there is one, stays a ``weight_dtype`` parameter. ``parts``:
    the transformers projections a fused layer holds (one part, all rows, otherwise).
    """

    encoding = ("weight_packed", "weight_absmax")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        settings: QuantizationSettings,
        weight_dtype: torch.dtype,
        parts: Sequence[Placement] = (),
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.settings, self.weight_dtype = settings, weight_dtype
        whole: Placement = ((slice(0, out_features), slice(0, out_features)),)
        self.part_rows = tuple(row_index(part) for part in (parts or (whole,)))
        blocks = in_features // BLOCK_SIZE
        absmax_dtype = torch.uint8 if settings.double_quant else torch.float32
        self.weight_packed = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8), False)
        self.weight_absmax = nn.Parameter(torch.empty(out_features, blocks, dtype=absmax_dtype), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=weight_dtype)) if bias else None
        if settings.double_quant:
            scales = sum(math.ceil(rows.numel() * blocks / STATISTICS_BLOCK_SIZE) for rows in self.part_rows)
            self.register_buffer("absmax_scales", torch.empty(scales), persistent=False)
            self.register_buffer("absmax_offsets", torch.empty(len(self.part_rows)), persistent=False)
            self.register_buffer("absmax_code", torch.empty(256), persistent=False)
        self._absmax_rows: torch.Tensor | None = None  # fp32 absmax of this rank's rows, until finish_encoding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' ``Linear4bit.forward``: compute in ``compute_dtype``, answer in ``x``'s dtype."""
        compute = self.settings.compute_dtype
        bias = None if self.bias is None else self.bias.to(compute)
        state = self._quant_state(self._fp32_absmax(self.weight_absmax), compute)
        matmul = bitsandbytes_root().matmul_4bit
        return matmul(x.to(compute), self.weight_packed.view(-1, 1), quant_state=state, bias=bias).to(x.dtype)

    def init_own_parameters(self) -> None:
        """Nothing: a quantized layer holds a checkpoint tensor, read and quantized, never drawn."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.settings.quant_type}"

    # -- the encoding, as the loader, verify and the writer use it --------------------------------
    def describe(self) -> str:
        """How the checkpoint tensor is held, for the load report."""
        statistics = ", double quant" if self.settings.double_quant else ""
        return f"quantized to {self.settings.quant_type} by bitsandbytes (blocks of {BLOCK_SIZE}{statistics})"

    def local_rows(self) -> torch.Tensor:
        """The global indices of the weight rows this rank holds (all of them when not sharded)."""
        geometry = shard_geometry(self.weight_packed, "weight_packed")
        if geometry.local_shape[1:] != geometry.global_shape[1:]:
            raise ShardingError(f"a 4-bit layer is sharded by rows only, got local shape {geometry.local_shape}")
        return geometry.dim_indices[0]

    def start_encoding(self) -> None:
        """Before the first :meth:`encode_rows` (on every rank, even one holding no row)."""
        if self.settings.double_quant:
            rows = local_shard(self.weight_absmax).shape[0]
            self._absmax_rows = torch.empty(rows, self.in_features // BLOCK_SIZE, dtype=torch.float32)

    def encode_rows(self, values: torch.Tensor, first: int) -> None:
        """Quantize ``values`` — this rank's local rows ``first, first + 1, …`` of the weight — into
        this rank's storage (the absmax waits in fp32 for :meth:`finish_encoding` under double quant)."""
        packed, state = bitsandbytes_functional().quantize_4bit(
            values, blocksize=BLOCK_SIZE, quant_type=self.settings.quant_type, compress_statistics=False
        )
        rows = slice(first, first + values.shape[0])
        local_shard(self.weight_packed)[rows] = packed.view(values.shape[0], -1)
        absmax = state.absmax.view(values.shape[0], -1)
        if self._absmax_rows is not None:
            self._absmax_rows[rows] = absmax
        else:
            local_shard(self.weight_absmax)[rows] = absmax

    def finish_encoding(self) -> None:
        """Double-quantize each part's absmax, as bitsandbytes does for a whole weight (collective
        when the layer is sharded: every rank calls it for every layer, in the same order)."""
        if self._absmax_rows is None:
            return
        absmax = _whole(self._absmax_rows, self.weight_absmax)
        quantized = torch.empty(absmax.shape, dtype=torch.uint8)
        scales, offsets = [], []
        for rows in self.part_rows:
            part = absmax[rows].reshape(-1)
            offset = part.mean()
            values, nested = bitsandbytes_functional().quantize_blockwise(
                part - offset, blocksize=STATISTICS_BLOCK_SIZE
            )
            quantized[rows] = values.view(rows.numel(), -1)
            scales.append(nested.absmax)
            offsets.append(offset)
        local_rows = shard_geometry(self.weight_absmax, "weight_absmax").dim_indices[0]
        local_shard(self.weight_absmax).copy_(quantized[local_rows])
        self._set_statistics(torch.cat(scales), torch.stack(offsets), nested.code)
        self._absmax_rows = None

    def encode(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The encoding of the whole ``weight`` as bitsandbytes quantizes each part in one piece (as
        transformers does each projection) — what ``verify`` compares with the layer's, whatever its
        sharding: the 4-bit rows and absmax, and with double quantization the statistics every rank
        holds whole."""
        packed = torch.empty(self.weight_packed.shape, dtype=torch.uint8)
        absmax = torch.empty(self.weight_absmax.shape, dtype=self.weight_absmax.dtype)
        states = []
        for rows in self.part_rows:
            part_packed, state = bitsandbytes_functional().quantize_4bit(
                weight[rows].to(self.weight_dtype),
                blocksize=BLOCK_SIZE,
                quant_type=self.settings.quant_type,
                compress_statistics=self.settings.double_quant,
            )
            packed[rows] = part_packed.view(rows.numel(), -1)
            absmax[rows] = state.absmax.view(rows.numel(), -1)
            states.append(state)
        parts = {"weight_packed": packed, "weight_absmax": absmax}
        if self.settings.double_quant:
            parts["absmax_scales"] = torch.cat([state.state2.absmax for state in states])
            parts["absmax_offsets"] = torch.stack([state.offset for state in states])
            parts["absmax_code"] = states[0].state2.code
        return parts

    def decoded(self) -> torch.Tensor:
        """The whole weight, dequantized, in ``weight_dtype`` (collective when sharded)."""
        packed = _whole(local_shard(self.weight_packed), self.weight_packed)
        absmax = _whole(local_shard(self.weight_absmax), self.weight_absmax)
        state = self._quant_state(self._fp32_absmax(absmax), torch.float32)
        return bitsandbytes_functional().dequantize_4bit(packed.reshape(-1, 1), state).to(self.weight_dtype)

    def _fp32_absmax(self, absmax: torch.Tensor) -> torch.Tensor:
        """The whole weight's absmax in fp32: as stored, or each part's 8-bit values dequantized
        with its scales and mean."""
        if not self.settings.double_quant:
            return absmax
        functional = bitsandbytes_functional()
        scales, offsets = self.get_buffer("absmax_scales"), self.get_buffer("absmax_offsets")
        restored = torch.empty(absmax.shape, dtype=torch.float32, device=absmax.device)
        first = 0
        for part, rows in enumerate(self.part_rows):
            values = absmax[rows].reshape(-1)
            count = math.ceil(values.numel() / STATISTICS_BLOCK_SIZE)
            nested = functional.QuantState(
                absmax=scales[first : first + count],
                code=self.get_buffer("absmax_code"),
                blocksize=STATISTICS_BLOCK_SIZE,
                dtype=torch.float32,
            )
            restored[rows] = (functional.dequantize_blockwise(values, nested) + offsets[part]).view(rows.numel(), -1)
            first += count
        return restored

    def _set_statistics(self, scales: torch.Tensor, offsets: torch.Tensor, code: torch.Tensor) -> None:
        self.get_buffer("absmax_scales").copy_(scales)
        self.get_buffer("absmax_offsets").copy_(offsets)
        self.get_buffer("absmax_code").copy_(code)

    def _quant_state(self, absmax: torch.Tensor, dtype: torch.dtype) -> Any:
        """bitsandbytes' ``QuantState`` over the whole weight's fp32 ``absmax``, dequantizing to ``dtype``."""
        functional = bitsandbytes_functional()
        return functional.QuantState(
            absmax=absmax.reshape(-1),
            shape=torch.Size(self.weight_shape),
            code=functional.get_4bit_type(self.settings.quant_type, device=absmax.device),
            blocksize=BLOCK_SIZE,
            quant_type=self.settings.quant_type,
            dtype=dtype,
        )


def _whole(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """All ranks' ``local`` parts of a tensor laid out as ``like`` (a parameter, possibly a DTensor)."""
    if not isinstance(like, DTensor):
        return local
    spread = DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    return spread.full_tensor()
