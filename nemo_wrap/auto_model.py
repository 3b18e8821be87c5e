"""``NeMoAutoModelForCausalLM``: the user-facing entry point, one audited pipeline.

``from_pretrained`` reads top-down: resolve config → resolve architecture → plan → execute the
plan's steps (build on meta, shard, materialize, read, initialize the rest, audit) → return.
``from_config`` is the same pipeline with no checkpoint. Each step is a named function; the order
is the plan's, computed once by :func:`make_load_plan`, never re-decided from the model's state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from nemo_wrap.arch_mapping import ModelSource, resolve_model_source
from nemo_wrap.checkpoint.locate import Checkpoint, open_checkpoint, resolve_checkpoint_directory
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.sharding import check_tensor_parallel_supported, shard_model
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    InvalidSetupError,
    MissingWeightsError,
    RemoteRankError,
    UnexpectedKeysError,
    UnsupportedModelError,
)
from nemo_wrap.loading.plan import LoadPlan, Step, make_load_plan
from nemo_wrap.loading.provenance import Initialized, LoadReport, Provenance, Tied
from nemo_wrap.loading.read import adapter_for, checkpoint_tensors, matches_any, read_into_model
from nemo_wrap.loading.verify import verify_load

logger = logging.getLogger("nemo_wrap")
T = TypeVar("T")


class NeMoAutoModelForCausalLM:
    """Builds causal LMs whose every parameter provably holds the checkpoint, under any strategy."""

    def __init__(self) -> None:
        raise TypeError("NeMoAutoModelForCausalLM is a factory: use from_pretrained(...) or from_config(...)")

    @classmethod
    def plan(
        cls,
        path_or_config: str | Path | PretrainedConfig,
        distributed_setup: DistributedSetup | None = None,
        force_hf: bool = False,
    ) -> LoadPlan:
        """The load plan for a checkpoint directory (or a config: no checkpoint), reading no weights."""
        if isinstance(path_or_config, PretrainedConfig):
            config, has_checkpoint = path_or_config, False
        else:
            config, has_checkpoint = _load_config(resolve_checkpoint_directory(path_or_config), {}), True
        return _make_plan(resolve_model_source(config, force_hf), distributed_setup, has_checkpoint)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        distributed_setup: DistributedSetup | None = None,
        dtype: torch.dtype | str | None = None,
        strict: bool = True,
        verify: bool = False,
        force_hf: bool = False,
        allow_pickle: bool = False,
        seed: int | None = None,
        **config_overrides: Any,
    ) -> PreTrainedModel:
        """Load ``path`` (a checkpoint directory or hub id) sharded as ``distributed_setup`` says.

        ``dtype=None``/``"auto"`` keeps the checkpoint's dtype. ``strict`` (default) raises
        :class:`MissingWeightsError` / :class:`UnexpectedKeysError` on every rank instead of
        initializing what the checkpoint lacks. ``verify`` re-reads the checkpoint and compares
        per-tensor checksums with what every rank holds. ``seed`` seeds whatever is initialized.
        The result carries ``model.load_report``.
        """
        directory, config, checkpoint = _on_all_ranks(
            "opening the checkpoint", lambda: _open(path, allow_pickle, config_overrides)
        )
        source = resolve_model_source(config, force_hf=force_hf)
        plan = _make_plan(source, distributed_setup, has_checkpoint=True)
        return _Pipeline(plan, source, config, _resolve_dtype(dtype, config, checkpoint),
                         distributed_setup, seed, checkpoint, strict, verify).run()

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        distributed_setup: DistributedSetup | None = None,
        seed: int | None = None,
        dtype: torch.dtype | str | None = None,
        force_hf: bool = False,
    ) -> PreTrainedModel:
        """A freshly initialized model, sharded as ``distributed_setup`` says (one process if ``None``).

        ``seed`` fixes the init (default: rank 0's ``torch.initial_seed()``, shared with all ranks);
        the full weights are the same for every strategy and world size. ``dtype=None`` (or
        ``"auto"``) means the config's dtype, float32 when it names none.
        """
        source = resolve_model_source(config, force_hf=force_hf)
        plan = _make_plan(source, distributed_setup, has_checkpoint=False)
        return _Pipeline(plan, source, config, _resolve_dtype(dtype, config, None), distributed_setup, seed).run()


def _make_plan(source: ModelSource, setup: DistributedSetup | None, has_checkpoint: bool) -> LoadPlan:
    return make_load_plan(
        model_class=source.model_class.__name__,
        is_custom=source.is_custom,
        source_reason=source.reason,
        strategy=None if setup is None else setup.strategy,
        world_size=1 if setup is None else setup.world_size,
        tp_size=1 if setup is None else setup.tp_size,
        has_checkpoint=has_checkpoint,
    )


@dataclass
class _Pipeline:
    """Executes a plan's steps in order; holds what the steps hand to each other."""

    plan: LoadPlan
    source: ModelSource
    config: PretrainedConfig
    dtype: torch.dtype
    setup: DistributedSetup | None
    seed: int | None
    checkpoint: Checkpoint | None = None
    strict: bool = True
    verify: bool = False
    model: Any = None
    provenance: dict[str, Provenance] = field(default_factory=dict)
    used_keys: set[str] = field(default_factory=set)
    bytes_read: int = 0

    def run(self) -> PreTrainedModel:
        if self.setup is not None:
            check_tensor_parallel_supported(self.source.model_class, self.config, self.setup.tp_size)
        steps: dict[Step, Callable[[], None]] = {
            Step.BUILD_ON_META: self.build_on_meta,
            Step.SHARD: self.shard,
            Step.MATERIALIZE: self.materialize,
            Step.READ_CHECKPOINT: self.read_checkpoint,
            Step.INITIALIZE_REST: self.initialize_rest,
            Step.AUDIT: self.audit,
        }
        for step in self.plan.steps:
            steps[step]()
        return self.model

    def build_on_meta(self) -> None:
        self.model = _build_on_meta(self.source.model_class, self.config, self.dtype)

    def shard(self) -> None:
        self.model = shard_model(self.model, self.setup)  # megatron_fsdp returns its wrapper

    def materialize(self) -> None:
        _materialize(self.model, _device())

    def read_checkpoint(self) -> None:
        def read() -> tuple[dict[str, Provenance], set[str], int]:
            with BlockReader() as reader:
                provenance, used = read_into_model(self.model, self.checkpoint, reader)
                return provenance, used, sum(reader.bytes_read.values())

        self.provenance, self.used_keys, self.bytes_read = _on_all_ranks("reading the checkpoint", read)

    def initialize_rest(self) -> None:
        loaded = {name for name, p in self.provenance.items() if p.kind in ("checkpoint", "tied")}
        self.model.initialize_weights(loaded_names=loaded, seed=_agree_on_seed(self.seed, self.setup))
        rule = f"{type(self.model).__mro__[0].__name__}._init_weights (seeded, shard-aware)"
        allowed_missing = getattr(self.model, "_keys_to_ignore_on_load_missing", None)
        distinct, tied = checkpoint_tensors(self.model)
        for target, source in tied.items():
            self.provenance.setdefault(target, Tied(source))
        for name in distinct:
            current = self.provenance.get(name)
            if current is None:
                self.provenance[name] = Initialized(rule, "no checkpoint given")
            elif current.kind == "missing" and (not self.strict or matches_any(name, allowed_missing)):
                why = "absent from the checkpoint, allowed by strict=False" if not self.strict else \
                    "absent from the checkpoint, allowed by the class's _keys_to_ignore_on_load_missing"
                self.provenance[name] = Initialized(rule, why)

    def audit(self) -> None:
        unexpected: tuple[str, ...] = ()
        if self.checkpoint is not None:
            available = set(self.checkpoint.entries) | set(self.checkpoint.pickle_tensors or {})
            ignored = getattr(self.model, "_keys_to_ignore_on_load_unexpected", None)
            unexpected = tuple(sorted(k for k in available - self.used_keys if not matches_any(k, ignored)))
        report = LoadReport(self.plan, self.provenance, unexpected, self.bytes_read)
        self.model.load_report = report
        if self.verify and self.checkpoint is not None:
            distinct, _ = checkpoint_tensors(self.model)
            verify_load(distinct, self.provenance, adapter_for(self.model), self.checkpoint, _device())
            report.verified = True
        missing = report.names("missing")
        if missing:
            raise MissingWeightsError(
                f"{self.checkpoint.directory}: {len(missing)} parameter(s) are neither in the checkpoint nor "
                f"tied or allowed to be initialized (pass strict=False to initialize them): {', '.join(missing)}"
            )
        if unexpected and self.strict:
            raise UnexpectedKeysError(
                f"{self.checkpoint.directory}: {len(unexpected)} checkpoint tensor(s) fill no parameter of "
                f"{self.plan.model_class} (pass strict=False to ignore them): {', '.join(unexpected)}"
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("%s", report.summary())


# -- steps and helpers -----------------------------------------------------------------------------
def _open(path: str | Path, allow_pickle: bool, overrides: dict[str, Any]) -> tuple[Path, PretrainedConfig, Checkpoint]:
    directory = resolve_checkpoint_directory(path, local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    config = _load_config(directory, overrides)
    return directory, config, open_checkpoint(directory, allow_pickle=allow_pickle)


def _load_config(directory: Path, overrides: dict[str, Any]) -> PretrainedConfig:
    if not (directory / "config.json").is_file():
        raise CheckpointNotFoundError(f"{directory}: no config.json")
    try:
        return AutoConfig.from_pretrained(directory, trust_remote_code=False, **overrides)
    except ValueError as error:
        raise UnsupportedModelError(f"{directory / 'config.json'}: {error}") from error


def _on_all_ranks(what: str, action: Callable[[], T]) -> T:
    """Run ``action`` on every rank; if it fails anywhere, fail everywhere (nobody waits forever).

    A failing rank re-raises its own error; the others raise :class:`RemoteRankError`. One small
    all-reduce, and only when more than one rank exists.
    """
    error: BaseException | None = None
    result = None
    try:
        result = action()
    except Exception as caught:  # noqa: BLE001 - re-raised below, unchanged
        error = caught
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([0 if error is None else 1], device=_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and error is None:
            raise RemoteRankError(f"another rank failed while {what}; its error is in that rank's output")
    if error is not None:
        raise error
    return result


def _resolve_dtype(dtype: torch.dtype | str | None, config: PretrainedConfig, checkpoint: Checkpoint | None) -> torch.dtype:
    """``None``/``"auto"``: the checkpoint's floating dtype (else the config's, else float32)."""
    if dtype is None or dtype == "auto":
        floating = [e.dtype for e in (checkpoint.entries.values() if checkpoint else ()) if e.dtype.is_floating_point]
        floating += [t.dtype for t in ((checkpoint.pickle_tensors or {}).values() if checkpoint else ()) if t.is_floating_point()]
        if floating:
            return max(set(floating), key=floating.count)
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidSetupError(f"dtype={dtype!r} is not a torch dtype name")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise InvalidSetupError(f"dtype must be a torch.dtype, a dtype name, 'auto' or None; got {dtype!r}")
    return dtype


def _build_on_meta(model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """Architecture only: no memory, no init (transformers skips init on the meta device)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    model.config.dtype = dtype
    return model


def _agree_on_seed(seed: int | None, setup: DistributedSetup | None) -> int:
    """An explicit seed, else rank 0's ``torch.initial_seed()`` shared with every rank.

    Unseeded processes draw different initial seeds; shards initialized from different seeds would
    not form one coherent tensor, and DDP replicas would diverge, so the default is agreed on.
    """
    if seed is not None:
        return seed
    if setup is None or not dist.is_initialized():
        return torch.initial_seed()
    agreed = [torch.initial_seed()]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _materialize(model: PreTrainedModel, device: torch.device) -> None:
    """Allocate (uninitialized) storage for every shard, then restore ties that ``to_empty`` broke."""
    model.to_empty(device=device)
    model.tie_weights()
