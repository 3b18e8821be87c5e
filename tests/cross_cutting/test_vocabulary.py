"""Closed vocabularies: members are the words users write, everywhere a word went."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.pipeline.layout import PipelineSchedule
from nemo_wrap.distributed.precision import Precision, PrecisionName
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.provenance import ProvenanceKind


def test_a_member_is_its_word_for_comparison_hashing_printing_and_json():
    assert MeshDim.TP == "tp" and {"tp": 1}[MeshDim.TP] == 1 and f"{MeshDim.TP}/{str(MeshDim.DP)}" == "tp/dp"
    assert json.dumps({ProvenanceKind.CHECKPOINT: Precision.BF16_MIXED}) == '{"checkpoint": "bf16-mixed"}'


def test_the_type_checkers_precision_words_are_the_enums():
    assert get_args(PrecisionName) == Precision.words() == ("fp32", "bf16", "bf16-mixed")
    assert PipelineSchedule.words() == ("1f1b", "gpipe")


def test_options_hold_a_word_as_its_member_and_refuse_others_by_name():
    assert LoadOptions(precision="bf16-mixed").precision is Precision.BF16_MIXED
    assert LoadOptions(precision="bf16-mixed") == LoadOptions(precision=Precision.BF16_MIXED)
    with pytest.raises(InvalidSetupError, match=r"precision='fp16': choose one of \['fp32', 'bf16', 'bf16-mixed'\]"):
        LoadOptions(precision="fp16")
