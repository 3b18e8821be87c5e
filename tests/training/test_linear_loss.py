"""The chunked loss: the head and the cross-entropy a chunk of tokens at a time, never the whole
logits — equal to the full path (loss and every gradient) in one process and under ddp, fsdp2,
HSDP, tensor parallel (vocab-parallel, no gathered ``[tokens, vocabulary]`` tensor) and pipeline
stages (alone, × fsdp2 and × tp: the last stage computes it in its forward)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft import LoraConfig
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import BitsAndBytesConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.loading.model_state import loss_plan_of
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.models.head import CHUNKABLE_FAMILIES, HeadTransform
from nemo_wrap.training import evaluate, train_step
from nemo_wrap.training.linear_loss import linear_cross_entropy_sum, shifted_labels
from tests.support.checkpoints import write_checkpoint
from tests.support.families import FAMILIES, family_config
from tests.support.tiny_models import tiny_config

SEQUENCE, VOCAB = 40, 257
FULL = LoadOptions(loss="full")


def _batch(seed: int, rows: int = 2, packed: bool = True) -> dict[str, torch.Tensor]:
    """A packed row (positions restart) beside a row with a masked prompt and padding."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB, (rows, SEQUENCE), generator=generator)
    labels = input_ids.clone()
    labels[0, :7] = -100  # a prompt
    labels[-1, 30:] = -100  # padding
    position_ids = torch.arange(SEQUENCE).repeat(rows, 1)
    position_ids[0, 20:] -= 20  # two examples packed in row 0
    labels[0, 20] = -100  # no label across the packed boundary
    batch = {"input_ids": input_ids, "labels": labels}
    return {**batch, "position_ids": position_ids} if packed else batch


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _one_sgd_step(config, setup, options: LoadOptions, batches) -> tuple[float, float, dict[str, torch.Tensor]]:
    """The step's loss, the evaluation loss after it, and every parameter after one SGD step of
    rate 1 (so each change is minus the gradient)."""
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, options=replace(options, seed=3))
    loss = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batches).loss
    return loss, evaluate(model, batches), {name: _whole(p) for name, p in model.named_parameters()}


def _assert_same(chunked, full, rtol: float = 1e-5) -> None:
    (loss, evaluated, weights), (full_loss, full_evaluated, full_weights) = chunked, full
    assert loss == pytest.approx(full_loss, rel=rtol) and evaluated == pytest.approx(full_evaluated, rel=rtol)
    for name, value in weights.items():
        scale = float(full_weights[name].abs().max())
        torch.testing.assert_close(value, full_weights[name], rtol=rtol, atol=rtol * scale, msg=name)


# -- the sum itself ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_tokens", [1, 7, 32, 80, 1000])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_chunked_sum_and_its_gradients_equal_the_full_cross_entropy(chunk_tokens, softcap):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, SEQUENCE, 16, generator=generator, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=generator, requires_grad=True)
    labels = shifted_labels(_batch(1)["labels"])
    summed = linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens, HeadTransform(softcap))
    summed.backward()
    chunked_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    logits = HeadTransform(softcap)(hidden @ weight.T)
    full = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    full.backward()
    torch.testing.assert_close(summed, full, rtol=1e-6, atol=0)
    for chunked_grad, full_grad in zip(chunked_grads, (hidden.grad, weight.grad)):  # fp32: summation order only
        torch.testing.assert_close(chunked_grad, full_grad, rtol=1e-5, atol=1e-5 * float(full_grad.abs().max()))


# -- one process: every family the chunked path is claimed for -----------------------------------------------------
def _family(kind: str):
    return tiny_config(kind) if kind.startswith("own-") else family_config(kind)


@pytest.mark.parametrize("kind", sorted(CHUNKABLE_FAMILIES & FAMILIES.keys()) + ["own-llama", "own-qwen3"])
def test_every_chunkable_family_trains_and_evaluates_as_on_its_full_logits(kind):
    config, batches = _family(kind), [_batch(5, packed=kind != "deepseek_v3")]  # its forward fails on packed rows
    plan = NeMoAutoModelForCausalLM.plan(config)
    assert "loss: chunked linear cross-entropy, 512 tokens a chunk" in str(plan)
    _assert_same(_one_sgd_step(config, None, LoadOptions(), batches), _one_sgd_step(config, None, FULL, batches))


def _trained(checkpoint, options: LoadOptions, checkpointing: bool, batches):
    """:func:`_one_sgd_step` of a checkpoint, with activation checkpointing where asked."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, options=replace(options, seed=3))
    if checkpointing:
        model.activation_checkpointing_enable()
    loss = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batches).loss
    return loss, evaluate(model, batches), {name: _whole(p) for name, p in model.named_parameters()}


NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
ADAPTED = {
    "lora": {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])},
    "dora": {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True)},
    "qlora": {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), "quantization_config": NF4},
    "plain": {},
}


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("adapted", ADAPTED)
def test_adapters_a_4bit_base_ties_and_activation_checkpointing_train_as_on_the_full_logits(
    tmp_path, adapted, checkpointing, tie
):
    checkpoint, batches = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=tie), [_batch(9)]
    options = LoadOptions(**ADAPTED[adapted])
    assert "loss: chunked" in str(NeMoAutoModelForCausalLM.plan(checkpoint, options=options))
    chunked = _trained(checkpoint, options, checkpointing, batches)
    _assert_same(chunked, _trained(checkpoint, replace(options, loss="full"), checkpointing, batches))


ROUTED = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"]  # the families that add a load-balancing loss


def _routed(kind: str):
    config = family_config(kind)
    config.output_router_logits = True
    return config


@pytest.mark.parametrize("kind", ROUTED)
def test_a_load_balancing_loss_trains_as_on_the_full_logits(kind):
    batch = _batch(8, packed=False)
    batch["attention_mask"] = (torch.arange(SEQUENCE) < 30).long().repeat(2, 1)  # padding counts in no statistic
    batch["attention_mask"][0] = 1
    config = _routed(kind)
    chunked, full = _one_sgd_step(config, None, LoadOptions(), [batch]), _one_sgd_step(config, None, FULL, [batch])
    _assert_same(chunked, full)
    no_router_loss = _one_sgd_step(family_config(kind), None, LoadOptions(), [batch])
    assert chunked[0] - no_router_loss[0] > 1e-4  # the load-balancing loss is in the step's


@pytest.mark.parametrize("kind", ["own-llama", "llama"])
@pytest.mark.parametrize("loss", ["chunked", "full"])
def test_a_packed_row_is_evaluated_and_trained_as_its_examples_one_by_one(kind, loss):
    """An eval-mode forward would make a cache, and transformers' masks would then read the packed
    positions as one continuing sequence: each path must evaluate the examples apart."""
    ids = torch.randint(4, VOCAB, (1, 16), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(8).repeat(1, 2)}
    batch["labels"][0, 8] = -100  # no label across the examples' boundary
    model = NeMoAutoModelForCausalLM.from_config(tiny_config(kind), options=LoadOptions(seed=1, loss=loss))
    with torch.no_grad():
        apart = sum(float(model(input_ids=ids[:, s : s + 8], labels=ids[:, s : s + 8]).loss) for s in (0, 8)) / 2
    assert evaluate(model, [batch]) == pytest.approx(apart, rel=1e-6)
    assert train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [batch]).loss == pytest.approx(apart, rel=1e-6)


def test_under_bf16_mixed_the_chunked_path_is_within_the_full_paths_own_bf16_error():
    config, batches = tiny_config("own-llama"), [_batch(6)]
    reference = _one_sgd_step(config, None, LoadOptions(), batches)  # fp32
    mixed = LoadOptions(precision="bf16-mixed")
    chunked, full = (
        _one_sgd_step(config, None, mixed, batches),
        _one_sgd_step(config, None, replace(mixed, loss="full"), batches),
    )
    for index in (0, 1):  # the step's loss, the evaluation after it
        assert abs(chunked[index] - reference[index]) <= 2 * abs(full[index] - reference[index]) + 1e-6
    for name, value in reference[2].items():
        full_error = float((full[2][name] - value).abs().max())
        assert float((chunked[2][name] - value).abs().max()) <= 2 * full_error + 1e-6, name


def test_the_families_listed_are_those_tested():
    assert CHUNKABLE_FAMILIES == FAMILIES.keys() - {"granite"}


@pytest.mark.parametrize(
    ("config", "setup", "options", "why"),
    [
        (
            tiny_config("llama"),
            None,
            {"peft_config": LoraConfig(target_modules=["q_proj", "lm_head"])},
            "LoRA adapts lm_head",
        ),
        (tiny_config("llama"), None, {"peft_config": LoraConfig(target_modules=r".*(q_proj|lm_head)")}, "LoRA adapts"),
        (tiny_config("llama"), None, {"peft_config": LoraConfig(modules_to_save=["lm_head"])}, "LoRA adapts lm_head"),
        (
            tiny_config("llama"),
            None,
            {"adapter": "adapter-dir"},
            "an adapter directory's target modules are read after",
        ),
    ],
    ids=["lora-head", "lora-head-regex", "lora-saved-head", "adapter-dir"],
)
def test_each_reason_to_keep_the_full_logits_is_named_in_the_plan(config, setup, options, why):
    built = None if setup is None else DistributedSetup.build(setup[0], setup[1], **setup[2])
    text = str(NeMoAutoModelForCausalLM.plan(config, built, options=LoadOptions(**options)))
    assert f"loss: full logits ({why}" in text


def test_lora_elsewhere_keeps_the_chunked_loss():
    for config in (LoraConfig(target_modules="all-linear"), LoraConfig(target_modules=["q_proj", "v_proj"])):
        assert "loss: chunked" in str(
            NeMoAutoModelForCausalLM.plan(tiny_config("llama"), options=LoadOptions(peft_config=config))
        )


def test_a_4bit_head_keeps_the_full_logits(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    kept = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["q_proj"])
    assert "loss: full logits (lm_head is 4-bit" in str(NeMoAutoModelForCausalLM.plan(base, quantization_config=kept))
    default = BitsAndBytesConfig(load_in_4bit=True)  # transformers keeps the output layer unquantized
    assert "loss: chunked" in str(NeMoAutoModelForCausalLM.plan(base, quantization_config=default))


def test_what_keeps_the_full_logits_says_why_in_the_plan():
    text = str(NeMoAutoModelForCausalLM.plan(family_config("granite")))
    assert "loss: full logits (model_type='granite' is not verified for the chunked loss)" in text
    text = str(NeMoAutoModelForCausalLM.plan(tiny_config("llama"), DistributedSetup.build("fsdp2", 4, pp_size=2)))
    assert "loss: chunked linear cross-entropy" in text  # the last pipeline stage computes it in its forward
    text = str(NeMoAutoModelForCausalLM.plan(tiny_config("llama"), options=FULL))
    assert "loss: full logits (loss='full' asked)" in text
    assert "soft-capped at 30" in str(NeMoAutoModelForCausalLM.plan(family_config("gemma2")))


# -- several ranks -------------------------------------------------------------------------------------------------
def _rank_batches(setup: DistributedSetup) -> list[dict[str, torch.Tensor]]:
    rows = _batch(11, rows=4)  # the global batch, dealt over the data-parallel ranks
    per_rank = 4 // setup.dp_size
    return [{k: v[setup.dp_rank() * per_rank : (setup.dp_rank() + 1) * per_rank] for k, v in rows.items()}]


def case_chunked_equals_full(strategy: str, world: int, degrees: dict, kind: str):
    setup = DistributedSetup.build(strategy, world, **degrees)
    config, batches = _routed(kind) if kind in ROUTED else tiny_config(kind), _rank_batches(setup)
    chunked = _one_sgd_step(config, setup, LoadOptions(), batches)
    _assert_same(chunked, _one_sgd_step(config, setup, FULL, batches))
    return chunked[0]


LAYOUTS2 = {
    "fsdp2": ("fsdp2", {}),
    "ddp": ("ddp", {}),
    "tp2": ("fsdp2", {"tp_size": 2}),
    "cp2": ("fsdp2", {"cp_size": 2}),
}
LAYOUTS4 = {
    "fsdp2-tp2": ("fsdp2", {"tp_size": 2}),
    "ddp-tp2": ("ddp", {"tp_size": 2}),
    "hsdp": ("fsdp2", {"dp_replicate_size": 2}),
    "cp2-fsdp2": ("fsdp2", {"cp_size": 2}),
    "cp2-tp2": ("fsdp2", {"cp_size": 2, "tp_size": 2}),
}


@pytest.mark.parametrize("kind", ["own-llama", "llama"])
@pytest.mark.parametrize("layout", LAYOUTS2)
def test_two_ranks_chunked_equals_full(ranks2, layout, kind):
    strategy, degrees = LAYOUTS2[layout]
    first, second = ranks2.run(case_chunked_equals_full, strategy, 2, degrees, kind)
    assert first == second  # the step's loss is global: the same on every rank


@pytest.mark.parametrize("degrees", [{}, {"ep_size": 2}], ids=["fsdp2", "ep2"])
def test_a_load_balancing_loss_of_the_data_parallel_batch_is_chunked_as_on_the_full_logits(ranks2, degrees):
    first, second = ranks2.run(case_chunked_equals_full, "fsdp2", 2, degrees, "mixtral")
    assert first == second


@pytest.mark.parametrize("layout", LAYOUTS4)
def test_four_ranks_chunked_equals_full(ranks4, layout):
    strategy, degrees = LAYOUTS4[layout]
    assert len(set(ranks4.run(case_chunked_equals_full, strategy, 4, degrees, "own-llama"))) == 1


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor this rank holds, produced by an operation while active,
    whose last dimension is the whole vocabulary (logits, their softmax or their gradient,
    gathered). The mode sees DTensors whole: what the rank holds is their local tensor.
    ``new_only``: views are not counted (a whole head's ``weight.t()`` has the vocabulary last,
    and allocates nothing)."""

    def __init__(self, new_only: bool = False) -> None:
        super().__init__()
        self.largest, self.new_only = 0, new_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.new_only and func.is_view:
            return out
        for produced in out if isinstance(out, (tuple, list)) else (out,):
            tensor = produced.to_local() if isinstance(produced, DTensor) else produced
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == VOCAB:
                self.largest = max(self.largest, tensor.numel())
        return out


def case_tensor_parallel_never_holds_the_gathered_logits(loss: str) -> int:
    setup = DistributedSetup.build("fsdp2", 2, tp_size=2)
    options = LoadOptions(seed=3, loss=loss)
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), distributed_setup=setup, options=options)
    batch = _batch(2, rows=2)
    with _LargestLogits() as largest:
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch])
    return largest.largest


def test_tensor_parallel_never_holds_a_gathered_tokens_by_vocabulary_tensor(ranks2):
    tokens = 2 * SEQUENCE
    chunked = ranks2.run(case_tensor_parallel_never_holds_the_gathered_logits, "chunked")
    full = ranks2.run(case_tensor_parallel_never_holds_the_gathered_logits, "full")
    assert min(full) >= tokens * VOCAB  # the check sees the full path's gathered logits
    assert max(chunked) <= 2 * VOCAB  # only the last position's logits (logits_to_keep=1), on each row


# -- pipeline stages: the last stage computes the chunked loss in its forward ---------------------------------------
PIPELINE_CHUNK = 8  # tokens a chunk: a micro-batch's 40 tokens take 5 chunks, some all -100


def _pipeline_micro_batches(dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """The global batch of 4 rows (a prompt, padding, a packed row), dealt over the data-parallel
    ranks, one row per micro-batch."""
    rows, per_rank = _batch(11, rows=4), 4 // dp_size
    return [
        {k: v[row : row + 1] for k, v in rows.items()} for row in range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    ]


def _gradients_of_one_step(config, setup, options: LoadOptions, micro_batches) -> dict:
    """The step's loss, every parameter's gradient as the optimizer is handed it, the evaluation
    after that SGD step (rate 1), and the largest tensor with the vocabulary last this rank
    allocated in the step and the evaluation. Chunks of 8 tokens."""
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, options=replace(options, seed=3))
    plan = loss_plan_of(model)
    if plan.path is LossPath.CHUNKED:
        model.load_report.plan = replace(model.load_report.plan, loss=replace(plan, chunk_tokens=PIPELINE_CHUNK))
    optimizer, parameters, gradients = torch.optim.SGD(model.parameters(), lr=1.0), dict(model.named_parameters()), {}
    optimizer.register_step_pre_hook(lambda *_: gradients.update({n: _whole(p.grad) for n, p in parameters.items()}))
    with _LargestLogits(new_only=True) as largest:
        loss = train_step(model, optimizer, micro_batches).loss
        evaluated = evaluate(model, micro_batches)
    return {"path": plan.path, "loss": loss, "eval": evaluated, "gradients": gradients, "largest": largest.largest}


PIPELINE_MODELS = {"untied": ("own-llama", False), "tied": ("own-llama", True), "tied-transformers": ("llama", True)}


def case_pipeline_chunked_and_full(degrees: dict, schedule: str, models: list[str]) -> dict:
    setup = DistributedSetup.build("fsdp2", dist.get_world_size(), pp_size=2, pp_schedule=schedule, **degrees)
    micro_batches = _pipeline_micro_batches(setup.dp_rank(), setup.dp_size)
    results = {"stage": setup.pp_rank()}
    for name in models:
        kind, tied = PIPELINE_MODELS[name]
        config = tiny_config(kind, tie_word_embeddings=tied)
        for options in (LoadOptions(), FULL):
            results[name, options.loss] = _gradients_of_one_step(config, setup, options, micro_batches)
    return results


def _differences(step: dict, reference: dict) -> dict[str, float]:
    """Relative differences: of the loss, of the evaluation, and the largest of any gradient's
    (its largest element difference over its largest element)."""
    gradients = {
        name: float((gradient - reference["gradients"][name]).abs().max() / reference["gradients"][name].abs().max())
        for name, gradient in step["gradients"].items()
    }
    worst = max(gradients, key=gradients.__getitem__)
    return {
        "loss": abs(step["loss"] / reference["loss"] - 1),
        "eval": abs(step["eval"] / reference["eval"] - 1),
        f"gradient ({worst})": gradients[worst],
    }


def _one_process(models: list[str]) -> dict:
    """One process's step of each model on the whole batch, on either path."""
    steps = {}
    for name in models:
        kind, tied = PIPELINE_MODELS[name]
        config = tiny_config(kind, tie_word_embeddings=tied)
        for options in (LoadOptions(), FULL):
            steps[name, options.loss] = _gradients_of_one_step(config, None, options, _pipeline_micro_batches(0, 1))
    return steps


def _check_pipeline(results: list[dict], one: dict, models: list[str]) -> None:
    """On every rank, each path's step equals one process's on the same path, and the chunked
    path equals the full path (the stages', one process's): loss, evaluation and every gradient,
    fp32, to 1e-5 (of the tensor's largest element). The last stage never allocated a
    ``[tokens, vocabulary]`` tensor on the chunked path."""
    for name in models:
        names = one[name, LossPath.FULL]["gradients"].keys()
        assert set().union(*(r[name, LossPath.FULL]["gradients"] for r in results)) == names
        for result in results:
            where = f"{name}, stage {result['stage']}"
            chunked, full = result[name, LossPath.CHUNKED], result[name, LossPath.FULL]
            assert chunked["path"] is LossPath.CHUNKED and full["path"] is LossPath.FULL, where
            for step, reference, what in (
                (chunked, one[name, LossPath.CHUNKED], "chunked / one process's chunked"),
                (full, one[name, LossPath.FULL], "full / one process's full"),
                (chunked, full, "chunked / full"),
                (chunked, one[name, LossPath.FULL], "chunked / one process's full"),
            ):
                differences = _differences(step, reference)
                print(f"{where}, {what}: {differences}")
                assert max(differences.values()) <= 1e-5, f"{where}, {what}: {differences}"
            if result["stage"] == 1:  # a micro-batch holds 40 tokens; the chunked path never 40 rows of logits
                assert chunked["largest"] <= PIPELINE_CHUNK * VOCAB < SEQUENCE * VOCAB <= full["largest"], where


def test_two_pipeline_stages_compute_the_chunked_loss_as_the_full_path_and_one_process(ranks2):
    models = ["untied", "tied", "tied-transformers"]
    one = _one_process(models)
    for schedule in ("1f1b", "gpipe"):
        _check_pipeline(ranks2.run(case_pipeline_chunked_and_full, {}, schedule, models, timeout=240), one, models)


@pytest.mark.parametrize("degrees", [{}, {"tp_size": 2}], ids=["pp-fsdp2", "pp-tp"])
def test_pipeline_stages_under_fsdp2_and_tensor_parallel_compute_the_chunked_loss_as_one_process(ranks4, degrees):
    models = ["untied", "tied"]
    results = ranks4.run(case_pipeline_chunked_and_full, degrees, "1f1b", models, timeout=300)
    _check_pipeline(results, _one_process(models), models)
