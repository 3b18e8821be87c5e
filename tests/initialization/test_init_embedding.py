"""The embedding padding row: zeroed exactly where it lives, with no collective.

Each multi-rank case fills an embedding with non-zero, position-coded values, zeroes the padding
row, and reports per rank whether its local shard changed; the test then checks the full tensor
(only that row is zero, every other value intact) and *which* ranks wrote, against the owners
worked out by hand from torch.chunk arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from nemo_wrap.errors import InvalidPaddingIndexError
from nemo_wrap.initialization import nemo_model_class, zero_padding_row_


def _coded(rows, cols):
    return torch.arange(1, rows * cols + 1, dtype=torch.float32).view(rows, cols)


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if s == "R" else Shard(int(s[1:])) for s in spec]


def _zero_and_report(weight, padding_idx):
    """Zero the row of a DTensor weight; return (local changed?, full tensor, collectives used)."""
    from torch.distributed.tensor.debug import CommDebugMode

    before = weight.to_local().clone()
    with torch.no_grad(), CommDebugMode() as comm:
        zero_padding_row_(weight, padding_idx)
    changed = not torch.equal(before, weight.to_local())
    with torch.no_grad():
        return changed, weight.full_tensor().clone(), comm.get_total_counts()


# -- rank cases --------------------------------------------------------------------------------


def case_padding_row(rows, cols, mesh_shape, spec, padding_idx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    weight = distribute_tensor(_coded(rows, cols), mesh, _placements(spec))
    return _zero_and_report(weight, padding_idx)


class _Embedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(257, 8)

    def forward(self, ids):
        return self.emb(ids)


def case_padding_row_fsdp_over_tp(padding_idx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module = _Embedder()
    with torch.no_grad():
        module.emb.weight.copy_(_coded(257, 8))
    parallelize_module(module, mesh["tp"], {"emb": RowwiseParallel()})
    fully_shard(module, mesh=mesh["dp"])
    assert isinstance(module.emb.weight.placements[0], _StridedShard)
    return _zero_and_report(module.emb.weight, padding_idx)


def _tiny_llama(padding_idx):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=257,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=padding_idx,
        tie_word_embeddings=False,
    )


def _meta_llama_with_sharded_embedding(cls, config):
    """Build on meta, materialize, and put a vocab-sharded (Shard(0)) embedding weight in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    mesh = init_device_mesh("cpu", (2,))
    weight = distribute_tensor(torch.full((257, 16), 1234.5), mesh, [Shard(0)])
    model.model.embed_tokens.weight = torch.nn.Parameter(weight)
    return model


def _padding_outcome(model, action, padding_idx):
    """Run ``action``; report whether it raised, |padding row| (full), collectives, other rows' state."""
    from torch.distributed.tensor.debug import CommDebugMode

    raised = False
    with CommDebugMode() as comm:
        try:
            action(model)
        except Exception:  # noqa: BLE001 - "raises" is one accepted form of the defect
            raised = True
    with torch.no_grad():
        full = model.model.embed_tokens.weight.full_tensor()
    others = torch.cat([full[:padding_idx], full[padding_idx + 1 :]])
    return raised, full[padding_idx].abs().sum().item(), comm.get_total_counts(), bool((others == 1234.5).any())


def case_transformers_padding_defect(padding_idx):
    from transformers import LlamaForCausalLM

    config = _tiny_llama(padding_idx)
    ours_class = nemo_model_class(LlamaForCausalLM)
    return {
        "hf_initialize_weights": _padding_outcome(
            _meta_llama_with_sharded_embedding(LlamaForCausalLM, config), lambda m: m.initialize_weights(), padding_idx
        ),
        "hf_init_weights_rule": _padding_outcome(
            _meta_llama_with_sharded_embedding(LlamaForCausalLM, config),
            lambda m: m._init_weights(m.model.embed_tokens),
            padding_idx,
        ),
        "ours_initialize_weights": _padding_outcome(
            _meta_llama_with_sharded_embedding(ours_class, config), lambda m: m.initialize_weights(seed=0), padding_idx
        ),
        "ours_init_weights_rule": _padding_outcome(
            _meta_llama_with_sharded_embedding(ours_class, config),
            lambda m: m._init_weights(m.model.embed_tokens),
            padding_idx,
        ),
    }


# -- tests ---------------------------------------------------------------------------------------


def _assert_only_row_zeroed(full, rows, cols, padding_idx):
    expected = _coded(rows, cols)
    expected[padding_idx] = 0
    assert torch.equal(full, expected)


@pytest.mark.parametrize(
    ("rows", "spec", "padding_idx", "owners"),
    [
        # 257 rows over 2 ranks: chunks of 129 (rows 0-128, 129-256).
        (257, ("S0",), 0, {0}),
        (257, ("S0",), 128, {0}),
        (257, ("S0",), 129, {1}),
        (257, ("S0",), 256, {1}),
        (257, ("S0",), -1, {1}),
        (256, ("S0",), 127, {0}),
        (256, ("S0",), 128, {1}),
        (257, ("R",), 100, {0, 1}),
        (257, ("S1",), 256, {0, 1}),  # every rank zeroes its column slice of the row
        (257, ("S1",), 0, {0, 1}),
    ],
)
def test_padding_row_two_ranks(ranks2, rows, spec, padding_idx, owners):
    results = ranks2.run(case_padding_row, rows, 8, (2,), spec, padding_idx)
    assert {rank for rank, (changed, _, _) in enumerate(results) if changed} == owners
    for _, full, collectives in results:
        assert collectives == 0
        _assert_only_row_zeroed(full, rows, 8, padding_idx)


@pytest.mark.parametrize(
    ("rows", "mesh_shape", "spec", "padding_idx", "owners"),
    [
        # 257 over 4: 65/65/65/62 (rows 0-64, 65-129, 130-194, 195-256).
        (257, (4,), ("S0",), 0, {0}),
        (257, (4,), ("S0",), 64, {0}),
        (257, (4,), ("S0",), 65, {1}),
        (257, (4,), ("S0",), 194, {2}),
        (257, (4,), ("S0",), 195, {3}),
        (257, (4,), ("S0",), 256, {3}),
        # 9 over 4: 3/3/3/0 — the last rank is empty and never writes.
        (9, (4,), ("S0",), 0, {0}),
        (9, (4,), ("S0",), 4, {1}),
        (9, (4,), ("S0",), 8, {2}),
        (5, (4,), ("S0",), 4, {2}),  # 2/2/1/0
        (257, (4,), ("R",), 7, {0, 1, 2, 3}),
        (257, (4,), ("S1",), 7, {0, 1, 2, 3}),
        # 2-D meshes, rank = 2 * i + j for mesh coordinate (i, j).
        (257, (2, 2), ("S0", "S1"), 200, {2, 3}),  # rows split on i (129/128), columns on j
        (257, (2, 2), ("R", "S0"), 100, {0, 2}),  # rows split on j only
        (257, (2, 2), ("S0", "S0"), 100, {1}),  # rows 0-128 on i=0, then 0-64 / 65-128 on j
        (257, (2, 2), ("S0", "S0"), 256, {3}),
        (9, (2, 2), ("S0", "S0"), 8, {3}),  # 5/4, then 3/2 and 2/2: row 8 is rank 3's last row
    ],
)
def test_padding_row_four_ranks(ranks4, rows, mesh_shape, spec, padding_idx, owners):
    results = ranks4.run(case_padding_row, rows, 8, mesh_shape, spec, padding_idx)
    assert {rank for rank, (changed, _, _) in enumerate(results) if changed} == owners
    for _, full, collectives in results:
        assert collectives == 0
        _assert_only_row_zeroed(full, rows, 8, padding_idx)


@pytest.mark.parametrize(
    ("padding_idx", "owners"),
    # TP chunks 129/128 on j, FSDP chunks 65/64 and 64/64 on i: rank 0 rows 0-64, rank 2 rows
    # 65-128, rank 1 rows 129-192, rank 3 rows 193-256.
    [(0, {0}), (64, {0}), (65, {2}), (128, {2}), (129, {1}), (200, {3}), (256, {3})],
)
def test_padding_row_fsdp_over_tp_strided(ranks4, padding_idx, owners):
    results = ranks4.run(case_padding_row_fsdp_over_tp, padding_idx)
    assert {rank for rank, (changed, _, _) in enumerate(results) if changed} == owners
    for _, full, collectives in results:
        assert collectives == 0
        _assert_only_row_zeroed(full, 257, 8, padding_idx)


@pytest.mark.parametrize("padding_idx", [200, 3])
def test_transformers_init_leaves_sharded_padding_row_but_ours_zeroes_it(ranks2, padding_idx):
    results = ranks2.run(case_transformers_padding_defect, padding_idx)
    for outcome in results:
        for key in ("hf_initialize_weights", "hf_init_weights_rule"):
            raised, padding_row_norm, _, _ = outcome[key]
            # The defect: either it raises, or it silently leaves the row non-zero.
            assert raised or padding_row_norm > 0, key
        for key in ("ours_initialize_weights", "ours_init_weights_rule"):
            raised, padding_row_norm, collectives, sentinel_left = outcome[key]
            assert not raised, key
            assert padding_row_norm == 0.0, key
            assert collectives == 0, key
            assert not sentinel_left, key


def test_plain_tensor_padding_row():
    weight = _coded(9, 4)
    assert zero_padding_row_(weight, -2) is weight
    _assert_only_row_zeroed(weight, 9, 4, 7)


def test_meta_padding_row_is_noop():
    weight = torch.empty(9, 4, device="meta")
    assert zero_padding_row_(weight, 3) is weight


@pytest.mark.parametrize("padding_idx", [9, -10])
def test_padding_index_out_of_range(padding_idx):
    with pytest.raises(InvalidPaddingIndexError, match="padding_idx"):
        zero_padding_row_(torch.ones(9, 4), padding_idx)


def test_padding_row_needs_a_matrix():
    with pytest.raises(InvalidPaddingIndexError, match="embed.weight"):
        zero_padding_row_(torch.ones(9), 0, name="embed.weight")
