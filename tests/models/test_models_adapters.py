"""Fused layouts, state-dict adapters and tensor-parallel preconditions, without running a model.

The layouts are checked against their defining property (every ``Shard(0)`` chunk for every
valid ``tp`` is a complete smaller fused tensor), and the adapters against transformers' own key
names and against themselves: ``from_hf(to_hf(sd)) == sd`` and row-range sources that agree with
``from_hf`` on random ranges, including ranges that cut through a kv-head group.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nemo_wrap.distributed.tensor_parallel import check_tensor_parallel_supported
from nemo_wrap.errors import CheckpointKeyError, ShardingError, UnsupportedModelConfigError
from nemo_wrap.models.common.layouts import GateUpLayout, QKVLayout
from nemo_wrap.models import llama, qwen2, qwen3
from nemo_wrap.models.llama import NeMoLlamaForCausalLM
from nemo_wrap.models.qwen2 import NeMoQwen2ForCausalLM
from nemo_wrap.models.qwen3 import NeMoQwen3ForCausalLM

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, NeMoLlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, NeMoQwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, NeMoQwen3ForCausalLM, {"head_dim": 12}),
}
SPECS = {"llama": llama.SPEC, "qwen2": qwen2.SPEC, "qwen3": qwen3.SPEC}


def tiny_config(arch: str, *, kv_heads: int = 2, tied: bool = False):
    config_class, _, _, extra = ARCHITECTURES[arch]
    return config_class(
        vocab_size=67,
        hidden_size=48,
        intermediate_size=36,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        **extra,
    )


# -- layouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads,heads_per_group", [(4, 3), (4, 1), (1, 4)])
@pytest.mark.parametrize("columns", [(5,), ()], ids=["weight", "bias"])
def test_qkv_layout_shards_into_whole_groups_for_every_tp(kv_heads, heads_per_group, columns):
    layout = QKVLayout(num_kv_heads=kv_heads, heads_per_group=heads_per_group, head_dim=2)
    q = torch.randn(kv_heads * heads_per_group * 2, *columns)
    k, v = torch.randn(kv_heads * 2, *columns), torch.randn(kv_heads * 2, *columns)
    fused = layout.fuse(q, k, v)
    assert fused.shape == (layout.rows, *columns)
    assert all(torch.equal(a, b) for a, b in zip(layout.unfuse(fused), (q, k, v), strict=True))
    for tp in (t for t in range(1, kv_heads + 1) if kv_heads % t == 0):
        local = QKVLayout(num_kv_heads=kv_heads // tp, heads_per_group=heads_per_group, head_dim=2)
        for rank, chunk in enumerate(fused.chunk(tp)):
            expected = local.fuse(q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank])
            assert torch.equal(chunk, expected), (tp, rank)


def test_qkv_split_heads_reads_local_head_count_from_width():
    layout = QKVLayout(num_kv_heads=4, heads_per_group=3, head_dim=2)
    q, k, v = torch.randn(24), torch.randn(8), torch.randn(8)
    half = layout.fuse(q, k, v).chunk(2)[1].expand(1, 1, -1)  # rank 1 of tp=2: kv heads 2 and 3
    local_q, local_k, local_v = layout.split_heads(half)
    assert torch.equal(local_q.flatten(), q.chunk(2)[1])
    assert torch.equal(local_k.flatten(), k.chunk(2)[1]) and torch.equal(local_v.flatten(), v.chunk(2)[1])


@pytest.mark.parametrize("columns", [(3,), ()], ids=["weight", "bias"])
def test_gate_up_layout_shards_into_matching_rows_for_every_tp(columns):
    layout = GateUpLayout(intermediate_size=12)
    gate, up = torch.randn(12, *columns), torch.randn(12, *columns)
    fused = layout.fuse(gate, up)
    assert all(torch.equal(a, b) for a, b in zip(layout.unfuse(fused), (gate, up), strict=True))
    for tp in (1, 2, 3, 4, 6, 12):
        for rank, chunk in enumerate(fused.chunk(tp)):
            local_gate, local_up = GateUpLayout.split_activations(chunk.movedim(0, -1))
            assert torch.equal(local_gate.movedim(-1, 0), gate.chunk(tp)[rank])
            assert torch.equal(local_up.movedim(-1, 0), up.chunk(tp)[rank])


# -- adapters ----------------------------------------------------------------------------------
def _our_state_dict(arch: str, config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ARCHITECTURES[arch][2](config)
    return {key: tensor.clone() for key, tensor in model.state_dict().items()}


def _hf_keys(arch: str, config) -> set[str]:
    with torch.device("meta"):
        model = ARCHITECTURES[arch][1](config)
    keys = set(model.state_dict())
    if config.tie_word_embeddings:
        keys.discard("lm_head.weight")  # transformers' checkpoints omit the tied head
    return keys


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_adapter_round_trip_uses_transformers_keys(arch, tied):
    config = tiny_config(arch, tied=tied)
    adapter = SPECS[arch].state_dict_adapter(config)
    ours = _our_state_dict(arch, config)
    hf = adapter.to_hf(ours)
    assert set(hf) == _hf_keys(arch, config)
    back = adapter.from_hf(hf)
    assert set(back) == set(ours)
    assert all(torch.equal(back[key], ours[key]) for key in ours)
    if tied:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_hf_sources_agree_with_from_hf_on_random_row_ranges(arch):
    config = tiny_config(arch, kv_heads=2, tied=True)
    adapter = SPECS[arch].state_dict_adapter(config)
    ours = _our_state_dict(arch, config)
    hf = adapter.to_hf(ours)
    full = adapter.from_hf(hf)
    rng = random.Random(0)
    group_rows = QKVLayout.from_config(config).group_rows
    for key, tensor in full.items():
        rows = tensor.shape[0]
        ranges = [(0, rows), (0, 0), (rows, rows)] + [tuple(sorted(rng.sample(range(rows + 1), 2))) for _ in range(8)]
        if key.endswith("qkv_proj.weight"):
            # inside one group's query rows, across the q/k and k/v seams, and across two groups
            ranges += [(1, 3), (group_rows - 3, group_rows + 1), (group_rows * 6 // 8, group_rows + 5)]
        for start, stop in ranges:
            buffer = torch.full((stop - start, *tensor.shape[1:]), float("nan"))
            for source in adapter.hf_sources(key, start, stop):
                assert source.hf_key in hf
                buffer[source.local_rows] = hf[source.hf_key][source.hf_rows]
            assert torch.equal(buffer, tensor[start:stop]), (key, start, stop)


def test_hf_keys_name_the_parts_of_fused_and_tied_keys():
    adapter = llama.SPEC.state_dict_adapter(tiny_config("llama", tied=True))
    assert adapter.hf_keys("model.layers.1.self_attn.qkv_proj.bias") == [
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.1.self_attn.v_proj.bias",
    ]
    assert adapter.hf_keys("model.layers.0.mlp.gate_up_proj.weight") == [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    assert adapter.hf_keys("lm_head.weight") == ["model.embed_tokens.weight"]


def test_adapter_errors_name_the_key():
    config = tiny_config("llama")
    adapter = llama.SPEC.state_dict_adapter(config)
    hf = adapter.to_hf(_our_state_dict("llama", config))
    without_k = {key: value for key, value in hf.items() if key != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(CheckpointKeyError, match=re.escape("model.layers.0.self_attn.k_proj.weight")):
        adapter.from_hf(without_k)
    with pytest.raises(CheckpointKeyError, match=re.escape("lm_head.weight")):
        adapter.from_hf({key: value for key, value in hf.items() if key != "lm_head.weight"})
    with pytest.raises(CheckpointKeyError, match="qkv_proj"):
        adapter.hf_sources("model.layers.0.self_attn.qkv_proj.weight", 0, 10**6)
    with pytest.raises(CheckpointKeyError, match="norm"):
        adapter.hf_sources("model.norm.weight", 3, 2)


# -- preconditions -----------------------------------------------------------------------------
PLAN = llama.SPEC.parallel_plan()


def test_tensor_parallel_compatibility_names_the_field_and_tp_size():
    config = tiny_config("llama", kv_heads=2)
    for tp in (1, 2):
        check_tensor_parallel_supported(PLAN, config, tp, "NeMoLlamaForCausalLM")
    with pytest.raises(ShardingError, match=r"num_key_value_heads=2.*tp_size=4"):
        check_tensor_parallel_supported(PLAN, config, 4, "NeMoLlamaForCausalLM")
    odd_mlp = LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, intermediate_size=30)
    with pytest.raises(ShardingError, match=r"intermediate_size=30.*tp_size=4"):
        check_tensor_parallel_supported(PLAN, odd_mlp, 4, "NeMoLlamaForCausalLM")
    with pytest.raises(ShardingError, match="tp_size"):
        check_tensor_parallel_supported(PLAN, config, 0, "NeMoLlamaForCausalLM")


def test_unsupported_rope_type_is_refused_at_build():
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelConfigError, match="rope_type"):
        NeMoLlamaForCausalLM(config)


def test_importing_the_models_package_imports_no_architecture():
    code = (
        "import sys, nemo_wrap.models as m; "
        "assert not any(n.startswith(('nemo_wrap.models.llama', 'nemo_wrap.models.qwen')) for n in sys.modules); "
        "m.NeMoQwen2ForCausalLM; "
        "assert 'nemo_wrap.models.qwen2' in sys.modules and 'nemo_wrap.models.llama' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
