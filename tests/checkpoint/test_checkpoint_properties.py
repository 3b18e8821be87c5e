"""Property tests of what is read from disk: arbitrary bytes and mutated valid files give a correct
load or a :class:`NeMoWrapError` — never another exception, never more than seconds or ~400 MB."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint.locate import Checkpoint, open_checkpoint
from nemo_wrap.checkpoint.safetensors_file import read_header
from nemo_wrap.errors import NeMoWrapError
from tests.support.checkpoints import write_checkpoint
from tests.support.measure import measured

SECONDS = 5.0
PEAK_MB = 400.0
PROPERTY = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("good") / "llama", "llama", "half", tie=False)


@pytest.fixture
def fresh(good, tmp_path_factory):
    """A new copy of the good checkpoint per example (hypothesis reuses function fixtures)."""

    def make() -> Path:
        target = tmp_path_factory.mktemp("example") / "copy"
        shutil.copytree(good, target)
        return target

    return make


def _bounded(action) -> object:
    """``action()``'s result, or its NeMoWrapError; anything else, or too much time or memory, fails."""
    with measured() as measurement:
        try:
            result: object = action()
        except NeMoWrapError as error:
            result = error
    assert measurement.seconds < SECONDS
    assert measurement.peak_mb < PEAK_MB
    return result


def _load(path: Path) -> object:
    return _bounded(lambda: NeMoAutoModelForCausalLM.from_pretrained(path, force_hf=True))


def _loaded_correctly(result: object) -> bool:
    return isinstance(result, NeMoWrapError) or all(torch.all(p == 0.5) for p in result.parameters())


@PROPERTY
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_as_a_safetensors_file(fresh, data):
    path = fresh()
    (path / "model.safetensors").write_bytes(data)
    assert isinstance(_bounded(lambda: read_header(path / "model.safetensors")), (dict, NeMoWrapError))


@PROPERTY
@given(position=st.integers(0, 2000), replacement=st.binary(min_size=1, max_size=8), cut=st.booleans())
def test_a_mutated_safetensors_header(fresh, position, replacement, cut):
    path = fresh()
    raw = bytearray((path / "model.safetensors").read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    at = position % header_end
    raw[at : at + (len(replacement) if not cut else 64)] = replacement
    (path / "model.safetensors").write_bytes(bytes(raw))
    assert _loaded_correctly(_load(path))


@PROPERTY
@given(index=JSON | st.fixed_dictionaries({"weight_map": JSON}))
def test_an_arbitrary_index(fresh, index):
    path = fresh()
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert isinstance(_bounded(lambda: open_checkpoint(path)), (Checkpoint, NeMoWrapError))
    assert _loaded_correctly(_load(path))


SIZE = st.one_of(
    st.integers(-3, 300), st.just(10**12), st.floats(allow_nan=True), st.text(max_size=4), st.none(), st.lists(st.integers(), max_size=2)
)
FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
          "tie_word_embeddings", "architectures", "model_type", "pad_token_id", "hidden_act", "dtype")


@PROPERTY
@given(changes=st.dictionaries(st.sampled_from(FIELDS), SIZE | JSON, min_size=1, max_size=3))
def test_a_config_with_arbitrary_values(fresh, changes):
    path = fresh()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    result = _load(path)
    assert isinstance(result, NeMoWrapError) or isinstance(result, torch.nn.Module)


@PROPERTY
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes_as_a_config(fresh, data):
    path = fresh()
    (path / "config.json").write_bytes(data)
    assert isinstance(_load(path), NeMoWrapError)
