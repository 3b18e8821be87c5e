"""``NeMoPreTrainedModel`` on real transformers models: walk, seeding, loaded names, ties, sharding.

The reference for every sharded run is the same wrapped class initialized on one process (this
one) with the same seed: built on meta, ``to_empty``, ``initialize_weights``. Sharded runs must
reproduce it bit for bit after ``full_tensor()``.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
import transformers.initialization as hf_init
from torch import nn

from nemo_wrap.errors import (
    InvalidInitArgumentError,
    NotATransformersModelError,
    TiedWeightLayoutError,
    UnknownInitTargetError,
    UnsupportedInitFunctionError,
)
from nemo_wrap.initialization import NeMoPreTrainedModel, nemo_model_class

SENTINEL = 1234.5
SEED = 20240611

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)


def _spec(key):
    """(transformers class, tiny config) for each supported family; vocab 257 or 97, pad row set."""
    t = transformers
    specs = {
        "llama": (t.LlamaForCausalLM, lambda: t.LlamaConfig(vocab_size=257, pad_token_id=5, **_COMMON)),
        "qwen2": (t.Qwen2ForCausalLM, lambda: t.Qwen2Config(vocab_size=97, pad_token_id=96, **_COMMON)),
        "qwen3": (t.Qwen3ForCausalLM, lambda: t.Qwen3Config(vocab_size=257, pad_token_id=0, head_dim=16, **_COMMON)),
        "mistral": (t.MistralForCausalLM, lambda: t.MistralConfig(vocab_size=97, pad_token_id=40, **_COMMON)),
        "gemma": (t.GemmaForCausalLM, lambda: t.GemmaConfig(vocab_size=257, pad_token_id=0, head_dim=16, **_COMMON)),
        "gemma3": (
            t.Gemma3ForCausalLM,
            lambda: t.Gemma3TextConfig(vocab_size=257, pad_token_id=256, head_dim=16, **_COMMON),
        ),
        "phi3": (t.Phi3ForCausalLM, lambda: t.Phi3Config(vocab_size=97, pad_token_id=96, **_COMMON)),
        "gpt2": (
            t.GPT2LMHeadModel,
            lambda: t.GPT2Config(
                vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2
            ),
        ),
    }
    cls, config = specs[key]
    return cls, config()


MODELS = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "phi3", "gpt2"]


def _meta_model(key, **config_overrides):
    cls, config = _spec(key)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    with torch.device("meta"):
        return nemo_model_class(cls)(config)


def _named_tensors(model):
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _fill_sentinel(model):
    from nemo_wrap.initialization.geometry import local_shard

    with torch.no_grad():
        for _, tensor in _named_tensors(model):
            local_shard(tensor).fill_(SENTINEL)


def _full_state(model):
    """Every parameter and buffer (non-persistent ones included) as a plain full tensor."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in _named_tensors(model)
        }


def _reference(key, seed=SEED):
    model = _meta_model(key)
    model.to_empty(device="cpu")
    _fill_sentinel(model)
    model.initialize_weights(seed=seed)
    return _full_state(model)


def _assert_clean(state, skip=()):
    for name, tensor in state.items():
        if name in skip:
            continue
        values = tensor.float()
        assert not (values == SENTINEL).any(), f"{name} kept the sentinel"
        assert torch.isfinite(values).all(), f"{name} has NaN/Inf"


# -- layouts built inside rank processes -------------------------------------------------------


def _decoder_layers(model):
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList))


def _shard_manually(model, mesh, placements_for):
    """Replace every parameter by an (empty) DTensor with the given placements.

    Each module gets its own DTensor, so tied parameters come apart, as they do under
    ``to_empty`` or ``parallelize_module``: initialization must tie them again.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            placements = placements_for(module, param)
            local_shape, _ = compute_local_shape_and_global_offset(param.shape, mesh, placements)
            local = torch.empty(local_shape, dtype=param.dtype, device="meta")
            stride = torch.empty(param.shape, device="meta").stride()
            tensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=stride)
            setattr(module, name, nn.Parameter(tensor, requires_grad=param.requires_grad))


def _tensor_parallel_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and "embed_tokens" in name:
            plan[name] = RowwiseParallel()
        elif isinstance(module, nn.Linear):
            plan[name] = RowwiseParallel() if name.endswith(("o_proj", "down_proj")) else ColwiseParallel()
    return plan


def _build_layout(key, layout):
    """A meta model laid out as ``layout`` on the current ranks, then materialized on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = _meta_model(key)
    world = torch.distributed.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "shard1":  # every matrix split along its columns, vectors along their length
        mesh = init_device_mesh("cpu", (world,))
        _shard_manually(model, mesh, lambda _m, p: [Shard(1 if p.dim() >= 2 else 0)])
    elif layout == "grid2d":
        mesh = init_device_mesh("cpu", (2, 2))
        _shard_manually(model, mesh, lambda _m, p: [Shard(0), Shard(1)] if p.dim() >= 2 else [Shard(0), Replicate()])
    elif layout == "fsdp_over_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _tensor_parallel_plan(model))
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    # "replicated": every rank keeps the whole plain model, as under DDP.
    model.to_empty(device="cpu")
    return model


# -- rank cases --------------------------------------------------------------------------------


def case_sharded_init(key, layout):
    """Initialize under ``layout``; rank 0 returns the full state, every rank its collective count."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard

    model = _build_layout(key, layout)
    _fill_sentinel(model)
    with CommDebugMode() as comm:
        model.initialize_weights(seed=SEED)
    params = dict(model.named_parameters())
    sharded = sum(isinstance(p, DTensor) for p in params.values())
    strided = any(isinstance(pl, _StridedShard) for p in params.values() if isinstance(p, DTensor) for pl in p.placements)
    state = _full_state(model)
    rank = torch.distributed.get_rank()
    return {
        "state": state if rank == 0 or layout == "replicated" else None,
        "collectives": comm.get_total_counts(),
        "sharded": sharded,
        "params": len(params),
        "strided": strided,
    }


def case_loaded_names_fsdp(key, loaded):
    """Loaded parameters keep their (pattern) values bit for bit; everything else is initialized."""
    from nemo_wrap.initialization.geometry import local_shard

    model = _build_layout(key, "fsdp")
    _fill_sentinel(model)
    pattern = {}
    with torch.no_grad():
        for name in loaded:
            local = local_shard(model.get_parameter(name))
            local.copy_(torch.randn(local.shape, generator=torch.Generator().manual_seed(len(name))))
            pattern[name] = local.clone()
    model.initialize_weights(loaded_names=loaded, seed=SEED)
    untouched = {name: torch.equal(local_shard(model.get_parameter(name)), pattern[name]) for name in loaded}
    return untouched, _full_state(model)


def case_tied_fsdp_keeps_tie(key):
    """FSDP2 keeps a tie through ``to_empty`` (one shared parameter): init must not break it."""
    model = _build_layout(key, "fsdp")
    source = next(iter(model.get_expanded_tied_weights_keys(all_submodels=True).values()))
    _fill_sentinel(model)
    model.initialize_weights(seed=SEED)
    state = _full_state(model)
    return model.get_parameter(source) is model.lm_head.weight, torch.equal(state["lm_head.weight"], state[source])


def case_tied_layout_mismatch():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    model = _meta_model("gemma")
    mesh = init_device_mesh("cpu", (2,))
    # Input embedding split by vocabulary, tied output head split by hidden size.
    _shard_manually(model, mesh, lambda module, _: [Shard(1 if module is model.lm_head else 0)])
    model.to_empty(device="cpu")
    with pytest.raises(TiedWeightLayoutError, match="lm_head.weight"):
        model.initialize_weights(seed=SEED)
    return True


# -- single-process tests ------------------------------------------------------------------------


def test_wrapped_class_is_cached_and_mixin_first():
    cls, _ = _spec("llama")
    wrapped = nemo_model_class(cls)
    assert wrapped.__name__ == "NeMoLlamaForCausalLM"
    assert wrapped.__mro__[1:3] == (NeMoPreTrainedModel, cls)
    assert nemo_model_class(cls) is wrapped
    assert nemo_model_class(wrapped) is wrapped
    assert not wrapped.is_custom_code()  # loads like the original class
    assert cls.__name__ == "LlamaForCausalLM"  # the original is not renamed


@pytest.mark.parametrize("not_a_model", [nn.Linear, int, "LlamaForCausalLM"])
def test_wrapping_refuses_non_models(not_a_model):
    with pytest.raises(NotATransformersModelError, match="cls"):
        nemo_model_class(not_a_model)


@pytest.mark.parametrize("key", MODELS)
def test_every_tensor_initialized_and_distributions_match_transformers(key):
    cls, config = _spec(key)
    ours = _reference(key)
    _assert_clean(ours)
    torch.manual_seed(0)
    hf_model = cls(config)
    theirs = {n: t.detach() for n, t in _named_tensors(hf_model)}
    assert ours.keys() == theirs.keys()
    buffers = {n for n, _ in hf_model.named_buffers()}
    random_checked = 0
    for name, reference in theirs.items():
        value, reference = ours[name].float(), reference.float()
        if name in buffers or (reference == reference.flatten()[0]).all():
            # Deterministic: rotary inv_freq, embed_scale, zeros, ones.
            assert torch.equal(value, reference), name
            continue
        n = reference.numel()
        if getattr(config, "pad_token_id", None) is not None and name.endswith(("embed_tokens.weight", "wte.weight")):
            assert not value[config.pad_token_id].any(), name
        if n >= 1024:
            assert abs(value.std().item() / reference.std().item() - 1) < 0.08, name
            assert abs(value.mean().item() - reference.mean().item()) < 5 * reference.std().item() * math.sqrt(2 / n), name
            random_checked += 1
    assert random_checked >= 8


def test_gpt2_depth_scaled_projection_std():
    state = _reference("gpt2")
    # Conv1D rule (0.02), then the attention/MLP rule re-draws c_proj with 0.02 / sqrt(2 * n_layer).
    assert abs(state["transformer.h.0.attn.c_proj.weight"].std().item() - 0.01) < 0.001
    assert abs(state["transformer.h.0.mlp.c_fc.weight"].std().item() - 0.02) < 0.001


def test_gemma_norms_zero_centred():
    state = _reference("gemma")
    assert not state["model.norm.weight"].any()
    assert not state["model.layers.0.input_layernorm.weight"].any()


def test_plain_construction_uses_the_seeded_walk():
    """Built without meta, nested ``LlamaModel.post_init`` flags its modules; we must re-draw them."""
    cls, config = _spec("llama")
    torch.manual_seed(SEED)
    model = nemo_model_class(cls)(config)
    state = _full_state(model)
    reference = _reference("llama")
    for name in reference:
        assert torch.equal(state[name], reference[name]), name


def test_seed_resolution():
    reference = _reference("qwen2", seed=11)
    torch.manual_seed(11)
    model = _meta_model("qwen2")
    model.to_empty(device="cpu")
    model.initialize_weights()  # default: torch.initial_seed()
    assert all(torch.equal(t, reference[n]) for n, t in _full_state(model).items())
    torch.manual_seed(99)
    model.initialize_weights(seed=11)  # the argument wins over torch's seed
    assert all(torch.equal(t, reference[n]) for n, t in _full_state(model).items())
    model.initialize_weights(seed=12)
    assert not torch.equal(_full_state(model)["lm_head.weight"], reference["lm_head.weight"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": "7"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"loaded_names": "lm_head.weight"}, "loaded_names"),
        ({"loaded_names": {"lm_head.weight", "model.embed_tokens.weigth"}}, "embed_tokens.weigth"),
    ],
)
def test_invalid_arguments(kwargs, match):
    model = _meta_model("llama")
    with pytest.raises(InvalidInitArgumentError, match=match):
        model.initialize_weights(**kwargs)


def test_meta_model_is_left_alone():
    model = _meta_model("llama")
    model.initialize_weights(seed=1)
    assert all(t.is_meta for _, t in _named_tensors(model))


@pytest.mark.parametrize("via", ["argument", "flag"])
def test_loaded_names_and_flags_untouched(via):
    model = _meta_model("llama")
    model.to_empty(device="cpu")
    _fill_sentinel(model)
    loaded = ["model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    with torch.no_grad():
        for name in loaded:
            model.get_parameter(name).fill_(-3.0)
    if via == "argument":
        model.initialize_weights(loaded_names=set(loaded), seed=SEED)
    else:
        for name in loaded:
            model.get_parameter(name)._is_hf_initialized = True
        model.initialize_weights(seed=SEED)
    state = _full_state(model)
    for name in loaded:
        assert (state[name] == -3.0).all(), name  # padding row included: a loaded weight is not ours to edit
    _assert_clean(state, skip=loaded)
    reference = _reference("llama")
    for name in set(reference) - set(loaded):
        assert torch.equal(state[name], reference[name]), name


def test_tied_weights_are_one_tensor_after_init():
    model = _meta_model("gemma")
    model.to_empty(device="cpu")  # breaks the tie
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _fill_sentinel(model)
    model.initialize_weights(seed=SEED)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight[0].any()  # the embedding rule (with padding row) won, not the Linear's
    _assert_clean(_full_state(model))


def test_tied_loaded_target_is_kept_and_copied_to_source():
    model = _meta_model("gemma")
    model.to_empty(device="cpu")
    _fill_sentinel(model)
    with torch.no_grad():
        model.lm_head.weight.fill_(0.5)
    model.initialize_weights(loaded_names={"lm_head.weight"}, seed=SEED)
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert (model.lm_head.weight == 0.5).all()


def test_interception_is_scoped_to_the_walk():
    before = {name: getattr(hf_init, name) for name in (*hf_init.TORCH_INIT_FUNCTIONS, "copy_")}
    torch_normal = torch.nn.init.normal_
    model = _meta_model("llama")
    model.to_empty(device="cpu")
    model.initialize_weights(seed=1)
    assert {name: getattr(hf_init, name) for name in before} == before
    assert torch.nn.init.normal_ is torch_normal
    # Outside the walk the functions behave as torch's: driven by the global generator.
    torch.manual_seed(3)
    first = hf_init.normal_(torch.empty(5))
    torch.manual_seed(3)
    assert torch.equal(first, torch.empty(5).normal_())


class _VariedInitLlama(transformers.LlamaForCausalLM):
    """Exercises the init functions the listed models do not use, through both namespaces."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.lm_head:
            hf_init.trunc_normal_(module.weight, std=0.02, a=-0.03, b=0.03)
            torch.nn.init.uniform_(module.weight, -0.5, 0.5)  # torch's namespace, called second: wins
        elif module is self:  # visited last; LlamaModel's modules are reached from here
            hf_init.lecun_normal_(module.model.embed_tokens.weight)
            hf_init.trunc_normal_(module.model.norm.weight, mean=1.0, std=0.1, a=0.9, b=1.1)


class _OrthogonalHeadLlama(transformers.LlamaForCausalLM):
    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.lm_head:
            hf_init.orthogonal_(module.weight)


class _SlicingLlama(transformers.LlamaForCausalLM):
    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self.lm_head:
            hf_init.zeros_(module.weight[0])


def test_uniform_trunc_normal_and_lecun_are_seeded_fills():
    from nemo_wrap.initialization import TruncatedNormal, Uniform, random_fill_

    _, config = _spec("llama")
    config.num_hidden_layers = 1
    with torch.device("meta"):
        model = nemo_model_class(_VariedInitLlama)(config)
    model.to_empty(device="cpu")
    model.initialize_weights(seed=SEED)
    with torch.no_grad():
        head = random_fill_(torch.empty(257, 64), Uniform(-0.5, 0.5), seed=SEED, name="lm_head.weight")
        assert torch.equal(model.lm_head.weight, head)
        norm = random_fill_(torch.empty(64), TruncatedNormal(1.0, 0.1, 0.9, 1.1), seed=SEED, name="model.norm.weight")
        assert torch.equal(model.model.norm.weight, norm)
        assert (norm >= 0.9).all() and (norm <= 1.1).all()
        # lecun_normal_: truncated normal with std sqrt(1 / fan_in) / 0.8796..., fan_in = 64 columns.
        lecun = TruncatedNormal(0.0, math.sqrt(1 / 64) / 0.87962566103423978)
        embed = random_fill_(torch.empty(257, 64), lecun, seed=SEED, name="model.embed_tokens.weight")
        assert torch.equal(model.model.embed_tokens.weight, embed)


def test_unsupported_init_function_names_the_parameter():
    _, config = _spec("llama")
    with torch.device("meta"):
        model = nemo_model_class(_OrthogonalHeadLlama)(config)
    model.to_empty(device="cpu")
    with pytest.raises(UnsupportedInitFunctionError, match="orthogonal_ on 'lm_head.weight'"):
        model.initialize_weights(seed=1)
    # A loaded target is skipped before the function matters.
    model.initialize_weights(loaded_names={"lm_head.weight"}, seed=1)


def test_write_to_a_slice_is_refused():
    _, config = _spec("llama")
    with torch.device("meta"):
        model = nemo_model_class(_SlicingLlama)(config)
    model.to_empty(device="cpu")
    with pytest.raises(UnknownInitTargetError, match="'lm_head'"):
        model.initialize_weights(seed=1)


def test_init_weights_called_alone_matches_the_walk():
    model = _meta_model("llama")
    model.to_empty(device="cpu")
    _fill_sentinel(model)
    torch.manual_seed(SEED)  # outside a walk, the rule is seeded by torch's seed
    model._init_weights(model.model.embed_tokens)
    weight = model.model.embed_tokens.weight.detach()
    assert torch.equal(weight, _reference("llama")["model.embed_tokens.weight"])
    assert not weight[5].any()


# -- multi-rank tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = _reference(key)
        return cache[key]

    return get


def _assert_matches(key, state, reference):
    """Equal to the one-process result, and sound on its own (the reference shares our code)."""
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    _assert_clean(state)
    for target, source in _meta_model(key).get_expanded_tied_weights_keys(all_submodels=True).items():
        assert torch.equal(state[target], state[source]), target


@pytest.mark.parametrize("layout", ["fsdp", "shard1", "replicated"])
@pytest.mark.parametrize("key", MODELS)
def test_two_rank_layouts_reproduce_one_process(ranks2, references, key, layout):
    results = ranks2.run(case_sharded_init, key, layout)
    for result in results:
        assert result["collectives"] == 0
        assert result["sharded"] == (0 if layout == "replicated" else result["params"])
    _assert_matches(key, results[0]["state"], references(key))
    if layout == "replicated":  # DDP-like: each rank's own copy equals the one-process result
        _assert_matches(key, results[1]["state"], references(key))


@pytest.mark.parametrize(
    ("key", "layout"),
    [
        ("llama", "fsdp_over_tp"),
        ("qwen3", "fsdp_over_tp"),
        ("gemma", "fsdp_over_tp"),
        ("phi3", "fsdp_over_tp"),
        ("llama", "grid2d"),
        ("gpt2", "grid2d"),
        ("mistral", "fsdp"),
    ],
)
def test_four_rank_layouts_reproduce_one_process(ranks4, references, key, layout):
    results = ranks4.run(case_sharded_init, key, layout)
    for result in results:
        assert result["collectives"] == 0
        assert result["sharded"] == result["params"]
    if layout == "fsdp_over_tp":
        assert results[0]["strided"]
    _assert_matches(key, results[0]["state"], references(key))


def test_loaded_names_untouched_under_fsdp(ranks2, references):
    loaded = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    results = ranks2.run(case_loaded_names_fsdp, "qwen3", loaded)
    reference = references("qwen3")
    for untouched, state in results:
        assert all(untouched.values()), untouched
        _assert_clean(state, skip=loaded)
        for name in set(reference) - set(loaded):
            assert torch.equal(state[name], reference[name]), name


@pytest.mark.parametrize("key", ["gemma", "gpt2"])
def test_tied_weights_stay_one_parameter_under_fsdp(ranks2, key):
    assert ranks2.run(case_tied_fsdp_keeps_tie, key) == [(True, True), (True, True)]


def test_tied_weights_sharded_differently_are_refused(ranks2):
    assert ranks2.run(case_tied_layout_mismatch) == [True, True]
