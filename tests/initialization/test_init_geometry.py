"""Shard geometry and the sharding-independent random / deterministic fills.

Multi-rank cases run on real gloo ranks (``tests/support/multirank.py``). The reference for every
sharded fill is the same fill on a plain tensor in *this* process (which runs with a different
thread count than the ranks), so equality also shows the draws do not depend on threads.
"""

from __future__ import annotations

import pytest
import torch

from nemo_wrap.errors import UnsupportedPlacementError
from nemo_wrap.initialization import (
    Normal,
    TruncatedNormal,
    Uniform,
    random_fill_,
    shard_geometry,
)
from nemo_wrap.initialization.deterministic import constant_fill_, copy_global_

# -- helpers used inside rank processes ------------------------------------------------------


def _placements(spec):
    from torch.distributed.tensor import Partial, Replicate, Shard

    kinds = {"R": Replicate, "P": Partial}
    return [kinds[s]() if s in kinds else Shard(int(s[1:])) for s in spec]


def _mesh(mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(mesh_shape))


def _distribution(spec):
    kind, *args = spec
    return {"normal": Normal, "uniform": Uniform, "trunc": TruncatedNormal}[kind](*args)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(257, 6)
        self.a = torch.nn.Linear(6, 9)
        self.b = torch.nn.Linear(9, 7)

    def forward(self, ids):
        return self.b(self.a(self.emb(ids)))


def _fsdp_over_tp_module():
    """Embedding + two Linears, tensor-parallel on mesh dim "tp", FSDP2 on "dp" (2x2 mesh).

    Values are arange-coded so that every local element reveals its global position.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    module = _Tiny()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view(p.shape))
    full = {n: p.detach().clone() for n, p in module.named_parameters()}
    parallelize_module(module, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel(), "emb": RowwiseParallel()})
    fully_shard(module, mesh=mesh["dp"])
    return module, full


def _check_geometry(tensor, full):
    """The local shard equals the full tensor at the geometry's indices; torch agrees on shape/offset."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    geometry = shard_geometry(tensor)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    assert tuple(local.shape) == geometry.local_shape
    assert torch.equal(local, full[torch.meshgrid(*geometry.dim_indices, indexing="ij")])
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    assert tuple(shape) == geometry.local_shape
    if not geometry.is_empty:
        assert tuple(offset) == geometry.global_offset
    return geometry.local_shape, geometry.global_offset


# -- rank cases --------------------------------------------------------------------------------


def case_geometry(shape, mesh_shape, spec):
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    tensor = distribute_tensor(full, _mesh(mesh_shape), _placements(spec))
    return _check_geometry(tensor, full)


def case_geometry_fsdp_over_tp():
    from torch.distributed.tensor.placement_types import _StridedShard

    module, full = _fsdp_over_tp_module()
    result = {}
    for name, param in module.named_parameters():
        result[name] = (_check_geometry(param, full[name]), any(isinstance(p, _StridedShard) for p in param.placements))
    return result


def case_partial_refused():
    from torch.distributed.tensor import DTensor

    tensor = DTensor.from_local(torch.ones(4, 3), _mesh((2,)), _placements(("P",)))
    with pytest.raises(UnsupportedPlacementError, match="partial_weight"):
        shard_geometry(tensor, "partial_weight")
    with pytest.raises(UnsupportedPlacementError):
        random_fill_(tensor, Normal(), seed=1, name="partial_weight")
    with pytest.raises(UnsupportedPlacementError):
        constant_fill_(tensor, 0.0, name="partial_weight")
    return True


def case_random_fill(shape, mesh_shape, spec, distribution, dtype, name):
    """Fill a sharded tensor; returns its full tensor and the number of collectives the fill used."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    tensor = distribute_tensor(torch.full(shape, 1234.5, dtype=dtype), _mesh(mesh_shape), _placements(spec))
    with CommDebugMode() as comm:
        random_fill_(tensor, _distribution(distribution), seed=42, name=name)
    return tensor.full_tensor(), comm.get_total_counts()


def case_random_fill_fsdp_over_tp():
    from torch.distributed.tensor.debug import CommDebugMode

    module, _ = _fsdp_over_tp_module()
    collectives = 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            with CommDebugMode() as comm:
                random_fill_(param, Normal(0.0, 0.02), seed=7, name=name)
            collectives += comm.get_total_counts()
        return {n: p.full_tensor() for n, p in module.named_parameters()}, collectives


def case_deterministic_fills(mesh_shape, spec):
    from torch.distributed.tensor import distribute_tensor

    mesh, placements = _mesh(mesh_shape), _placements(spec)
    target = distribute_tensor(torch.full((9, 6), 1234.5), mesh, placements)
    constant_fill_(target, 3.25)
    constant = target.full_tensor().clone()  # a replicated full_tensor() is the local tensor itself
    source = torch.arange(54, dtype=torch.float32).view(9, 6)
    copy_global_(target, source)
    copied = target.full_tensor().clone()
    copy_global_(target, torch.arange(6, dtype=torch.float32))  # broadcast along rows
    return constant, copied, target.full_tensor()


# -- tests ---------------------------------------------------------------------------------------


def test_plain_tensor_geometry_is_whole_tensor():
    geometry = shard_geometry(torch.empty(5, 3))
    assert geometry.global_shape == (5, 3)
    assert geometry.local_shape == (5, 3)
    assert geometry.global_offset == (0, 0)
    assert not geometry.is_empty
    positions, rows = geometry.positions_in(0, 2, 4)
    assert positions.tolist() == [2, 3] and rows.tolist() == [2, 3]


def test_meta_geometry_and_fills_are_noops():
    meta = torch.empty(7, 4, device="meta")
    assert shard_geometry(meta).local_shape == (7, 4)
    assert random_fill_(meta, Normal(), seed=0, name="w") is meta
    assert constant_fill_(meta, 1.0) is meta
    assert copy_global_(meta, torch.zeros(7, 4)) is meta


@pytest.mark.parametrize(
    ("shape", "spec", "expected_rows", "expected_offsets"),
    [
        ((8, 3), ("S0",), [4, 4], [0, 4]),
        ((9, 3), ("S0",), [5, 4], [0, 5]),
        ((1, 3), ("S0",), [1, 0], [0, 1]),
        ((8, 3), ("R",), [8, 8], [0, 0]),
        ((3, 5), ("S1",), [3, 3], [0, 0]),
    ],
)
def test_geometry_two_ranks(ranks2, shape, spec, expected_rows, expected_offsets):
    results = ranks2.run(case_geometry, shape, (2,), spec)
    assert [r[0][0] for r in results] == expected_rows
    assert [r[1][0] for r in results] == expected_offsets
    if spec == ("S1",):
        assert [r[0][1] for r in results] == [3, 2]
        assert [r[1][1] for r in results] == [0, 3]


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "spec", "expected_local_shapes"),
    [
        # torch.chunk semantics: ceil-sized chunks, trailing ranks short or empty.
        ((257, 2), (4,), ("S0",), [(65, 2), (65, 2), (65, 2), (62, 2)]),
        ((9, 2), (4,), ("S0",), [(3, 2), (3, 2), (3, 2), (0, 2)]),
        ((5, 2), (4,), ("S0",), [(2, 2), (2, 2), (1, 2), (0, 2)]),
        ((7, 5), (2, 2), ("S0", "S1"), [(4, 3), (4, 2), (3, 3), (3, 2)]),
        ((9, 4), (2, 2), ("S0", "S0"), [(3, 4), (2, 4), (2, 4), (2, 4)]),
        ((6, 5), (2, 2), ("R", "S1"), [(6, 3), (6, 2), (6, 3), (6, 2)]),
        ((6, 5), (2, 2), ("S1", "R"), [(6, 3), (6, 3), (6, 2), (6, 2)]),
    ],
)
def test_geometry_four_ranks(ranks4, shape, mesh_shape, spec, expected_local_shapes):
    results = ranks4.run(case_geometry, shape, mesh_shape, spec)
    assert [r[0] for r in results] == expected_local_shapes


def test_geometry_fsdp_over_tp_strided_shard(ranks4):
    results = ranks4.run(case_geometry_fsdp_over_tp)
    # The TP-sharded weights carry _StridedShard after fully_shard; every rank's data was checked.
    assert results[0]["emb.weight"][1] and results[0]["a.weight"][1]
    # 257 rows: TP chunks 129/128, FSDP chunks of those 65/64 and 64/64 (rank = dp * 2 + tp).
    assert [r["emb.weight"][0] for r in results] == [((65, 6), (0, 0)), ((64, 6), (129, 0)), ((64, 6), (65, 0)), ((64, 6), (193, 0))]


def test_partial_placement_refused(ranks2):
    assert ranks2.run(case_partial_refused) == [True, True]


RANDOM_LAYOUTS_2 = [
    ((257, 512), (2,), ("S0",)),  # 3 tiles of 128 rows; shard boundary inside a tile
    ((257, 512), (2,), ("S1",)),
    ((257, 512), (2,), ("R",)),
    ((70001,), (2,), ("S0",)),  # 1-D, 2 tiles
    ((5, 7, 9), (2,), ("S2",)),
    ((), (2,), ("R",)),
]


@pytest.mark.parametrize(("shape", "mesh_shape", "spec"), RANDOM_LAYOUTS_2)
@pytest.mark.parametrize("distribution", [("normal", 0.5, 2.0), ("uniform", -1.0, 3.0), ("trunc", 0.0, 1.0, -0.5, 0.5)])
def test_random_fill_is_sharding_independent_two_ranks(ranks2, shape, mesh_shape, spec, distribution):
    results = ranks2.run(case_random_fill, shape, mesh_shape, spec, distribution, torch.float32, "layer.weight")
    expected = random_fill_(torch.empty(shape), _distribution(distribution), seed=42, name="layer.weight")
    for full, collectives in results:
        assert collectives == 0
        assert torch.equal(full, expected)


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "spec"),
    [
        ((257, 512), (4,), ("S0",)),
        ((9, 3), (4,), ("S0",)),  # last rank empty
        ((257, 512), (2, 2), ("S0", "S1")),
        ((257, 512), (2, 2), ("S1", "S0")),
        ((257, 300), (2, 2), ("S0", "S0")),
        ((5, 7, 9), (2, 2), ("S1", "S2")),
    ],
)
def test_random_fill_is_sharding_independent_four_ranks(ranks4, shape, mesh_shape, spec):
    results = ranks4.run(case_random_fill, shape, mesh_shape, spec, ("normal", 0.0, 0.02), torch.float32, "w")
    expected = random_fill_(torch.empty(shape), Normal(0.0, 0.02), seed=42, name="w")
    for full, collectives in results:
        assert collectives == 0
        assert torch.equal(full, expected)


def test_random_fill_bfloat16_is_cast_of_float32_draw(ranks2):
    results = ranks2.run(case_random_fill, (257, 512), (2,), ("S0",), ("normal", 0.0, 1.0), torch.bfloat16, "w")
    expected = random_fill_(torch.empty(257, 512), Normal(), seed=42, name="w").to(torch.bfloat16)
    for full, _ in results:
        assert full.dtype == torch.bfloat16
        assert torch.equal(full, expected)


def test_random_fill_fsdp_over_tp(ranks4):
    results = ranks4.run(case_random_fill_fsdp_over_tp)
    shapes = {"emb.weight": (257, 6), "a.weight": (9, 6), "a.bias": (9,), "b.weight": (7, 9), "b.bias": (7,)}
    for full, collectives in results:
        assert collectives == 0
        for name, shape in shapes.items():
            assert torch.equal(full[name], random_fill_(torch.empty(shape), Normal(0.0, 0.02), seed=7, name=name))


@pytest.mark.parametrize(("mesh_shape", "spec"), [((2,), ("S0",)), ((2,), ("S1",)), ((2,), ("R",))])
def test_deterministic_fills_sharded(ranks2, mesh_shape, spec):
    for constant, copied, broadcast in ranks2.run(case_deterministic_fills, mesh_shape, spec):
        assert torch.equal(constant, torch.full((9, 6), 3.25))
        assert torch.equal(copied, torch.arange(54, dtype=torch.float32).view(9, 6))
        assert torch.equal(broadcast, torch.arange(6, dtype=torch.float32).expand(9, 6))


def test_random_fill_is_a_function_of_seed_and_name():
    def draw(seed, name):
        return random_fill_(torch.empty(300, 400), Normal(), seed=seed, name=name)

    first = draw(1, "a.weight")
    assert torch.equal(first, draw(1, "a.weight"))
    assert not torch.equal(first, draw(2, "a.weight"))
    assert not torch.equal(first, draw(1, "b.weight"))
    # Tiles are independent streams: the rows of the second tile are not a repeat of the first.
    assert not torch.equal(first[:100], first[163:263])


def test_random_fill_distributions_statistics():
    normal = random_fill_(torch.empty(1000, 1000), Normal(0.5, 2.0), seed=3, name="n")
    assert abs(normal.mean().item() - 0.5) < 0.01
    assert abs(normal.std().item() - 2.0) < 0.01
    uniform = random_fill_(torch.empty(1000, 1000), Uniform(-1.0, 3.0), seed=3, name="u")
    assert uniform.min().item() >= -1.0 and uniform.max().item() < 3.0
    assert abs(uniform.mean().item() - 1.0) < 0.01
    truncated = random_fill_(torch.empty(1000, 1000), TruncatedNormal(0.0, 1.0, -0.5, 0.5), seed=3, name="t")
    assert truncated.min().item() >= -0.5 and truncated.max().item() <= 0.5
    # Truncated to |x| <= 0.5 sigma, the std is about 0.2854 of the untruncated one.
    assert abs(truncated.std().item() - 0.2854) < 0.003
