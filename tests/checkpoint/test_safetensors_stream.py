"""The streamed safetensors writer: what safetensors reads back is what was written, and a tensor
unlike its announced layout (or a missing one) is an error, never a file that lies."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nemo_wrap.checkpoint.safetensors_stream import SafetensorsStream
from nemo_wrap.errors import CheckpointSaveError

TENSORS = {
    "a.weight": torch.randn(3, 5),
    "b.bias": torch.arange(7, dtype=torch.bfloat16),
    "c.ids": torch.tensor([1, 2, 3], dtype=torch.int64),
    "d.scalar": torch.tensor(2.5, dtype=torch.float16),
    "e.empty": torch.zeros(0, 4),
    "f.view": torch.randn(4, 6)[:, 1:3],  # not contiguous: written as its values
}


def _layout(tensors):
    return {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}


def test_a_streamed_file_reads_back_in_safetensors_with_every_tensor_and_the_metadata(tmp_path):
    path = tmp_path / "model.safetensors"
    stream = SafetensorsStream(path, _layout(TENSORS))
    for key, tensor in TENSORS.items():
        stream.write(key, tensor)
    stream.close()
    loaded = load_file(path)
    assert loaded.keys() == TENSORS.keys()
    for key, tensor in TENSORS.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "pt"}


@pytest.mark.parametrize(
    ("key", "tensor", "named"),
    [("b.bias", TENSORS["b.bias"], "expected 'a.weight'"), ("a.weight", torch.randn(5, 3), "[5, 3]"),
     ("a.weight", TENSORS["a.weight"].double(), "torch.float64")],
    ids=["order", "shape", "dtype"],
)  # fmt: skip
def test_a_tensor_unlike_its_announced_layout_is_refused(tmp_path, key, tensor, named):
    stream = SafetensorsStream(tmp_path / "x.safetensors", _layout(TENSORS))
    with pytest.raises(CheckpointSaveError, match=named.replace("[", r"\[").replace("]", r"\]")):
        stream.write(key, tensor)
    stream.abandon()


def test_closing_before_every_announced_tensor_is_written_is_an_error(tmp_path):
    stream = SafetensorsStream(tmp_path / "x.safetensors", _layout(TENSORS))
    stream.write("a.weight", TENSORS["a.weight"])
    with pytest.raises(CheckpointSaveError, match="5 announced tensor"):
        stream.close()


def test_a_dtype_safetensors_cannot_store_is_named_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointSaveError, match="'z' is torch.complex64, which safetensors cannot store"):
        SafetensorsStream(tmp_path / "x.safetensors", {"z": ((2,), torch.complex64)})
    assert not (tmp_path / "x.safetensors").exists()
