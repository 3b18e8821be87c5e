"""Context parallel: each rank keeps a load-balanced part of every sequence; attention stays exact.

One process: the cut (chunks i and 2C−1−i, labels shifted before it, global positions), the mask
against the whole sequence's, and the refusals. Real gloo ranks: cp=2 and cp=4, cp × dp_shard and
cp × tp — the loss and every gradient of one step equal one process (rtol 1e-5), and 3 AdamW steps
too, for our fused Llama and Qwen3 and transformers' Mistral (with a sliding window shorter than
the sequence); a packed row of 3 examples; activation checkpointing; LoRA; evaluate.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.distributed.context_parallel import SequenceSplit
from nemo_wrap.errors import UnsupportedModelError
from nemo_wrap.training import evaluate, train_step
from tests.support.batches import local_micro_batches
from tests.support.checkpoints import write_checkpoint
from tests.support.tiny_models import tiny_config


# -- one process ---------------------------------------------------------------------------------
def _row(length: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(10, 10 + length)[None]
    return {"input_ids": ids, "labels": ids.clone()}


def test_each_rank_keeps_chunks_i_and_2c_minus_1_minus_i_with_labels_shifted_first():
    parts = [SequenceSplit.cut(_row(8), rank, 2) for rank in range(2)]
    assert [p.query_index.tolist() for p in parts] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert parts[0].shift_labels.tolist() == [[11, 12, 17, -100]]  # token 1's label is token 2, on rank 1
    assert parts[1].position_ids.tolist() == [[2, 3, 4, 5]]  # positions stay global: RoPE sees them
    odd = [SequenceSplit.cut(_row(7), rank, 2) for rank in range(2)]  # padded to 8, the pad never learned
    assert odd[0].input_ids.shape == (1, 4) and odd[0].shift_labels.tolist() == [[11, 12, -100, -100]]


@pytest.mark.parametrize("size", [2, 4])
def test_the_masks_of_the_parts_are_the_whole_sequences_mask(size):
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8]])  # 3 packed examples
    batch = {**_row(16), "position_ids": positions}
    document = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    index = torch.arange(16)
    for window in (None, 3):
        whole = (index[None] <= index[:, None]) & (document[None] == document[:, None])
        if window is not None:
            whole &= index[:, None] - index[None] < window
        for rank in range(size):
            part = SequenceSplit.cut(batch, rank, size)
            expected = whole[part.query_index][:, part.key_index]
            assert torch.equal(part.mask(window)[0, 0], expected)
            for chunk, (queries, visible) in enumerate(part.query_chunks()):  # what attention uses: keys in order
                assert torch.equal(part.chunk_mask(chunk, window)[0, 0], whole[part.query_index[queries]][:, :visible])


@pytest.mark.parametrize(
    ("config", "degrees", "named"),
    [
        (tiny_config("gemma2"), {"cp_size": 2}, "soft-capping"),
        (tiny_config("own-qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=0), {"cp_size": 2},
         "sliding-window layers"),
        (tiny_config("own-llama"), {"cp_size": 2, "pp_size": 2}, "cp_size=2 does not compose with pp_size=2"),
    ],
    ids=["softcap", "fused-sliding", "with-pp"],
)
def test_what_the_attention_cannot_take_is_refused_by_name_in_the_plan(config, degrees, named):
    setup = DistributedSetup.build("fsdp2", 4, **degrees)
    with pytest.raises(UnsupportedModelError, match=named):
        NeMoAutoModelForCausalLM.plan(config, setup)


# -- gloo ranks ----------------------------------------------------------------------------------
KINDS = {"fused-llama": ("own-llama", {}), "fused-qwen3": ("own-qwen3", {}),
         "fallback-mistral": ("mistral", {"sliding_window": 5})}  # fmt: skip


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer that keeps every gradient of its one step (whole tensors) and changes nothing."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__([p for _, p in named], {})
        self.names = {id(p): name for name, p in named}
        self.gradients: dict[str, torch.Tensor] = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                self.gradients[self.names[id(p)]] = grad.detach().clone()


def _packed_batch() -> list[dict[str, torch.Tensor]]:
    """One row of 3 examples (lengths 5, 4, 7), positions restarting at each."""
    torch.manual_seed(7)
    lengths = (5, 4, 7)
    ids = torch.randint(4, 257, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, [0, 5, 9]] = -100  # no label across an example's start
    return [{"input_ids": ids, "position_ids": positions, "labels": labels}]


def _unpadded_batches(step: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """Rows of one document each and no padding: the attention that needs no mask (on the CPU)."""
    rows = torch.randint(4, 257, (4, 18), generator=torch.Generator().manual_seed(step))
    mine = rows[dp_rank * 4 // dp_size : (dp_rank + 1) * 4 // dp_size]
    return [{"input_ids": mine[i : i + 1]} for i in range(mine.shape[0])]


def _batches(step: int, dp_rank: int, dp_size: int, packed) -> list[dict[str, torch.Tensor]]:
    if packed == "unpadded":
        return _unpadded_batches(step, dp_rank, dp_size)
    return _packed_batch() if packed else local_micro_batches(step, dp_rank, dp_size, 2 // dp_size)


def _one_step_and_curve(model, dp_rank: int, dp_size: int, packed: bool) -> dict:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    recorder = GradientRecorder(trainable)
    first = train_step(model, recorder, _batches(0, dp_rank, dp_size, packed)).loss
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=1e-2, weight_decay=0.01, foreach=False)
    curve = [train_step(model, optimizer, _batches(s, dp_rank, dp_size, packed), max_grad_norm=1.0).loss
             for s in range(3)]  # fmt: skip
    held_out = evaluate(model, local_micro_batches(0, dp_rank, dp_size, 1))
    return {"loss": first, "gradients": recorder.gradients, "curve": curve, "eval": held_out}


def case_context_parallel(checkpoint: str, degrees: dict, packed: bool, checkpointing: bool, lora: bool) -> dict:
    setup = DistributedSetup.build("fsdp2", dist.get_world_size(), **degrees)
    model = _load(checkpoint, setup, lora)
    if checkpointing:
        model.activation_checkpointing_enable()
    return _one_step_and_curve(model, setup.dp_rank(), setup.dp_size, packed)


def _load(checkpoint, setup, lora: bool):
    from peft import LoraConfig

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    return NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, peft_config=peft, seed=2)


def _check(results: list[dict], checkpoint, packed: bool = False, lora: bool = False) -> None:
    expected = _one_step_and_curve(_load(checkpoint, None, lora), 0, 1, packed)
    for result in results:
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert result["gradients"].keys() == expected["gradients"].keys()
        for name, gradient in expected["gradients"].items():
            torch.testing.assert_close(result["gradients"][name], gradient, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(torch.tensor(result["curve"]), torch.tensor(expected["curve"]), rtol=1e-5, atol=0)
        assert result["eval"] == pytest.approx(expected["eval"], rel=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_ranks_of_context_parallel_equal_one_process(ranks2, tmp_path, kind):
    tiny, overrides = KINDS[kind]
    checkpoint = write_checkpoint(tmp_path / "ckpt", tiny, "random", tie=False, **overrides)
    _check(ranks2.run(case_context_parallel, str(checkpoint), {"cp_size": 2}, False, False, False), checkpoint)


@pytest.mark.parametrize(("packed", "checkpointing", "lora"), [(True, False, False), (False, True, False),
                          (False, False, True), ("unpadded", False, False), ("unpadded", True, False)],
                         ids=["packed", "checkpointing", "lora", "unpadded", "unpadded-checkpointing"])  # fmt: skip
def test_packed_rows_activation_checkpointing_and_lora_under_context_parallel(ranks2, tmp_path, packed, checkpointing, lora):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "random", tie=True)
    results = ranks2.run(case_context_parallel, str(checkpoint), {"cp_size": 2}, packed, checkpointing, lora)
    _check(results, checkpoint, packed, lora)
    if packed is True:  # the packed row's loss is its examples' one by one: no token attended across examples
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
        batch = _packed_batch()[0]
        total, tokens = 0.0, 0
        for start, length in ((0, 5), (5, 4), (9, 7)):
            ids = batch["input_ids"][:, start : start + length]
            total += float(model(input_ids=ids, labels=ids).loss) * (length - 1)
            tokens += length - 1
        assert results[0]["loss"] == pytest.approx(total / tokens, rel=1e-5)


@pytest.mark.parametrize(
    ("degrees", "kind"),
    [({"cp_size": 4}, "fused-llama"), ({"cp_size": 4}, "fused-qwen3"), ({"cp_size": 4}, "fallback-mistral"),
     ({"cp_size": 2}, "fused-qwen3"), ({"cp_size": 2, "tp_size": 2}, "fused-llama"),
     ({"cp_size": 2, "tp_size": 2}, "fallback-mistral"), ({"cp_size": 2, "dp_replicate_size": 2}, "fused-llama"),
     ({"cp_size": 2, "tp_size": 2, "sequence_parallel": True}, "fused-qwen3")],
    ids=["cp4", "cp4-qwen3", "cp4-fallback", "cp2-dp_shard2", "cp2-tp2", "cp2-tp2-fallback", "cp2-hsdp",
         "cp2-tp2-sequence-parallel"],
)
def test_four_ranks_of_context_parallel_compose_with_fsdp_and_tensor_parallel(ranks4, tmp_path, degrees, kind):
    tiny, overrides = KINDS[kind]
    checkpoint = write_checkpoint(tmp_path / "ckpt", tiny, "random", tie=False, **overrides)
    _check(ranks4.run(case_context_parallel, str(checkpoint), degrees, False, False, False, timeout=180), checkpoint)


def case_mixed_precision(checkpoint: str) -> list[float]:
    setup = DistributedSetup.build("fsdp2", 2, cp_size=2)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, precision="bf16-mixed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return [train_step(model, optimizer, local_micro_batches(step, 0, 1, 2)).loss for step in range(3)]


def test_bf16_mixed_under_context_parallel_follows_one_process(ranks2, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "random", tie=True)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, precision="bf16-mixed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    expected = [train_step(model, optimizer, local_micro_batches(step, 0, 1, 2)).loss for step in range(3)]
    for losses in ranks2.run(case_mixed_precision, str(checkpoint)):  # bf16 compute: close, not equal
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-2, atol=0)


def case_attention_outside_the_interface(checkpoint: str) -> str:
    setup = DistributedSetup.build("fsdp2", 2, cp_size=2)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup)
    model.set_attn_implementation("sdpa")  # as a family computing attention itself would: the cut is bypassed
    try:
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), local_micro_batches(0, 0, 1, 1))
    except UnsupportedModelError as error:
        return str(error)
    return "trained"


def test_attention_that_bypasses_the_cut_is_caught_not_computed_within_a_part(ranks2, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "mistral", "random", tie=False)
    for outcome in ranks2.run(case_attention_outside_the_interface, str(checkpoint)):
        assert "does not go through transformers' attention interface" in outcome
