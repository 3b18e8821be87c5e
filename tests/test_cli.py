"""The ``nemo-wrap`` main job on its embedded default."""

from __future__ import annotations

import math
import re

import pytest
import torch.distributed as dist

from nemo_wrap.cli import main


def test_demo_describes_a_freshly_initialized_model(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "tiny NeMoLlamaForCausalLM, 90,496 parameters" in out
    assert "strategy fsdp2 on 1 rank(s)" in out
    assert "load plan: NeMoLlamaForCausalLM" in out
    assert "load report: 21 tensors — 1 tied, 20 initialized" in out
    assert out.count("no checkpoint given") == 20 and "tied to model.embed_tokens.weight" in out
    loss = float(re.search(r"loss of the fresh model ([0-9.]+)", out).group(1))
    assert abs(loss - math.log(257)) < 0.1  # initialized weights, not leftover memory
    assert not dist.is_initialized()


def test_demo_rejects_bad_setup_naming_the_argument(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["demo", "--strategy", "ddp", "--tp-size", "2"])
    assert excinfo.value.code == 2
    assert "tp_size=2" in capsys.readouterr().err
    if dist.is_initialized():
        dist.destroy_process_group()
