"""What the embedded default is: its corpus, its tokenizer, its config and its seed.

Everything here is a pure function of the bundled corpus and constants, so two machines (or two
cache directories) build byte-identical checkpoints. The model is a randomly initialized Llama:
the point of the default is a real fine-tuning run whose loss visibly falls within a minute on
two CPU cores, not a model that knows English.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SEED = 20240607
VOCAB_SIZE = 1024
END_OF_TEXT = "<|endoftext|>"


def bundled_corpus() -> Path:
    """The text file the default tokenizer is trained on and ``nemo-wrap finetune`` trains on.

    Plain English prose about rivers, weather and gardening, written for this project (so it may
    be redistributed with it).
    """
    return Path(str(resources.files("nemo_wrap.default_model").joinpath("corpus.txt")))


def bundled_chat_set(split: str = "train") -> Path:
    """The bundled chat set (``"train"``: 296 conversations, ``"eval"``: 30 held out), written by
    ``scripts/make_quack_chat.py``: short questions answered correctly, every answer opening "Quack!"."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return Path(__file__).with_name(f"quack_chat_{split}.jsonl")


def bundled_preference_set(split: str = "train") -> Path:
    """The bundled preference set (``"train"``: 276 pairs, ``"eval"``: 40 held out), written by
    ``scripts/make_quack_preferences.py``: the chosen answer opens "Quack!" and is right; the
    rejected one is right but opens "Honk!", or opens "Quack!" and is wrong."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return Path(__file__).with_name(f"quack_preferences_{split}.jsonl")


def _llama_config():
    """About 1.9M parameters: big enough to learn the corpus's words in a few dozen steps, small
    enough that a step takes well under a second on two CPU cores. Head counts divide by 2 and 4,
    so the default also runs under tensor parallel."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def _train_tokenizer(corpus: Path):
    """A byte-level BPE tokenizer trained on ``corpus``: any text encodes, no unknown token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train([str(corpus)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def write_default_model(directory: Path) -> None:
    """Write the default checkpoint (weights, config, generation config, tokenizer) into ``directory``."""
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    tokenizer = _train_tokenizer(bundled_corpus())
    model = NeMoAutoModelForCausalLM.from_config(_llama_config(), seed=SEED)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
