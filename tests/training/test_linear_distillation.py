"""The chunked distillation step: its three losses and every gradient of the student equal the full
path's (both models' whole logits) in one process and under ddp and fsdp2, with chunks smaller
than the micro-batch, a temperature, masked labels and a packed row — and no ``[tokens,
vocabulary]`` tensor is ever formed.

The reference is the same student loaded with ``loss="full"``. Chunks of 7 tokens split every row
(24 positions) unevenly, so a chunk straddles rows and the packed row's boundary.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.training import distillation_step, freeze_teacher
from nemo_wrap.training.linear_distillation import distillation_loss_plan
from tests.support.families import family_config
from tests.support.tiny_models import tiny_config

SEQUENCE, VOCAB, CHUNK, TEMPERATURE = 24, 257, 7, 2.0
ONE_LAYER_QWEN2 = ("qwen2", {"num_hidden_layers": 1, "tie_word_embeddings": False})
PAIRS = {  # student config, teacher config, the teacher's loss path (softcaps far below Gemma 2's 30: they matter)
    "llama-qwen2": (("llama", {}), ONE_LAYER_QWEN2, "chunked"),
    "llama-full-teacher": (("llama", {}), ONE_LAYER_QWEN2, "full"),
    "gemma2-softcap": (
        ("gemma2", {"final_logit_softcapping": 2.0}),
        ("gemma2", {"final_logit_softcapping": 3.0}),
        "chunked",
    ),
}


def _global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Four rows: a packed one (positions restart, no label across the boundary), a masked
    prompt, right padding, and a whole row."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB, (4, SEQUENCE), generator=generator)
    labels = input_ids.clone()
    position_ids = torch.arange(SEQUENCE).repeat(4, 1)
    position_ids[0, 10:] -= 10
    labels[0, 10] = -100
    labels[1, :9] = -100
    labels[2, 17:] = -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _rows(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


def _with_chunk(model, tokens: int):
    """``model`` whose loss plan computes ``tokens`` tokens a chunk (the default, 512, is one chunk here)."""
    report = model.nemo_state.load_report
    plan = replace(report.plan, loss=replace(report.plan.loss, chunk_tokens=tokens))
    model.nemo_state.load_report = replace(report, plan=plan)
    return model


def _build(kind_and_overrides, seed: int, setup=None, loss: str = "chunked"):
    kind, overrides = kind_and_overrides
    config = tiny_config(kind, **overrides)
    options = LoadOptions(seed=seed, loss=loss)
    return _with_chunk(NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, options=options), CHUNK)


def _models(pair: str, student_loss: str, setup=None, teacher_setup=None):
    student, teacher, teacher_loss = PAIRS[pair]
    return _build(student, 7, setup, student_loss), freeze_teacher(_build(teacher, 11, teacher_setup, teacher_loss))


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _step(student, teacher, micro_batches, kd_ratio: float) -> tuple[tuple[float, float, float], dict]:
    """The step's (loss, CE, KD) and every student gradient, read just before the optimizer step."""
    grads: dict[str, torch.Tensor] = {}
    names = {parameter: name for name, parameter in student.named_parameters()}
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(
        lambda *_: grads.update({names[p]: _whole(p.grad) for p in names if p.grad is not None})
    )
    result = distillation_step(student, teacher, optimizer, micro_batches, kd_ratio, TEMPERATURE)
    return (result.loss, result.ce_loss, result.kd_loss), grads


def _assert_same(got, expected) -> dict[str, float]:
    """Losses to rtol 1e-5; each gradient to rtol 1e-5 with an atol of 1e-5 of its largest entry
    (fp32: the chunks only change the summation order). Returns each gradient's max abs difference."""
    (losses, grads), (expected_losses, expected_grads) = got, expected
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in expected_grads.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")
    return {name: float((grads[name] - grad).abs().max()) for name, grad in expected_grads.items()}


def _one_process_batches() -> list[dict[str, torch.Tensor]]:
    batch = _global_batch()
    return [_rows(batch, slice(0, 2)), _rows(batch, slice(2, 4))]


# -- one process ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kd_ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("pair", PAIRS)
def test_the_chunked_step_equals_the_full_path(one_thread, pair, kd_ratio):
    chunked_student, teacher = _models(pair, "chunked")
    full_student, _ = _models(pair, "full")
    assert distillation_loss_plan(chunked_student).path is LossPath.CHUNKED
    assert distillation_loss_plan(full_student).path is LossPath.FULL
    got = _step(chunked_student, teacher, _one_process_batches(), kd_ratio)
    expected = _step(full_student, teacher, _one_process_batches(), kd_ratio)
    _assert_same(got, expected)
    assert expected[0][2] > 0.01  # the teachers differ from the student: the KD term is there


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor an operation allocates while active whose last dimension is
    the whole vocabulary (logits, their softmaxes or their gradients). Views allocate nothing: the
    head weight's transpose, broadcast for the last position's matmul, is one."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for produced in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(produced, torch.Tensor) and produced.dim() and produced.shape[-1] == VOCAB:
                self.largest = max(self.largest, produced.numel())
        return out


def test_the_chunked_step_never_forms_a_tokens_by_vocabulary_tensor(one_thread):
    largest = {}
    for loss in ("chunked", "full"):
        student, teacher = _models("llama-qwen2", loss)
        with _LargestLogits() as mode:
            _step(student, teacher, [_global_batch()], 0.5)
        largest[loss] = mode.largest
    assert largest["full"] >= 4 * SEQUENCE * VOCAB  # the check sees the full path's logits
    assert largest["chunked"] <= max(CHUNK, 4) * VOCAB  # a chunk, or each row's last position (logits_to_keep=1)


def test_the_students_the_chunked_step_leaves_on_the_full_path_are_named():
    student = _build(("llama", {}), 7)
    student.nemo_state.setup = DistributedSetup.build("fsdp2", 2, tp_size=2)  # read, no collective
    assert distillation_loss_plan(student).describe() == (
        "full logits (tensor parallel: the KL of vocabulary-sharded chunks is not built)"
    )
    config = family_config("mixtral")
    config.output_router_logits = True
    moe = NeMoAutoModelForCausalLM.from_config(config, options=LoadOptions(seed=7))
    assert "load-balancing loss is assembled beside the logits" in distillation_loss_plan(moe).describe()


# -- two ranks -----------------------------------------------------------------------------------------------------
def case_chunked_step_per_layout() -> dict[str, list[tuple[tuple[float, float, float], dict]]]:
    """Each layout's two steps (the optimizer's rate is 0: the same step twice) on this rank's two
    rows, one micro-batch each. fsdp2 shards the teacher too: its head is gathered whole with
    full_tensor. By default (``reshard_after_forward="layers"``) the root stays gathered after a
    forward no backward follows; the step reshards it, so the next step reads the shards again
    and never FSDP's gathered copy; with ``always`` it is resharded by FSDP. ddp's teacher is whole."""
    results = {}
    layouts = {
        "ddp": ("ddp", {}),
        "fsdp2": ("fsdp2", {}),
        "fsdp2-root-resharded": ("fsdp2", {"reshard_after_forward": "always"}),
    }
    for name, (strategy, options) in layouts.items():
        setup = DistributedSetup.build(strategy, 2, **options)
        student, teacher = _models("llama-qwen2", "chunked", setup, None if strategy == "ddp" else setup)
        assert distillation_loss_plan(student).path is LossPath.CHUNKED
        rank, batch, results[name] = setup.dp_rank(), _global_batch(), []
        micro_batches = [_rows(batch, slice(2 * rank, 2 * rank + 1)), _rows(batch, slice(2 * rank + 1, 2 * rank + 2))]
        for _ in range(2):
            assert isinstance(teacher.get_output_embeddings().weight, DTensor) == (strategy == "fsdp2")
            results[name].append(_step(student, teacher, micro_batches, 0.5))
    return results


def test_two_ranks_chunked_equal_one_process_full(ranks2, one_thread):
    student, teacher = _models("llama-qwen2", "full")
    expected = _step(student, teacher, _one_process_batches(), 0.5)
    for per_layout in ranks2.run(case_chunked_step_per_layout):
        assert per_layout.keys() == {"ddp", "fsdp2", "fsdp2-root-resharded"}
        for layout, steps in per_layout.items():
            for got in steps:
                assert _assert_same(got, expected), layout
