"""``preference_step``: DPO and SimPO equal TRL's trainers on one batch (loss, rewards, gradients),
the chunked path equals the full one, and every layout gives the one-process loss curve.

TRL's side runs its own trainers (``DPOTrainer``, ``CPOTrainer`` with ``loss_type="simpo"``) on
transformers' models from the same checkpoints, fp32 (``bf16=False``: TRL's default autocasts);
ours gets the very token rows TRL's collator made, rearranged into our pair layout (chosen and
rejected alternating), so the comparison is of the objectives and their gradients, not of two
tokenizations.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import InvalidSetupError, UnsupportedSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.training.distillation import freeze_teacher
from nemo_wrap.training.preference import (
    Reference,
    ReferenceSource,
    evaluate_preferences,
    preference_step,
    reference_for,
    reference_source,
)
from nemo_wrap.training.preference_loss import PreferenceObjective, PreferenceSettings, SequenceScores, pair_terms
from tests.support.chat_tokenizers import CHATML, chat_tokenizer
from tests.support.checkpoints import write_checkpoint
from tests.support.families import write_family_checkpoint
from tests.support.tiny_models import tiny_config

pytest.importorskip("trl")

BETA = 0.1
DPO = PreferenceSettings(PreferenceObjective.DPO, beta=BETA)
SIMPO = PreferenceSettings(PreferenceObjective.SIMPO, beta=2.0, simpo_gamma=0.5)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


PAIRS = {
    "prompt": [_user("hello there"), _user("how are you today?"), _user("the capital of France?")],
    "chosen": [_assistant("hello, how are you?"), _assistant("there."), _assistant("Paris is the capital.")],
    "rejected": [_assistant("France"), _assistant("today, the capital of France is Paris."), _assistant("you")],
}


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer that keeps the gradients it is asked to step with, and changes nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {parameter: name for name, parameter in model.named_parameters()}
        super().__init__(list(self.names), {})
        self.gradients: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        for parameter, name in self.names.items():
            if parameter.grad is not None:
                grad = parameter.grad
                self.gradients[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer("chatml", CHATML)


def _checkpoints(tmp_path, kind: str, tokenizer):
    """The policy's checkpoint and a reference's (the same model, every weight moved by noise)."""
    policy = write_checkpoint(
        tmp_path / "policy", kind, "random", tie=False, vocab_size=len(tokenizer), initializer_range=0.2
    )
    reference = AutoModelForCausalLM.from_pretrained(policy)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    reference.save_pretrained(tmp_path / "reference")
    return policy, tmp_path / "reference"


def _our_rows(chosen: tuple[torch.Tensor, ...], rejected: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """TRL's sequences (ids, labels, attention mask of each side) as our pair rows: chosen and
    rejected alternating, one length, right-padded."""
    length = max(chosen[0].shape[1], rejected[0].shape[1])
    names = ("input_ids", "labels", "attention_mask")
    rows = {}
    for name, first, second, value in zip(names, chosen, rejected, (0, -100, 0), strict=True):
        pair = [torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value) for t in (first, second)]
        rows[name] = torch.stack(pair, dim=1).flatten(0, 1)
    return rows


def _trl_dpo(policy_dir, reference_dir, tokenizer, tmp_path):
    """TRL's loss, metrics and gradients (transformers' names) on the three pairs, and its batch."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    arguments = DPOConfig(
        output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, gradient_checkpointing=False, beta=BETA,
        report_to="none", per_device_train_batch_size=3,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(reference_dir),
        args=arguments,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return float(loss.detach()), metrics, gradients, batch


def _assert_metrics(result, metrics, beta: float) -> None:
    """TRL's metrics, to rtol 1e-5 of the log-probabilities they are made of: a reward is β times
    a difference of two close log-probabilities, which keeps their absolute precision only."""
    log_probs = {"logps/chosen": result.chosen_log_probs, "logps/rejected": result.rejected_log_probs}
    rewards = {
        "rewards/chosen": result.chosen_rewards,
        "rewards/rejected": result.rejected_rewards,
        "rewards/margins": result.margins,
    }
    for name, value in log_probs.items():
        assert value == pytest.approx(metrics[name], rel=1e-5), name
    scale = beta * max(abs(value) for value in log_probs.values())
    for name, value in rewards.items():
        assert value == pytest.approx(metrics[name], rel=1e-5, abs=1e-5 * scale), name
    assert result.accuracy == pytest.approx(metrics["rewards/accuracies"], abs=1e-7)


def _assert_gradients(model, recorder, expected) -> None:
    """Every gradient within rtol 1e-5 of TRL's, entries near zero within 1e-5 of their tensor's
    largest (a sum of many terms that nearly cancel keeps only absolute precision)."""
    mapped = model.state_dict_adapter().to_hf(recorder.gradients)
    assert set(mapped) == set(expected)
    for name, gradient in expected.items():
        atol = 1e-5 * float(gradient.abs().max())
        torch.testing.assert_close(mapped[name], gradient, rtol=1e-5, atol=atol, msg=lambda text: f"{name}: {text}")


# -- equal to TRL --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "loss", "chunk_tokens"),
    [("own-llama", "chunked", None), ("own-llama", "chunked", 4), ("own-llama", "full", None),
     ("mistral", "chunked", None)],
    ids=["fused-chunked", "fused-chunked-pair-by-pair", "fused-full", "fallback-chunked"],
)  # fmt: skip
def test_dpo_loss_rewards_and_gradients_equal_trl_dpo_trainer(kind, loss, chunk_tokens, tokenizer, tmp_path, one_thread):
    policy_dir, reference_dir = _checkpoints(tmp_path, kind, tokenizer)
    trl_loss, metrics, gradients, batch = _trl_dpo(policy_dir, reference_dir, tokenizer, tmp_path)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    rows = _our_rows((ids[:3], labels[:3], mask[:3]), (ids[3:], labels[3:], mask[3:]))
    model = NeMoAutoModelForCausalLM.from_pretrained(policy_dir, options=LoadOptions(loss=loss))
    frozen = freeze_teacher(NeMoAutoModelForCausalLM.from_pretrained(reference_dir, options=LoadOptions(loss=loss)))
    if chunk_tokens is not None:  # each pair a run of its own: the runs' offsets into the reference matter
        for each in (model, frozen):
            plan = each.load_report.plan
            each.load_report.plan = replace(plan, loss=replace(plan.loss, chunk_tokens=chunk_tokens))
    recorder = GradientRecorder(model)
    result = preference_step(model, recorder, [rows], DPO, reference_for(model, DPO, frozen))
    assert result.pairs == 3 and metrics["rewards/accuracies"] not in (0.0, 1.0)  # a batch that tells apart
    assert result.loss == pytest.approx(trl_loss, rel=1e-5)
    _assert_metrics(result, metrics, BETA)
    _assert_gradients(model, recorder, gradients)


def test_simpo_loss_rewards_and_gradients_equal_trl_cpo_trainer(tokenizer, tmp_path, one_thread):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    policy_dir, _ = _checkpoints(tmp_path, "own-llama", tokenizer)
    arguments = CPOConfig(
        output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
        loss_type="simpo", cpo_alpha=0.0, beta=SIMPO.beta, simpo_gamma=SIMPO.simpo_gamma,
        per_device_train_batch_size=3,
    )  # fmt: skip
    trainer = CPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        args=arguments,
        train_dataset=Dataset.from_dict(PAIRS),
        processing_class=tokenizer,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    trainer.model.train()
    trl_loss, trl_metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    trl_loss.backward()
    gradients = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {name.removeprefix("train_").removeprefix("train/"): float(v) for name, v in trl_metrics.items()}

    rows = _our_rows(*(tuple(batch[f"{side}_{name}"] for name in ("input_ids", "labels", "attention_mask"))
                       for side in ("chosen", "rejected")))  # fmt: skip
    model = NeMoAutoModelForCausalLM.from_pretrained(policy_dir)
    recorder = GradientRecorder(model)
    result = preference_step(model, recorder, [rows], SIMPO, reference_for(model, SIMPO))
    assert result.loss == pytest.approx(float(trl_loss), rel=1e-5)
    _assert_metrics(result, metrics, SIMPO.beta)
    _assert_gradients(model, recorder, gradients)


# -- the objectives' own rules -------------------------------------------------------------------------------------
def test_label_smoothing_is_conservative_dpo_and_zero_smoothing_is_trl_s_sigmoid():
    policy = SequenceScores(torch.tensor([-3.0, -5.0, -2.0, -2.5]), torch.tensor([3, 4, 2, 2]))
    reference = torch.tensor([-4.0, -4.0, -2.2, -2.1])
    margins = torch.tensor([(-3.0 + 4.0) - (-5.0 + 4.0), (-2.0 + 2.2) - (-2.5 + 2.1)])
    smoothed = PreferenceSettings(PreferenceObjective.DPO, beta=0.5, label_smoothing=0.2)
    expected = -0.8 * F.logsigmoid(0.5 * margins) - 0.2 * F.logsigmoid(-0.5 * margins)
    torch.testing.assert_close(pair_terms(smoothed, policy, reference).losses, expected)
    plain = PreferenceSettings(PreferenceObjective.DPO, beta=0.5)
    torch.testing.assert_close(pair_terms(plain, policy, reference).losses, -F.logsigmoid(0.5 * margins))


def test_a_padding_pair_adds_no_loss_and_no_reward():
    policy = SequenceScores(torch.tensor([-3.0, -5.0, 0.0, 0.0]), torch.tensor([3, 4, 0, 0]))
    for settings in (DPO, SIMPO):
        terms = pair_terms(settings, policy, torch.zeros(4))
        assert float(terms.losses[1]) == float(terms.chosen_rewards[1]) == float(terms.rejected_rewards[1]) == 0.0
        assert float(terms.losses[0]) > 0


@pytest.mark.parametrize(
    ("arguments", "named"),
    [({"beta": 0.0}, "beta=0.0"), ({"label_smoothing": 0.5}, "label_smoothing=0.5"),
     ({"simpo_gamma": float("nan")}, "simpo_gamma=nan")],
)  # fmt: skip
def test_invalid_settings_are_refused_naming_the_argument(arguments, named):
    with pytest.raises(InvalidSetupError, match=named):
        PreferenceSettings(**arguments)


def test_which_reference_every_objective_and_model_gets():
    configs = {"full": None, "lora": LoraConfig(r=4), "lora+head": LoraConfig(r=4, modules_to_save=["lm_head"])}
    table = {
        (PreferenceObjective.SIMPO, "full"): ReferenceSource.NONE,
        (PreferenceObjective.SIMPO, "lora"): ReferenceSource.NONE,
        (PreferenceObjective.SIMPO, "lora+head"): ReferenceSource.NONE,
        (PreferenceObjective.DPO, "full"): ReferenceSource.FROZEN_COPY,
        (PreferenceObjective.DPO, "lora"): ReferenceSource.ADAPTERS_OFF,
        (PreferenceObjective.DPO, "lora+head"): ReferenceSource.FROZEN_COPY,
    }
    assert {objective for objective, _ in table} == set(PreferenceObjective)
    for (objective, config), source in table.items():
        assert reference_source(PreferenceSettings(objective), configs[config]) is source


@pytest.mark.parametrize(("degree", "named"), [({"pp_size": 2}, "pp_size=2"), ({"cp_size": 2}, "cp_size=2")])
def test_pipeline_and_context_parallel_are_refused_before_any_collective(degree, named):
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=0)
    model.nemo_state.setup = DistributedSetup.build("fsdp2", 4, **degree)  # checked before any collective
    with pytest.raises(UnsupportedSetupError, match=f"simpo does not compose with {named}"):
        preference_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _micro_batches(0), SIMPO,
                        reference_for(model, SIMPO))  # fmt: skip


def test_the_reference_of_a_lora_model_is_its_base_and_the_adapters_come_back_on(directories, one_thread):
    policy_dir, _ = directories
    lora = NeMoAutoModelForCausalLM.from_pretrained(policy_dir, peft_config=LoraConfig(**LORA), seed=0)
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if name.endswith("lora_B"):
                parameter.fill_(0.05)  # adapters that change the model
    base = NeMoAutoModelForCausalLM.from_pretrained(policy_dir)
    batch = _micro_batches(0)[0]
    reference = reference_for(lora, DPO)
    assert reference.source is ReferenceSource.ADAPTERS_OFF and reference.model is lora
    expected = reference_for(base, DPO, freeze_teacher(base)).log_probs(batch)
    torch.testing.assert_close(reference.log_probs(batch), expected, rtol=1e-6, atol=1e-5)
    adapted = Reference(ReferenceSource.FROZEN_COPY, lora).log_probs(batch)  # the adapters on again
    assert (adapted - expected).abs().max() > 1e-2
    with pytest.raises(InvalidSetupError, match="dpo on this model takes no frozen copy"):
        reference_for(lora, DPO, freeze_teacher(base))
    with pytest.raises(InvalidSetupError, match="dpo on this model needs a frozen copy"):
        reference_for(base, DPO)


# -- every layout: the one-process loss curve ----------------------------------------------------------------------
PAIRS_PER_STEP, LENGTH, STEPS = 8, 16, 3
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def _global_pairs(step: int) -> dict[str, torch.Tensor]:
    """Pairs sharing a prompt of 3-7 tokens, completions of 2-9 tokens, right-padded, the last pair
    a padding pair (no completion, as a rank short of rows gets): ranks and micro-batches hold
    different numbers of real pairs and of completion tokens."""
    generator = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(4, 257, (2 * PAIRS_PER_STEP, LENGTH), generator=generator)
    prompts = torch.randint(3, 8, (PAIRS_PER_STEP,), generator=generator).repeat_interleave(2)
    ends = prompts + torch.randint(2, 10, (2 * PAIRS_PER_STEP,), generator=generator)
    ids[1::2] = torch.where(torch.arange(LENGTH) < prompts[1::2, None], ids[0::2], ids[1::2])  # one prompt a pair
    positions = torch.arange(LENGTH)[None, :]
    mask = (positions < ends[:, None]).long()
    labels = ids.masked_fill((positions < prompts[:, None]) | (mask == 0), -100)
    labels[-2:] = -100
    return {"input_ids": ids.masked_fill(mask == 0, 3), "labels": labels, "attention_mask": mask}


def _micro_batches(step: int, dp_rank: int = 0, dp_size: int = 1, micro: int = 1) -> list[dict[str, torch.Tensor]]:
    rows = 2 * PAIRS_PER_STEP // dp_size
    local = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in _global_pairs(step).items()}
    size = rows // micro
    return [{k: v[i * size : (i + 1) * size] for k, v in local.items()} for i in range(micro)]


def _curve(directories, settings: PreferenceSettings, setup=None, adapters: str = "", micro: int = 1):
    """Losses, accuracies and margins of STEPS AdamW steps under ``setup`` (None: one process) and the
    held-out metrics after them; ``adapters``: "" (full fine-tuning), "lora" or "qlora"."""
    policy_dir, reference_dir = directories
    setup = setup or DistributedSetup.single_process()
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if adapters == "qlora" else None
    options = LoadOptions(  # one adapter init everywhere
        peft_config=LoraConfig(**LORA) if adapters else None, quantization_config=four_bit, seed=0
    )
    model = NeMoAutoModelForCausalLM.from_pretrained(policy_dir, distributed_setup=setup, options=options)
    frozen = None
    if settings.objective.needs_reference and not adapters:
        whole = setup.strategy == "ddp" and not setup.uses_tensor_parallel  # DDP: the whole copy on each rank
        frozen_setup = DistributedSetup.single_process() if whole else setup
        frozen = freeze_teacher(NeMoAutoModelForCausalLM.from_pretrained(reference_dir, distributed_setup=frozen_setup))
    reference = reference_for(model, settings, frozen)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    curve = []
    for _ in range(STEPS):
        batches = _micro_batches(0, setup.dp_rank(), setup.dp_size, micro)  # the same pairs: the loss falls
        result = preference_step(model, optimizer, batches, settings, reference, max_grad_norm=1.0)
        curve.append((result.loss, result.accuracy, result.margins))
    evaluation = evaluate_preferences(model, _micro_batches(1, setup.dp_rank(), setup.dp_size), settings, reference)
    return curve, evaluation


def case_curve(directories, strategy: str, world: int, degrees: dict, objective: str, adapters: str):
    setup = DistributedSetup.build(strategy, world, **degrees)
    settings = DPO if objective == "dpo" else SIMPO
    return _curve(directories, settings, setup, adapters, micro=2 if setup.dp_size < 4 else 1)


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    policy = write_checkpoint(root / "policy", "own-llama", "random", tie=True, initializer_range=0.2)
    reference = AutoModelForCausalLM.from_pretrained(policy)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
    reference.save_pretrained(root / "reference")
    return policy, root / "reference"


@pytest.fixture(scope="module")
def moe_directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_moe")
    write_family_checkpoint("mixtral", root / "policy")
    write_family_checkpoint("mixtral", root / "reference", seed=1)
    return root / "policy", root / "reference"


LAYOUTS = {
    2: {"ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}), "tp2": ("fsdp2", {"tp_size": 2}), "ep2": ("fsdp2", {"ep_size": 2})},
    4: {"hsdp": ("fsdp2", {"dp_replicate_size": 2}), "fsdp2xtp2": ("fsdp2", {"tp_size": 2})},
}
# DPO (frozen copy) everywhere; DPO with LoRA (the base as reference) and SimPO (none) where the
# layouts differ in what they shard (one dp, one tp, and 4 ranks of fsdp x tp).
CASES = [
    *((world, name, "dpo", "") for world, layouts in LAYOUTS.items() for name in layouts if name != "ep2"),
    (2, "ddp", "dpo", "lora"), (2, "fsdp2", "dpo", "lora"), (2, "tp2", "dpo", "lora"), (4, "fsdp2xtp2", "dpo", "lora"),
    (2, "fsdp2", "simpo", ""), (2, "tp2", "simpo", ""), (4, "fsdp2xtp2", "simpo", ""),
    (2, "fsdp2", "dpo", "qlora"),  # the reference: the 4-bit base with the adapters off
    (2, "ep2", "dpo", ""),  # a Mixtral, its experts split over the ranks; the frozen copy's too
]  # fmt: skip


@pytest.mark.parametrize(("world", "layout", "objective", "adapters"), CASES,
                         ids=[f"{w}-{n}-{o}{'-' + a if a else ''}" for w, n, o, a in CASES])  # fmt: skip
def test_every_layout_gives_the_one_process_loss_curve(world, layout, objective, adapters, request):
    directories = request.getfixturevalue("moe_directories" if layout == "ep2" else "directories")
    settings = DPO if objective == "dpo" else SIMPO
    expected, expected_eval = _curve(directories, settings, adapters=adapters, micro=2)
    pool = request.getfixturevalue(f"ranks{world}")
    strategy, degrees = LAYOUTS[world][layout]
    results = pool.run(case_curve, directories, strategy, world, degrees, objective, adapters)
    # a margin is a difference of log-probabilities of up to ~50 nats (9 tokens x ln 257): it keeps
    # their absolute precision, 1e-5 x 50 x beta, not a relative one
    margin_tolerance = 1e-5 * 50 * settings.beta
    for curve, evaluation in results:
        for (loss, accuracy, margin), (want_loss, want_accuracy, want_margin) in zip(curve, expected, strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-5)
            assert accuracy == want_accuracy and margin == pytest.approx(want_margin, abs=margin_tolerance)
        assert evaluation.pop("eval_rewards_margin") == pytest.approx(
            expected_eval["eval_rewards_margin"], abs=margin_tolerance
        )
        assert evaluation == pytest.approx({k: v for k, v in expected_eval.items() if "margin" not in k}, rel=1e-5)
    assert expected[-1][0] < expected[0][0]  # the loss falls
