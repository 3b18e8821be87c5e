"""Small offline tokenizers with written-out chat templates (ChatML as Qwen2 uses, Llama-3 style)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Marks the last message: a prefix's rendering is not a prefix of the whole conversation's.
NOT_PREFIX_CONSISTENT = (
    "{% for m in messages %}{% if loop.last %}[final]{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}
_CORPUS = ["hello there, how are you today?", "the capital of France is Paris.", "system user assistant"] * 20


def chat_tokenizer(kind: str, template: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer whose special tokens are ``kind``'s, with ``template``."""
    specials = SPECIALS[kind]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer=trainer)
    eos = specials[-1]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.chat_template = template
    return tokenizer
