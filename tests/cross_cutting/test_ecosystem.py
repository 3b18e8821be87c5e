"""The ecosystem's own clients on our models: the rank-0 idiom, transformers' Trainer, hidden states."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import UnsupportedSaveOptionError
from tests.support.checkpoints import write_checkpoint


# -- the rank-0 idiom: a process-local model under a process group runs no collective -------------
def case_rank_zero_alone(checkpoint: str, output: str) -> dict:
    import time

    import torch.distributed as dist

    started = time.monotonic()
    result: dict = {}
    if dist.get_rank() == 0:
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, verify=True)
        prompt = torch.tensor([[5, 6, 7, 8]])
        result["tokens"] = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=3)
        model.save_pretrained(output)
        reloaded = NeMoAutoModelForCausalLM.from_pretrained(output)
        result["same"] = all(torch.equal(reloaded.state_dict()[n], t) for n, t in model.state_dict().items())
        result["verified"] = model.load_report.verified
    dist.barrier()  # rank 1 waits here all along
    result["seconds"] = time.monotonic() - started
    return result


@pytest.mark.parametrize("kind", ["llama", "own-llama"])
def test_rank_zero_loads_generates_and_saves_alone(ranks2, kind, tmp_path):
    write_checkpoint(tmp_path / "ckpt", kind, "distinct", tie=True)
    rank0, rank1 = ranks2.run(case_rank_zero_alone, str(tmp_path / "ckpt"), str(tmp_path / "out"), timeout=60)
    assert rank0["verified"] is True and rank0["same"] and rank0["tokens"].shape == (1, 8)
    assert rank0["seconds"] < 30 and rank1["seconds"] < 30
    assert (tmp_path / "out" / "model.safetensors").is_file()


# -- save_pretrained speaks transformers' signature ----------------------------------------------
def test_save_pretrained_takes_transformers_keywords(tmp_path):
    write_checkpoint(tmp_path / "ckpt", "own-llama", "distinct", tie=False)
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "skipped", is_main_process=False)
    assert not (tmp_path / "skipped").exists()
    state = {name: tensor + 1 for name, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "given", state_dict=state, safe_serialization=True, token=None)
    reloaded = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "given")
    assert all(torch.equal(reloaded.state_dict()[n], t) for n, t in state.items())  # written as given
    for options, named in (
        (dict(push_to_hub=True), "push_to_hub=True"),
        (dict(safe_serialization=False), "safe_serialization=False"),
        (dict(variant="fp16"), "variant"),
        (dict(distributed_checkpoint=True), "distributed_checkpoint=True"),
        (dict(max_shrad_size="1GB"), "max_shrad_size"),
    ):
        with pytest.raises(UnsupportedSaveOptionError, match=named):
            model.save_pretrained(tmp_path / "refused", **options)
    assert not (tmp_path / "refused").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "given") is not None


# -- transformers' Trainer ----------------------------------------------------------------------
class _Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: int) -> None:
        self.ids = torch.randint(4, 257, (rows, 16), generator=torch.Generator().manual_seed(rows))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


@pytest.mark.parametrize("kind", ["own-llama", "llama"], ids=["fused", "fallback"])
def test_transformers_trainer_trains_checkpoints_evaluates_and_saves(kind, tmp_path):
    from transformers import Trainer, TrainingArguments

    write_checkpoint(tmp_path / "ckpt", kind, "distinct", tie=True)
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        save_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=_Tokens(8), eval_dataset=_Tokens(4))
    trainer.train()
    assert (tmp_path / "run" / "checkpoint-3" / "model.safetensors").is_file()
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))
    trainer.save_model()  # into the run directory, beside checkpoint-3/ and checkpoint-4/
    assert (tmp_path / "run" / "checkpoint-3" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run").eval()
    tokens = _Tokens(2).ids
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, atol=1e-5, rtol=0)


# -- hidden states from our fused classes -------------------------------------------------------
@pytest.mark.parametrize("kind", ["own-llama", "own-qwen2", "own-qwen3"])
def test_fused_classes_return_transformers_hidden_states(kind, tmp_path):
    from nemo_wrap.errors import InvalidModelInputError

    write_checkpoint(tmp_path, kind, "distinct", tie=False)
    ours = NeMoAutoModelForCausalLM.from_pretrained(tmp_path).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _Tokens(2).ids
    with torch.no_grad():
        expected = theirs(tokens, output_hidden_states=True).hidden_states
        actual = ours(tokens, output_hidden_states=True).hidden_states
        assert ours(tokens).hidden_states is None  # off by default, as in transformers
    assert len(actual) == len(expected) == ours.config.num_hidden_layers + 1
    for layer, (mine, reference) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(mine, reference, atol=1e-5, rtol=0, msg=f"hidden state {layer}")
    with pytest.raises(InvalidModelInputError, match="SDPA.*attn_implementation='eager'"):
        ours(tokens, output_attentions=True)


# -- progress on long work ----------------------------------------------------------------------
def test_loading_and_saving_show_progress_where_asked(tmp_path, monkeypatch, capsys):
    from nemo_wrap.progress import progress_enabled

    write_checkpoint(tmp_path / "ckpt", "llama", "half", tie=False)
    monkeypatch.setenv("NEMO_WRAP_PROGRESS", "1")
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "out")
    shown = capsys.readouterr().err
    assert "loading" in shown and "saving" in shown and "tensor" in shown
    monkeypatch.setenv("NEMO_WRAP_PROGRESS", "0")
    NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").save_pretrained(tmp_path / "out")
    assert "loading" not in capsys.readouterr().err
    monkeypatch.delenv("NEMO_WRAP_PROGRESS")
    assert not progress_enabled(speaks_for_the_job=True)  # pytest's captured stderr is no terminal
    monkeypatch.setenv("NEMO_WRAP_PROGRESS", "1")
    assert not progress_enabled(speaks_for_the_job=False)  # other ranks stay quiet
