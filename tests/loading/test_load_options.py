"""``LoadOptions``: one typed load request, taken whole by plan(), the pipeline, SFTConfig and the CLI."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from nemo_wrap import InvalidSetupError, LoadOptions, NeMoAutoModelForCausalLM
from tests.support.checkpoints import write_checkpoint
from tests.support.tiny_models import tiny_config


def test_options_object_loads_as_the_keywords_do(tmp_path):
    path = write_checkpoint(tmp_path, "own-llama", "distinct", tie=True)
    by_keywords = NeMoAutoModelForCausalLM.from_pretrained(path, verify=True, dtype=torch.bfloat16, num_hidden_layers=2)
    options = LoadOptions(verify=True, dtype=torch.bfloat16, config_overrides=(("num_hidden_layers", 2),))
    by_options = NeMoAutoModelForCausalLM.from_pretrained(path, options=options)
    assert by_options.load_report.verified and by_keywords.load_report.verified
    assert all(torch.equal(t, by_keywords.state_dict()[n]) for n, t in by_options.state_dict().items())
    assert next(by_options.parameters()).dtype == torch.bfloat16
    plan = NeMoAutoModelForCausalLM.plan(path, options=LoadOptions(peft_config=LoraConfig(r=2), compile=True))
    assert plan.adapters == "new" and "compile each decoder layer" in str(plan)


def test_keywords_and_an_options_object_together_are_refused(tmp_path):
    path = write_checkpoint(tmp_path, "own-llama", "half", tie=True)
    with pytest.raises(InvalidSetupError, match="either as keywords or as options"):
        NeMoAutoModelForCausalLM.from_pretrained(path, verify=True, options=LoadOptions())
    with pytest.raises(InvalidSetupError, match="either as keywords or as options"):
        NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=3, options=LoadOptions(seed=3))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(strict="yes"), "strict must be True or False"),
        (dict(verify=1), "verify must be True or False"),
        (dict(compile=None), "compile must be True or False"),
        (dict(peft_config=LoraConfig(), adapter="adapter/"), "peft_config (new adapters) or adapter"),
    ],
)
def test_bad_options_name_the_keyword(options, named):
    with pytest.raises(InvalidSetupError) as excinfo:
        LoadOptions(**options)
    assert named in str(excinfo.value)


def test_sft_config_holds_the_load_request():
    from nemo_wrap.recipes import SFTConfig
    from nemo_wrap.recipes.config import DataSection

    config = SFTConfig("out", data=DataSection(train="rows.jsonl"), load=LoadOptions(precision="bf16-mixed"))
    assert config.load.precision == "bf16-mixed" and SFTConfig("o", data=DataSection(train="d")).load == LoadOptions()
