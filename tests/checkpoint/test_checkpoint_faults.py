"""Checkpoint faults a run must survive: a resume into the wrong model, damaged files, a full disk.

Each fault is made real rather than mocked. Damage is done to the files of a real 2-rank save (cut
short, deleted, ``.metadata`` swapped for another save's). The disk fills up through the process's
own file-size limit: a soft ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored makes every write past it fail
with EFBIG, on the ranks that lower it, and nowhere else — no root, no mounted filesystem. Each case
checks what a run depends on: every rank raises the same specific error naming the directory (or
file), nothing is loaded or left half-written, the previous checkpoint stays whole and loadable,
and no staging directory is left behind.
"""

from __future__ import annotations

import hashlib
import resource
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint import CheckpointRotation, load_checkpoint, newest_checkpoint, save_checkpoint
from nemo_wrap.errors import CheckpointSaveError, NeMoWrapError
from nemo_wrap.training import train_step
from tests.support.checkpoint_state import local_copy, local_state
from tests.support.checkpoints import write_checkpoint
from tests.support.tiny_models import tiny_config

SEED = 1234
# What a limited process may write into one file: less than any file a save here writes, down to a
# safetensors header, so every save fails at its first file. A consolidated save fails while
# flushing its buffered header, and the same flush fails again when the file is closed: that second
# error once escaped the writer on rank 0 and left rank 1 waiting in the next gather.
LIMIT = 256
SMALL_SHARDS = "100KB"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _setup() -> DistributedSetup | None:
    return DistributedSetup.build("fsdp2", dist.get_world_size()) if dist.is_initialized() else None


def _model(seed: int = SEED, trainable_head: bool = True, **overrides):
    """A tiny fused Llama (fsdp2 on every rank, or one process) and AdamW over its parameters (the
    lm_head left out when not ``trainable_head``)."""
    config = tiny_config("own-llama", tie_word_embeddings=False, **overrides)
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=_setup(), seed=seed)
    parameters = [p for name, p in model.named_parameters() if trainable_head or not name.startswith("lm_head")]
    return model, torch.optim.AdamW(parameters, lr=1e-2)


def _lora_model(base: str, peft: bool):
    """The base checkpoint's model, with all-linear LoRA adapters when ``peft``; AdamW over what trains."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if peft else None
    model = NeMoAutoModelForCausalLM.from_pretrained(base, distributed_setup=_setup(), peft_config=config, seed=0)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(model, optimizer, step: int = 1) -> None:
    batch = torch.randint(4, 257, (2, 12), generator=torch.Generator().manual_seed(1000 * step + _rank()))
    train_step(model, optimizer, [{"input_ids": batch}], max_grad_norm=1.0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _refusal(directory: Path, model, optimizer) -> dict:
    """Load ``directory`` into ``model``: the error (class name and message), and whether the
    model's weights are untouched."""
    before = {name: local_copy(value) for name, value in model.state_dict().items()}
    try:
        load_checkpoint(directory, model, optimizer)
    except NeMoWrapError as error:
        error_type, message = type(error).__name__, str(error)
    else:
        error_type, message = None, "loaded"
    unchanged = all(torch.equal(local_copy(value), before[name]) for name, value in model.state_dict().items())
    return {"error": error_type, "message": message, "unchanged": unchanged}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _staging_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """A tiny transformers checkpoint to put LoRA adapters on."""
    return str(write_checkpoint(tmp_path_factory.mktemp("faults") / "base", "own-llama", "random", tie=False))


# -- a checkpoint that does not fit the model ------------------------------------------------------
def case_mismatches(root: str, base: str) -> dict:
    """Save a full run, a run whose optimizer leaves the lm_head out, a LoRA run; load each into
    a model or optimizer it does not fit."""
    root_path = Path(root)
    model, optimizer = _model()
    _train(model, optimizer)
    save_checkpoint(root_path / "full", model, optimizer, step=1)
    model, optimizer = _model(trainable_head=False)
    _train(model, optimizer)
    save_checkpoint(root_path / "frozen-head", model, optimizer, step=1)
    lora, lora_optimizer = _lora_model(base, peft=True)
    _train(lora, lora_optimizer)
    save_checkpoint(root_path / "lora", lora, lora_optimizer, step=1)
    plain, plain_optimizer = _lora_model(base, peft=False)
    _train(plain, plain_optimizer)
    save_checkpoint(root_path / "plain", plain, plain_optimizer, step=1)
    return {
        "other shapes": _refusal(root_path / "full", *_model(num_hidden_layers=3, intermediate_size=96)),
        "fewer layers": _refusal(root_path / "full", *_model(num_hidden_layers=1)),
        "optimizer entry": _refusal(root_path / "frozen-head", *_model()),
        "lora into full": _refusal(root_path / "lora", *_lora_model(base, peft=False)),
        "full into lora": _refusal(root_path / "plain", *_lora_model(base, peft=True)),
        "fits": load_checkpoint(root_path / "full", *_model(seed=SEED + 1)),
    }


def _check_mismatches(root: Path, result: dict, where: str) -> None:
    assert result["fits"] == 1, where
    for kind in ("other shapes", "fewer layers", "optimizer entry", "lora into full", "full into lora"):
        assert result[kind]["error"] == "CheckpointMismatchError", (where, kind, result[kind])
        assert result[kind]["unchanged"], (where, kind)  # refused before anything was loaded
    other, fewer = result["other shapes"]["message"], result["fewer layers"]["message"]
    assert str(root / "full") in other and "nothing was loaded" in other, where
    # layer 2's 6 weights (norms included) and their AdamW state (3 entries each) are missing
    assert "24 key(s) (model: 6, optimizer: 18) missing from the checkpoint" in other, where
    assert "'model.model.layers.2.mlp.down_proj.weight'" in other, where
    assert (
        "12 key(s) (model: 4, optimizer: 8) with another shape" in other
        and "'model.model.layers.0.mlp.down_proj.weight' [64, 128] saved, [64, 96] here" in other
    ), where
    assert "24 key(s) (model: 6, optimizer: 18) in the checkpoint that this model and optimizer do not have" in fewer
    assert "'model.model.layers.1.input_layernorm.weight'" in fewer, where
    head = result["optimizer entry"]["message"]
    assert str(root / "frozen-head") in head, where
    assert "3 key(s) (optimizer: 3) missing from the checkpoint: 'optimizer.state.lm_head.weight.exp_avg'" in head
    assert str(root / "lora") in result["lora into full"]["message"], where
    assert "it is a LoRA checkpoint (28 adapter tensors)" in result["lora into full"]["message"], where
    assert "peft_config the run was trained with" in result["lora into full"]["message"], where
    assert "a checkpoint of a model without LoRA adapters" in result["full into lora"]["message"], where


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(ranks2, tmp_path, base):
    results = ranks2.run(case_mismatches, str(tmp_path), base, timeout=90)
    for rank, result in enumerate(results):
        _check_mismatches(tmp_path, result, f"rank {rank}")
    for kind, refusal in results[0].items():
        assert refusal == results[1][kind], kind  # the same error, word for word, on both ranks


def test_a_checkpoint_of_another_model_is_refused_in_one_process(tmp_path, base, one_thread):
    _check_mismatches(tmp_path, case_mismatches(str(tmp_path), base), "one process")


# -- damaged files ---------------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    with path.open("r+b") as file:
        file.truncate(path.stat().st_size // 2)


def _flip_a_bit(path: Path) -> None:
    """One bit of the middle byte flipped: the size stays, the contents do not."""
    with path.open("r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(1)[0]
        file.seek(-1, 1)
        file.write(bytes([byte ^ 0x10]))


DAMAGES = {  # how to damage a copy of a good checkpoint; the file its error names; words of the message
    "flipped bit in rank 0's shard": (lambda d, other: _flip_a_bit(d / "__0_0.distcp"), "__0_0.distcp",
                                      "contents changed since the save"),  # fmt: skip
    "flipped bit in rank 1's shard": (lambda d, other: _flip_a_bit(d / "__1_0.distcp"), "__1_0.distcp",
                                      "contents changed since the save"),  # fmt: skip
    "flipped bit in the index": (lambda d, other: _flip_a_bit(d / ".metadata"), ".metadata",
                                 "not the index this checkpoint was saved with"),  # fmt: skip
    "truncated shard": (lambda d, other: _truncate(d / "__1_0.distcp"), "__1_0.distcp", "truncated"),
    "missing shard": (lambda d, other: (d / "__0_0.distcp").unlink(), "__0_0.distcp", "missing"),
    "metadata of another save": (
        lambda d, other: shutil.copyfile(other / ".metadata", d / ".metadata"),
        ".metadata",
        "belongs to another save",
    ),
    "unreadable manifest": (
        lambda d, other: (d / "nemo_wrap_manifest.json").write_text("{"),
        "nemo_wrap_manifest.json",
        "manifest",
    ),
    "truncated shard, no manifest": (
        lambda d, other: ((d / "nemo_wrap_manifest.json").unlink(), _truncate(d / "__1_0.distcp")),
        "__1_0.distcp",
        "reads up to byte",
    ),
    "garbage metadata, no manifest": (
        lambda d, other: ((d / "nemo_wrap_manifest.json").unlink(), (d / ".metadata").write_bytes(b"junk")),
        ".metadata",
        "DCP cannot read it",
    ),
}


def case_damaged(root: str) -> dict:
    """Save twice, damage copies of the first (rank 0), load each on every rank, then the sound one."""
    good, other = Path(root) / "good", Path(root) / "other"
    model, optimizer = _model()
    _train(model, optimizer)
    save_checkpoint(good, model, optimizer, step=1)
    saved = local_state(model, optimizer)
    _train(model, optimizer, step=2)
    save_checkpoint(other, model, optimizer, step=2)
    if _rank() == 0:
        for kind, (damage, _, _) in DAMAGES.items():
            shutil.copytree(good, Path(root) / kind)
            damage(Path(root) / kind, other)
    _barrier()
    results = {kind: _refusal(Path(root) / kind, *_model(seed=SEED + 1)) for kind in DAMAGES}
    model, optimizer = _model(seed=SEED + 1)
    results["sound"] = (load_checkpoint(good, model, optimizer), _same(local_state(model, optimizer), saved))
    return results


def test_a_damaged_checkpoint_is_refused_on_every_rank_naming_the_file(ranks2, tmp_path):
    results = ranks2.run(case_damaged, str(tmp_path), timeout=90)
    for rank, result in enumerate(results):
        assert result["sound"] == (1, True), rank
        for kind, (_, file, words) in DAMAGES.items():
            refusal = result[kind]
            assert refusal["error"] == "CorruptCheckpointError", (rank, kind, refusal)
            assert str(tmp_path / kind / file) in refusal["message"] and words in refusal["message"], (rank, kind)
            assert refusal["unchanged"], (rank, kind)
            assert refusal == results[0][kind], (rank, kind)


# -- a full disk -----------------------------------------------------------------------------------
@contextmanager
def _file_size_limit(active: bool) -> Iterator[None]:
    """While active, writing past ``LIMIT`` bytes of a file fails with EFBIG in this process."""
    if not active:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _save(kind: str, model, optimizer, target: Path, step: int) -> None:
    if kind == "dcp":
        save_checkpoint(target, model, optimizer, step)
    elif kind == "consolidated":
        model.save_pretrained(target, max_shard_size=SMALL_SHARDS)
    else:  # a LoRA model writes its adapter
        model.save_pretrained(target)


def case_full_disk(kind: str, root: str, base: str, limited: list[int]) -> dict:
    """Save into ``root/checkpoint`` (no limit), train a step, save again while the ranks in
    ``limited`` cannot write more than ``LIMIT`` bytes to a file; report the error and what is left."""
    target = Path(root) / "checkpoint"
    model, optimizer = _lora_model(base, peft=True) if kind == "adapter" else _model()
    _train(model, optimizer)
    _save(kind, model, optimizer, target, step=1)
    saved, before = local_state(model, optimizer), _digest(target)
    _train(model, optimizer, step=2)
    with _file_size_limit(_rank() in limited):
        try:
            _save(kind, model, optimizer, target, step=2)
            message = "saved"
        except CheckpointSaveError as error:
            message = str(error)
    result = {"message": message, "intact": _digest(target) == before}
    if kind == "dcp":  # the previous checkpoint still resumes, into exactly what it saved
        fresh, fresh_optimizer = _model(seed=SEED + 1)
        result["restored"] = (
            load_checkpoint(target, fresh, fresh_optimizer),
            _same(local_state(fresh, fresh_optimizer), saved),
        )
    return result


def case_full_disk_in_the_background(root: str, limited: list[int]) -> dict:
    """CheckpointRotation's background save of step 2 while ``limited`` ranks' disk is full."""
    model, optimizer = _model()
    rotation = CheckpointRotation(root, keep_last=None, asynchronous=True)
    _train(model, optimizer)
    rotation.save(model, optimizer, 1)
    rotation.wait()
    saved = local_state(model, optimizer)
    _train(model, optimizer, step=2)
    with _file_size_limit(_rank() in limited):
        try:
            rotation.save(model, optimizer, 2)  # returns once the state is copied; the write fails behind it
            rotation.wait()
            message = "saved"
        except CheckpointSaveError as error:
            message = str(error)
    rotation.close()
    newest = newest_checkpoint(root)
    fresh, fresh_optimizer = _model(seed=SEED + 1)
    restored = (load_checkpoint(newest, fresh, fresh_optimizer), _same(local_state(fresh, fresh_optimizer), saved))
    return {"message": message, "newest": newest, "restored": restored}


def _check_the_previous_one_loads(kind: str, target: Path, base: str) -> None:
    if kind == "consolidated":
        AutoModelForCausalLM.from_pretrained(target)
    elif kind == "adapter":
        NeMoAutoModelForCausalLM.from_pretrained(base, adapter=target)


def _check_full_disk(kind: str, root: Path, result: dict, where: str) -> None:
    target = root / "checkpoint"
    assert str(target) in result["message"] and "File too large" in result["message"], (where, result["message"])
    assert result["intact"], where
    assert result.get("restored", (1, True)) == (1, True), where
    assert _staging_leftovers(root) == [], where


KINDS = ["consolidated", "adapter", "dcp"]
# The one rank whose disk fills up: rank 0 writes consolidated checkpoints and adapters alone; DCP's
# coordinator is rank 0, so rank 1 failing is the case where the others go on the longest.
WRITERS = {"consolidated": [0], "adapter": [0], "dcp": [1]}


@pytest.mark.parametrize("on", ["one rank", "all ranks"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(ranks2, tmp_path, base, kind, on):
    limited = WRITERS[kind] if on == "one rank" else [0, 1]
    results = ranks2.run(case_full_disk, kind, str(tmp_path), base, limited, timeout=60)
    for rank, result in enumerate(results):
        _check_full_disk(kind, tmp_path, result, f"{kind}, rank {rank}")
    _check_the_previous_one_loads(kind, tmp_path / "checkpoint", base)


@pytest.mark.parametrize("on", ["one rank", "all ranks"])
def test_a_full_disk_fails_a_background_save_on_every_rank(ranks2, tmp_path, on):
    limited = [1] if on == "one rank" else [0, 1]
    for rank, result in enumerate(ranks2.run(case_full_disk_in_the_background, str(tmp_path), limited, timeout=60)):
        assert str(tmp_path / "checkpoint-2") in result["message"] and "File too large" in result["message"], rank
        assert result["newest"] == tmp_path / "checkpoint-1" and result["restored"] == (1, True), rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "latest"]


@pytest.mark.parametrize("kind", [*KINDS, "background"])
def test_a_full_disk_fails_the_save_in_one_process(tmp_path, base, kind, one_thread):
    if kind == "background":
        result = case_full_disk_in_the_background(str(tmp_path), [0])
        assert str(tmp_path / "checkpoint-2") in result["message"] and "File too large" in result["message"]
        assert result["newest"] == tmp_path / "checkpoint-1" and result["restored"] == (1, True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "latest"]
        return
    _check_full_disk(kind, tmp_path, case_full_disk(kind, str(tmp_path), base, [0]), "one process")
    _check_the_previous_one_loads(kind, tmp_path / "checkpoint", base)
