"""Consolidated HF save from every strategy, its atomicity and failure handling, and sharded resume.

Round trips are checked against plain transformers: the directory a sharded model writes must load
with ``AutoModelForCausalLM.from_pretrained`` into the weights the one-process model holds (the init
is sharding-independent, so the one-process model built from the same seed is the reference) and
give the sharded model's logits.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint import load_checkpoint, save_checkpoint
from nemo_wrap.checkpoint import save as save_module
from nemo_wrap.errors import CheckpointSaveError, InvalidShardSizeError
from nemo_wrap.training import train_step
from tests.support.checkpoint_state import kill_at_markers
from tests.support.tiny_models import tiny_config

SEED = 1234
SMALL_SHARDS = "100KB"  # the tiny models hold ~330 KB of float32 weights: several files
REPO = Path(__file__).resolve().parents[2]
# (kind, force_hf): transformers' Llama wrapped as NeMoLlamaForCausalLM, and our fused Llama
CLASSES = {"hf": ("llama", True), "own": ("own-llama", False)}


def _config(which: str, tie: bool):
    return tiny_config(CLASSES[which][0], tie_word_embeddings=tie)


def _build(which: str, tie: bool, setup: DistributedSetup | None = None, seed: int = SEED):
    return NeMoAutoModelForCausalLM.from_config(
        _config(which, tie), distributed_setup=setup, seed=seed, force_hf=CLASSES[which][1]
    )


def _input_ids() -> torch.Tensor:
    return torch.randint(4, 257, (2, 11), generator=torch.Generator().manual_seed(7))


def _hf_reference_state(which: str, tie: bool) -> dict[str, torch.Tensor]:
    """The one-process model's weights under transformers' keys: what a saved checkpoint must hold."""
    model = _build(which, tie)
    state = model.state_dict()
    if CLASSES[which][1]:  # transformers' class: its keys already; a tied lm_head is not written
        return {k: v for k, v in state.items() if not (tie and k == "lm_head.weight")}
    return model.state_dict_adapter().to_hf(state)


def _saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _assert_hf_checkpoint(directory: Path, which: str, tie: bool, logits: torch.Tensor) -> None:
    """Transformers' architecture and keys, the reference weights exactly, the model's logits."""
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (directory / "generation_config.json").is_file()
    expected = _hf_reference_state(which, tie)
    transformers_keys = set(AutoModelForCausalLM.from_config(_config(which, tie)).state_dict())
    saved = _saved_tensors(directory)
    assert set(saved) == transformers_keys - ({"lm_head.weight"} if tie else set())
    for key, tensor in expected.items():
        assert torch.equal(saved[key], tensor), key
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=_input_ids()).logits, logits, atol=1e-5, rtol=0)


def _assert_sharded_index(directory: Path) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) > 1 and not (directory / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == files
    saved = _saved_tensors(directory)
    assert set(index["weight_map"]) == set(saved)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    for file in files:
        with safe_open(directory / file, "pt") as handle:
            assert all(index["weight_map"][key] == file for key in handle.keys())


def _staging_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# -- one process ------------------------------------------------------------------------------------
def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "hello": 4, "world": 5}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


@pytest.mark.parametrize(("which", "tie"), [("hf", True), ("own", False)])
def test_one_process_save_loads_in_transformers(which, tie, tmp_path):
    model = _build(which, tie)
    with torch.no_grad():
        logits = model(input_ids=_input_ids()).logits
    model.save_pretrained(tmp_path / "single", tokenizer=_tiny_tokenizer())
    assert sorted(p.name for p in (tmp_path / "single").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "single" / "model.safetensors.index.json").exists()
    _assert_hf_checkpoint(tmp_path / "single", which, tie, logits)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "single")
    assert tokenizer("hello world <pad>")["input_ids"] == [4, 5, 3]

    model.save_pretrained(tmp_path / "sharded", max_shard_size=SMALL_SHARDS)
    _assert_sharded_index(tmp_path / "sharded")
    _assert_hf_checkpoint(tmp_path / "sharded", which, tie, logits)
    assert _staging_leftovers(tmp_path) == []


def test_save_replaces_an_existing_checkpoint(tmp_path):
    target = tmp_path / "checkpoint"
    _build("hf", False, seed=1).save_pretrained(target, max_shard_size=SMALL_SHARDS)
    newer = _build("hf", False, seed=2)
    newer.save_pretrained(target)  # one file now: the old shards and index must be gone
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "nemo_wrap_weights.json"
    ]
    with torch.no_grad():
        expected = newer(input_ids=_input_ids()).logits
        actual = AutoModelForCausalLM.from_pretrained(target)(input_ids=_input_ids()).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert _staging_leftovers(tmp_path) == []


def test_save_into_a_directory_with_other_contents_keeps_them(tmp_path):
    """A trainer's output directory (notes, checkpoint-N/ folders): written into, nothing else lost."""
    outputs = tmp_path / "outputs"
    (outputs / "checkpoint-3").mkdir(parents=True)
    (outputs / "checkpoint-3" / "optimizer.pt").write_text("keep me too")
    (outputs / "notes.txt").write_text("keep me")
    _build("hf", False, seed=1).save_pretrained(outputs, max_shard_size=SMALL_SHARDS)
    model = _build("hf", False)
    model.save_pretrained(outputs)  # one file now: the earlier shards and index must be gone
    assert (outputs / "notes.txt").read_text() == "keep me"
    assert (outputs / "checkpoint-3" / "optimizer.pt").read_text() == "keep me too"
    assert sorted(p.name for p in outputs.glob("model*")) == ["model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(outputs)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]  # no staging leftovers


def test_save_refuses_to_replace_a_file(tmp_path):
    (tmp_path / "outputs").write_text("keep me")
    with pytest.raises(CheckpointSaveError):
        _build("hf", False).save_pretrained(tmp_path / "outputs")
    assert (tmp_path / "outputs").read_text() == "keep me"


@pytest.mark.parametrize("size", [0, -5, "5XB", "GB", True, 1.5])
def test_invalid_max_shard_size_is_refused(size, tmp_path):
    with pytest.raises(InvalidShardSizeError):
        _build("hf", False).save_pretrained(tmp_path / "x", max_shard_size=size)
    assert not (tmp_path / "x").exists()


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.checkpoint import save as save_module
    from tests.support.tiny_models import tiny_config

    finish = save_module._FileWriter.finish

    def write_then_stall(writer):  # the first file is complete: the parent kills us here, mid-save
        finish(writer)
        Path({marker!r}).touch()
        time.sleep(600)

    save_module._FileWriter.finish = write_then_stall
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=99, force_hf=True)
    model.save_pretrained({target!r}, max_shard_size="100KB")
    """
)


def test_save_killed_mid_write_leaves_no_checkpoint_and_keeps_the_previous_one(tmp_path):
    previous_dir, fresh_dir = tmp_path / "existing" / "checkpoint", tmp_path / "fresh" / "checkpoint"
    previous = _build("hf", False, seed=1)
    previous.save_pretrained(previous_dir)
    before = _digest(previous_dir)
    children = []
    for target in (previous_dir, fresh_dir):  # both at once: the interpreter start-up dominates
        marker = tmp_path / f"{target.parent.name}.marker"
        code = _KILLED_SAVE.format(repo=str(REPO), marker=str(marker), target=str(target))
        children.append((subprocess.Popen([sys.executable, "-c", code]), marker))
    kill_at_markers(children)

    assert _digest(previous_dir) == before  # the previous checkpoint, byte for byte
    with torch.no_grad():
        expected = previous(input_ids=_input_ids()).logits
        actual = AutoModelForCausalLM.from_pretrained(previous_dir)(input_ids=_input_ids()).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    assert not fresh_dir.exists()
    for parent in (previous_dir.parent, fresh_dir.parent):
        # only the hidden staging directory is left, with a first weight file and no config
        (staged,) = [p for p in parent.iterdir() if p.name != "checkpoint"]
        assert staged.name.startswith(".checkpoint.tmp-")
        assert [p.name for p in staged.iterdir()] == ["model-00001-of-00005.safetensors"]


def test_resume_in_one_process(tmp_path):
    expected, resumed = case_resume_gives_the_same_next_losses(str(tmp_path), None, 1, "own")
    assert resumed["step"] == 2
    assert resumed["losses"] == expected


# -- several ranks ----------------------------------------------------------------------------------
def _setup(strategy: str | None, tp_size: int):
    if strategy is None:
        return None
    return DistributedSetup.build(strategy, torch.distributed.get_world_size(), tp_size=tp_size)


def case_save_from_strategy(directory: str, which: str, tie: bool, strategy: str, tp_size: int) -> torch.Tensor:
    model = _build(which, tie, _setup(strategy, tp_size))
    with torch.no_grad():
        logits = model(input_ids=_input_ids()).logits
    model.save_pretrained(directory, max_shard_size=SMALL_SHARDS)
    return logits


ROUND_TRIPS = [
    ("hf", True, "ddp", 1),
    ("own", False, "ddp", 1),
    ("hf", False, "fsdp2", 1),
    ("own", True, "fsdp2", 1),
    ("hf", True, "fsdp2", 2),
    ("own", False, "fsdp2", 2),
]


@pytest.mark.parametrize(("which", "tie", "strategy", "tp_size"), ROUND_TRIPS,
                         ids=[f"{w}-{'tied' if t else 'untied'}-{s}-tp{p}" for w, t, s, p in ROUND_TRIPS])
def test_save_from_two_ranks_loads_in_transformers(ranks2, tmp_path, which, tie, strategy, tp_size):
    directory = tmp_path / "checkpoint"
    logits = ranks2.run(case_save_from_strategy, str(directory), which, tie, strategy, tp_size)
    _assert_sharded_index(directory)
    _assert_hf_checkpoint(directory, which, tie, logits[0])
    assert _staging_leftovers(tmp_path) == []


@pytest.mark.parametrize("which", ["hf", "own"])
def test_save_from_fsdp2_over_tensor_parallel_loads_in_transformers(ranks4, tmp_path, which):
    directory = tmp_path / "checkpoint"
    logits = ranks4.run(case_save_from_strategy, str(directory), which, True, "fsdp2", 2)
    _assert_sharded_index(directory)
    _assert_hf_checkpoint(directory, which, True, logits[0])


def case_failing_save(directory: str, failure: str) -> dict:
    """Save into ``directory`` while rank 0 fails (``failure`` says how); report the error and seconds."""
    model = _build("own", False, _setup("fsdp2", 1))
    stream = save_module.SafetensorsStream
    opened = []

    class FailingInSecondFile(stream):
        def __init__(self, path, layout):
            super().__init__(path, layout)
            opened.append(path)

        def write(self, key, tensor):  # the disk fills up half-way through the second file
            if len(opened) == 2:
                raise OSError(28, "No space left on device", str(opened[-1]))
            super().write(key, tensor)

    if failure == "disk full" and torch.distributed.get_rank() == 0:
        save_module.SafetensorsStream = FailingInSecondFile
    start = time.monotonic()
    try:
        model.save_pretrained(directory, max_shard_size=SMALL_SHARDS)
    except CheckpointSaveError as error:
        cause = None if error.__cause__ is None else type(error.__cause__)
        return {"message": str(error), "cause": cause, "seconds": time.monotonic() - start}
    finally:
        save_module.SafetensorsStream = stream
    return {"message": "no error", "cause": None, "seconds": time.monotonic() - start}


def test_save_failing_on_rank_zero_raises_on_every_rank(ranks2, tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    results = ranks2.run(case_failing_save, str(tmp_path / "a_file" / "checkpoint"), "unwritable", timeout=60)
    assert issubclass(results[0]["cause"], OSError) and results[1]["cause"] is None
    for rank, result in enumerate(results):  # every rank raised CheckpointSaveError, naming the target
        assert str(tmp_path / "a_file" / "checkpoint") in result["message"], rank
        assert result["seconds"] < 10, rank

    target = tmp_path / "checkpoint"
    _build("hf", False, seed=1).save_pretrained(target)
    before = _digest(target)
    results = ranks2.run(case_failing_save, str(target), "disk full", timeout=60)
    assert results[0]["cause"] is OSError and results[1]["cause"] is None
    for rank, result in enumerate(results):  # the message names the target and the file being written
        assert str(target) in result["message"] and "model-00002-of-00005.safetensors" in result["message"], rank
        assert result["seconds"] < 10, rank
    assert _digest(target) == before
    assert _staging_leftovers(tmp_path) == []


def _batches(rank: int, step: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [{"input_ids": torch.randint(4, 257, (2, 12), generator=generator)}]


def case_resume_gives_the_same_next_losses(directory: str, strategy: str | None, tp_size: int, which: str):
    """Train 2 steps, save, train 2 more; rebuild from another seed, load, train the same 2 steps.

    Two steps after the save: the first loss depends on the restored weights only, the second also
    on the restored optimizer state (AdamW moments and step count).
    """
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    model = _build(which, False, _setup(strategy, tp_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in (1, 2):
        train_step(model, optimizer, _batches(rank, step), max_grad_norm=1.0)
    save_checkpoint(directory, model, optimizer, step=2)
    expected = [train_step(model, optimizer, _batches(rank, step), max_grad_norm=1.0).loss for step in (3, 4)]

    model = _build(which, False, _setup(strategy, tp_size), seed=SEED + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    restored_step = load_checkpoint(directory, model, optimizer)
    losses = [train_step(model, optimizer, _batches(rank, step), max_grad_norm=1.0).loss for step in (3, 4)]
    return expected, {"step": restored_step, "losses": losses}


RESUMES = [("ddp", 1, "hf"), ("fsdp2", 1, "own"), ("fsdp2", 2, "hf")]


@pytest.mark.parametrize(("strategy", "tp_size", "which"), RESUMES, ids=[f"{s}-tp{p}-{w}" for s, p, w in RESUMES])
def test_resume_gives_the_same_next_losses(ranks2, tmp_path, strategy, tp_size, which):
    for rank, (expected, resumed) in enumerate(
        ranks2.run(case_resume_gives_the_same_next_losses, str(tmp_path / "resume"), strategy, tp_size, which)
    ):
        assert resumed["step"] == 2, rank
        assert resumed["losses"] == pytest.approx(expected, abs=1e-6), rank
    assert _staging_leftovers(tmp_path) == []


def test_resume_from_fsdp2_over_tensor_parallel(ranks4, tmp_path):
    for rank, (expected, resumed) in enumerate(
        ranks4.run(case_resume_gives_the_same_next_losses, str(tmp_path / "resume"), "fsdp2", 2, "own")
    ):
        assert resumed["step"] == 2, rank
        assert resumed["losses"] == pytest.approx(expected, abs=1e-6), rank
