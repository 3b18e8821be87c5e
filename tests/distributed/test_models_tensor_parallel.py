"""Tensor parallelism of our fused models on two real gloo ranks (tp=2).

Every rank builds the same seeded model twice: one stays whole (the single-process reference), the
other is parallelized with the architecture's plan. Logits, loss, every parameter's gradient
(gathered with ``full_tensor``) and 20 greedy tokens must match the reference; tied models must
come out with ``lm_head.weight`` *being* the embedding's DTensor.
"""

from __future__ import annotations

import pytest

_ARCHITECTURES = {
    "llama": ("LlamaConfig", "nemo_wrap.models.llama", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "nemo_wrap.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "nemo_wrap.models.qwen3", "Qwen3ForCausalLM"),
}


def _build(arch: str, kv_heads: int, tied: bool, sequence_parallel: bool = False):
    """(model class, the tensor-parallel entry point, a tiny config) for ``arch``.

    The class is the one ``NeMoAutoModelForCausalLM`` returns for the architecture (our fused class
    with saving composed in); the entry point applies the architecture spec's plan (with the
    residual stream cut along the sequence if ``sequence_parallel``).
    """
    import importlib
    from functools import partial

    import transformers

    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.distributed.tensor_parallel import apply_tensor_parallel

    config_name, package, architecture = _ARCHITECTURES[arch]
    config_class = getattr(transformers, config_name)
    spec = importlib.import_module(package).SPEC
    extra = {"head_dim": 24} if arch == "qwen3" else {"attention_bias": True} if arch == "llama" else {}
    config = config_class(
        vocab_size=97,  # odd: the vocab-parallel embedding and lm_head shard unevenly (49 + 48 rows)
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        pad_token_id=0,
        architectures=[architecture],
        **extra,
    )
    model_class = NeMoAutoModelForCausalLM.model_class(config)
    assert issubclass(model_class, spec.model_class)
    return model_class, partial(apply_tensor_parallel, plan=spec.parallel_plan(sequence_parallel)), config


def _seeded_model(model_class, config):
    """The same weights every call; biases and norm weights perturbed so their layout matters."""
    import torch

    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.2)
    return model


def case_tensor_parallel_matches_one_process(
    arch: str, kv_heads: int, tied: bool, sequence_parallel: bool = False, tokens: int = 10
) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    model_class, parallelize, config = _build(arch, kv_heads, tied, sequence_parallel)
    reference = _seeded_model(model_class, config)
    model = parallelize(_seeded_model(model_class, config), init_device_mesh("cpu", (2,)))

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config.vocab_size, (2, tokens), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    streams = []  # how the residual stream enters the second layer: cut along the sequence or whole
    model.model.layers[1].register_forward_pre_hook(
        lambda module, args: streams.append(tuple(map(str, args[0].placements)) if isinstance(args[0], DTensor) else None)
    )
    expected = reference(input_ids, attention_mask=attention_mask, labels=labels)
    actual = model(input_ids, attention_mask=attention_mask, labels=labels)
    expected.loss.backward()
    actual.loss.backward()
    real = attention_mask.bool()
    gradient_errors = {}
    reference_parameters = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        grad = parameter.grad.full_tensor() if isinstance(parameter.grad, DTensor) else parameter.grad
        gradient_errors[name] = (grad - reference_parameters[name].grad).abs().max().item()

    with torch.no_grad():
        states = zip(
            model(input_ids, output_hidden_states=True).hidden_states,
            reference(input_ids, output_hidden_states=True).hidden_states,
            strict=True,
        )
        hidden_states_error = max((state - expected_state).abs().max().item() for state, expected_state in states)
    settings = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    return {
        "logits_error": (actual.logits[real] - expected.logits[real]).abs().max().item(),
        "loss_error": (actual.loss - expected.loss).abs().item(),
        "gradient_errors": gradient_errors,
        "same_parameter_names": set(gradient_errors) == set(reference_parameters),
        "sharded_qkv_rows": model.model.layers[0].self_attn.qkv_proj.weight.to_local().shape[0],
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "stream": streams[0],
        "hidden_states_error": hidden_states_error,
        "same_tokens": torch.equal(model.generate(input_ids, **settings), reference.generate(input_ids, **settings)),
    }


def case_save_pretrained_from_tensor_parallel(tmp_dir: str) -> None:
    """A model parallelized outside nemo_wrap's pipeline (DTensors, no setup) saves collectively too."""
    from torch.distributed.device_mesh import init_device_mesh

    model_class, parallelize, config = _build("llama", 2, False)
    model = parallelize(_seeded_model(model_class, config), init_device_mesh("cpu", (2,)))
    model.save_pretrained(tmp_dir)


@pytest.mark.parametrize(
    ("arch", "kv_heads", "tied", "sequence_parallel", "tokens"),
    [
        ("llama", 2, False, False, 10),
        ("llama", 4, True, False, 10),
        ("qwen2", 2, True, False, 10),
        ("qwen3", 2, False, False, 10),
        ("qwen3", 4, True, False, 10),
        ("llama", 2, False, True, 10),
        ("qwen3", 2, True, True, 11),
    ],
    ids=[
        "llama-gqa-untied",
        "llama-mha-tied",
        "qwen2-gqa-tied",
        "qwen3-gqa-untied",
        "qwen3-mha-tied",
        "llama-sequence-parallel",
        "qwen3-sequence-parallel-odd-length",
    ],
)
def test_tensor_parallel_matches_one_process(ranks2, arch, kv_heads, tied, sequence_parallel, tokens):
    results = ranks2.run(case_tensor_parallel_matches_one_process, arch, kv_heads, tied, sequence_parallel, tokens)
    for rank, result in enumerate(results):
        assert result["logits_error"] <= 1e-5, rank
        assert result["loss_error"] <= 1e-6, rank
        assert result["same_parameter_names"], rank
        worst = max(result["gradient_errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, (rank, worst)
        assert result["sharded_qkv_rows"] == kv_heads // 2 * (4 // kv_heads + 2) * (24 if arch == "qwen3" else 16)
        assert result["tied"] == tied, rank
        assert result["hidden_states_error"] <= 1e-5, rank
        assert result["stream"] == (("S(1)",) if sequence_parallel else None), rank
        assert result["same_tokens"], rank


def test_save_pretrained_from_tensor_parallel_loads_in_transformers(ranks2, tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    ranks2.run(case_save_pretrained_from_tensor_parallel, str(tmp_path))
    model_class, _, config = _build("llama", 2, False)
    reference = _seeded_model(model_class, config)
    expected = reference.state_dict_adapter().to_hf(reference.state_dict())
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert reloaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(reloaded[key], tensor), key
