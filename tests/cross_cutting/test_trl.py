"""TRL's SFTTrainer and lm-eval's HFLM on our models, as a new user would call them.

Fused (our own Llama) and fallback (transformers' Mistral under our mixins) classes alike: what the
trainer saves is the trained model, reloaded by plain transformers (+ PEFT) with its logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import UnsupportedLoraOptionError
from tests.support.chat_tokenizers import CHATML, chat_tokenizer
from tests.support.checkpoints import write_checkpoint

pytest.importorskip("trl")

KINDS = pytest.mark.parametrize("kind", ["own-llama", "mistral"], ids=["fused", "fallback"])


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer("chatml", CHATML)


def _checkpoint(tmp_path, kind, tokenizer):
    # transformers' init at a wide scale: adapters and steps move the logits far above the tolerances
    directory = write_checkpoint(
        tmp_path / "ckpt", kind, "random", tie=True, vocab_size=len(tokenizer), initializer_range=0.2
    )
    tokenizer.save_pretrained(directory)
    return directory


def _conversations():
    from datasets import Dataset

    rows = [
        {"messages": [{"role": "user", "content": f"how are you {i}?"}, {"role": "assistant", "content": "Paris."}]}
        for i in range(12)
    ]
    return Dataset.from_list(rows)


def _trainer(model, tokenizer, tmp_path, **options):
    from trl import SFTConfig, SFTTrainer

    arguments = SFTConfig(  # TRL's defaults otherwise: bf16=True, so accelerate autocasts the forward
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=64,
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    return SFTTrainer(model=model, args=arguments, train_dataset=_conversations(), processing_class=tokenizer, **options)


def _trained_logits(trainer, tokens):
    """The trained model's fp32 logits. accelerate wrapped ``forward`` in a bf16 autocast for the
    run (TRL's ``bf16=True`` default) and leaves the wrapper on the model; unwrap it as accelerate
    itself does (``keep_fp32_wrapper=False``), or the comparison is bf16 against fp32."""
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
    with torch.no_grad():
        return model(tokens).logits


@KINDS
def test_sft_trainer_full_fine_tuning_saves_the_trained_model(kind, tokenizer, tmp_path):
    checkpoint = _checkpoint(tmp_path, kind, tokenizer)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = _trainer(model, tokenizer, tmp_path)
    trainer.train()
    assert "forward" in vars(model)  # accelerate's autocast wrapper: the cause of the reported 0.76
    assert sum(not torch.equal(before[n], t) for n, t in model.state_dict().items()) >= len(before) - 2
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    tokens = torch.tensor([tokenizer.encode("the capital of France is Paris.")])
    with torch.no_grad():
        expected = reloaded(tokens).logits
    torch.testing.assert_close(_trained_logits(trainer, tokens), expected, atol=1e-4, rtol=0)
    untrained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (untrained(tokens).logits - expected).abs().max() > 1e-2  # the run changed the logits


@KINDS
def test_sft_trainer_peft_config_trains_a_portable_adapter(kind, tokenizer, tmp_path):
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file

    checkpoint = _checkpoint(tmp_path, kind, tokenizer)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(model, tokenizer, tmp_path, peft_config=config)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(
        f"base_model.model.model.layers.{layer}.self_attn.{projection}.lora_{matrix}.weight"
        for layer in range(2)
        for projection in ("q_proj", "v_proj")
        for matrix in "AB"
    )
    assert all(saved[key].abs().max() > 1e-3 for key in saved if "lora_B" in key)  # trained, not the zero init
    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    tokens = torch.tensor([tokenizer.encode("the capital of France is Paris.")])
    with torch.no_grad():
        expected = reloaded(tokens).logits
    torch.testing.assert_close(_trained_logits(trainer, tokens), expected, atol=1e-4, rtol=0)
    with reloaded.disable_adapter(), torch.no_grad():
        assert (reloaded(tokens).logits - expected).abs().max() > 1e-2  # the adapter matters


def test_peft_on_a_fused_layer_as_a_whole_is_refused_by_name(tokenizer, tmp_path):
    """``"all-linear"`` makes PEFT adapt our fused ``qkv_proj`` itself (not loadable over
    transformers' class): refused at the first forward, naming the way out."""
    from peft import LoraConfig, get_peft_model

    model = NeMoAutoModelForCausalLM.from_pretrained(_checkpoint(tmp_path, "own-llama", tokenizer))
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(UnsupportedLoraOptionError, match="qkv_proj as a whole.*peft_config"):
        wrapped(torch.tensor([[5, 6, 7]]))


def test_merging_through_peft_fails_loudly_on_a_fused_class(tokenizer, tmp_path):
    """PEFT merges into its base layer's weight; a view has none of its own: a shape error, and the
    fused weight unchanged (our ``save_pretrained(merge_adapters=True)`` is the merging path)."""
    from peft import LoraConfig, get_peft_model

    model = NeMoAutoModelForCausalLM.from_pretrained(_checkpoint(tmp_path, "own-llama", tokenizer))
    before = model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"].clone()
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(RuntimeError):
        wrapped.merge_and_unload()
    assert torch.equal(model.get_submodule("model.layers.0.self_attn.qkv_proj").weight, before)


def test_lm_eval_harness_scores_our_model_as_transformers_model(tokenizer, tmp_path):
    lm_eval_huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    checkpoint = _checkpoint(tmp_path, "own-llama", tokenizer)
    requests = [
        Instance("loglikelihood", {}, ("the capital of France is", " Paris."), 0),
        Instance("loglikelihood", {}, ("hello there,", " how are you today?"), 1),
    ]
    scores = []
    for model in (
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint),
        AutoModelForCausalLM.from_pretrained(checkpoint),
    ):
        harness = lm_eval_huggingface.HFLM(pretrained=model.eval(), tokenizer=tokenizer, batch_size=1)
        scores.append([log_likelihood for log_likelihood, _ in harness.loglikelihood(requests)])
    ours, theirs = scores
    assert ours == pytest.approx(theirs, abs=1e-5)
