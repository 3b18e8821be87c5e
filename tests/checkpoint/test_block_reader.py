"""``BlockReader``: views of mapped safetensors files, exact bytes, no pages left resident."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from nemo_wrap.checkpoint.safetensors_file import BlockReader, read_header


def _rss_file_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile")


def test_windows_are_the_checkpoint_values_in_any_dtype(tmp_path):
    weight = torch.randn(40, 24).to(torch.bfloat16)
    save_file({"w": weight}, tmp_path / "m.safetensors")
    entry = read_header(tmp_path / "m.safetensors")["w"]
    with BlockReader() as reader:
        with reader.block(entry, (slice(5, 17), slice(3, 20))) as window:
            assert torch.equal(window, weight[5:17, 3:20])
            converted = torch.empty(12, 17, dtype=torch.float32)[:, :]
            converted.copy_(window)  # bf16 → fp32 is exact
        assert torch.equal(converted, weight[5:17, 3:20].float())
        assert reader.bytes_read == {"w": 12 * 17 * 2}


def test_a_tensor_that_is_not_aligned_to_its_dtype_is_read_exactly(tmp_path):
    """The format does not align tensors: 3 bf16 values (6 bytes) put the next fp32 tensor at an
    offset that is no multiple of 4."""
    first, second = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16), torch.tensor([0.1, -7.0])
    header = {
        "a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [6, 14]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "odd.safetensors"
    data = first.view(torch.uint8).numpy().tobytes() + second.view(torch.uint8).numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    entries = read_header(path)
    with BlockReader() as reader:
        for key, expected in (("a", first), ("b", second)):
            with reader.block(entries[key], (slice(0, expected.numel()),)) as window:
                assert torch.equal(window, expected)


def test_pages_of_read_blocks_leave_the_resident_set(tmp_path):
    """48 MiB read in 1 MiB tensors: the mapped file's pages do not accumulate."""
    tensors = {f"t{i}": torch.full((2**18,), float(i)) for i in range(48)}
    save_file(tensors, tmp_path / "big.safetensors")
    entries = read_header(tmp_path / "big.safetensors")
    before = _rss_file_mib()
    most = 0.0
    with BlockReader() as reader:
        for key, entry in entries.items():
            with reader.block(entry, (slice(0, 2**18),)) as window:
                assert float(window.sum()) == float(tensors[key].sum())
            most = max(most, _rss_file_mib() - before)
    assert most < 8, f"{most:.1f} MiB of the file stayed resident"
