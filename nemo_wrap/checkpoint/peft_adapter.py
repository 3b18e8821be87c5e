"""LoRA adapters as PEFT writes them: ``adapter_config.json`` + ``adapter_model.safetensors``.

Written from any strategy with the full adapter (every rank gathers each sharded tensor, rank 0
writes), atomically like a checkpoint; read back through the same validated header parser and
per-rank block reads as base weights, so an adapter directory gets the path policy, the strict
JSON and the exact-shape checks of a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import save_file

from nemo_wrap.checkpoint.atomic import replace_directory, staged_save
from nemo_wrap.checkpoint.gather import FullTensors
from nemo_wrap.checkpoint.locate import Checkpoint, require_inside, resolve_checkpoint_directory
from nemo_wrap.checkpoint.safetensors_file import read_header
from nemo_wrap.checkpoint.strict_json import read_json_file
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.pipeline.runtime import PipelineRuntime
from nemo_wrap.errors import AdapterMismatchError, CheckpointNotFoundError, CorruptCheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MAX_CONFIG_BYTES = 2**20


def open_adapter(path: str | Path, group: RankGroup | None = None) -> tuple[LoraConfig, Checkpoint]:
    """A PEFT LoRA adapter directory (or hub id): its config and its indexed tensors."""
    directory = resolve_checkpoint_directory(path, group)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise CheckpointNotFoundError(f"{directory}: no {name}; not a PEFT adapter directory")
        require_inside(directory, name)
    fields = read_json_file(directory / ADAPTER_CONFIG, "adapter config", _MAX_CONFIG_BYTES)
    if not isinstance(fields, dict) or fields.get("peft_type") != "LORA":
        raise AdapterMismatchError(f"{directory / ADAPTER_CONFIG}: not a LoRA adapter (peft_type must be 'LORA')")
    try:
        config = LoraConfig.from_pretrained(str(directory))
    except Exception as error:  # the JSON is valid: PEFT refuses a value in it
        raise CorruptCheckpointError(
            f"{directory / ADAPTER_CONFIG}: PEFT cannot read it ({type(error).__name__}: {str(error)[:200]})"
        ) from error
    return config, Checkpoint(directory, read_header(directory / ADAPTER_WEIGHTS))


def save_peft_adapter(
    tensors: Mapping[str, torch.Tensor],
    config: LoraConfig,
    save_directory: str | Path,
    group: RankGroup,
    pipeline: PipelineRuntime | None = None,
) -> None:
    """Write ``tensors`` (PEFT key → tensor, possibly sharded) and ``config`` as a PEFT adapter.

    Every rank of a collective ``group`` calls it; rank 0 writes the whole adapter — every pipeline
    stage's part of it, when ``pipeline`` is this rank's stage. The directory appears atomically.
    """
    target = Path(save_directory).absolute()
    gathered = FullTensors(tensors, pipeline)
    with staged_save(target, group) as (staged, failure):
        full: dict[str, torch.Tensor] = {}
        for key in gathered.info:  # same order on every rank
            whole = gathered.full(key, group.is_writer)
            if whole is not None:  # a tied tensor saved under two keys: two copies, as safetensors wants
                shared = any(whole.data_ptr() == other.data_ptr() for other in full.values())
                full[key] = whole.clone() if shared else whole

        def write() -> None:
            save_file(full, staged / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            config.save_pretrained(str(staged))
            replace_directory(staged, target)

        group.on_rank_zero("writing the adapter", write, failure)
