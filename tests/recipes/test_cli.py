"""The ``nemo-wrap`` command line and its embedded default.

One-rank runs call ``main`` in this process; the two-rank run is a real ``--nproc 2`` subprocess
(``torch.distributed.run --standalone`` underneath). Every test uses a private cache directory, so
the user's ``~/.cache`` is never touched and the first-use path is exercised for real.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_wrap.cli import main
from nemo_wrap.default_model import default_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]


def _losses(out: str) -> tuple[float, float]:
    first, last = re.search(r"loss: first step ([0-9.]+), last step ([0-9.]+)", out).groups()
    return float(first), float(last)


def _assert_loads_with_plain_transformers(directory: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("Rain falls on the garden", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert type(model).__name__ == "LlamaForCausalLM"


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_no_command_means_finetune_on_the_default(cache, tmp_path, capsys):
    output = tmp_path / "out"
    assert main(["--steps", "3", "--output-dir", str(output)]) == 0
    out = capsys.readouterr().out
    assert out.index("load plan: NeMoLlamaForCausalLM") < out.index("load report: 27 tensors — 26 checkpoint, 1 tied")
    assert "fsdp2 on 1 rank(s), tp=1" in out and "(3 steps)" in out
    first, last = _losses(out)
    assert last < first  # three AdamW steps at lr 3e-3 already lower the loss
    _assert_loads_with_plain_transformers(output)
    assert not dist.is_initialized()


def test_activation_checkpointing_recomputes_and_keeps_the_losses(cache, tmp_path, capsys):
    losses = []
    for switch in ([], ["--activation-checkpointing"]):
        assert main(["--steps", "2", "--output-dir", str(tmp_path / f"out{len(switch)}"), *switch]) == 0
        out = capsys.readouterr().out
        assert ("each decoder layer recomputes its activations" in out) == bool(switch)
        losses.append(_losses(out))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_finetune_on_two_ranks_through_nproc(cache, tmp_path):
    output = tmp_path / "out"
    completed = subprocess.run(
        [sys.executable, "-m", "nemo_wrap.cli", "finetune", "--nproc", "2", "--steps", "3",
         "--output-dir", str(output)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "fsdp2 on 2 rank(s), tp=1" in completed.stdout
    assert "8 rows per rank x 1 micro-batch(es) x 2 data-parallel rank(s)" in completed.stdout
    assert completed.stdout.count("loss: first step") == 1  # printed by rank 0 only
    first, last = _losses(completed.stdout)
    assert last < first
    _assert_loads_with_plain_transformers(output)


def test_version_names_the_package_torch_and_transformers(capsys):
    import transformers

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    expected = f"nemo-wrap 0.1.0 (torch {torch.__version__}, transformers {transformers.__version__})"
    assert capsys.readouterr().out.strip() == expected


def test_plan_describes_a_job_without_launching_it(cache, capsys):
    assert main(["plan", "--nproc", "4", "--tp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("load plan: NeMoLlamaForCausalLM") and "fsdp2 on 4 rank(s), tp=2" in out
    assert not dist.is_initialized()
    assert main(["plan", "--nproc", "4", "--tp-size", "2", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "precision: bf16-mixed: fp32 master weights and optimizer state, bf16 compute (fully_shard's" in out
    assert "loss: chunked linear cross-entropy, 512 tokens a chunk" in out
    assert main(["plan", "--loss", "full"]) == 0
    assert "loss: full logits (loss='full' asked)" in capsys.readouterr().out


def test_qlora_finetunes_the_default_and_saves_an_adapter(cache, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    output = tmp_path / "out"
    assert main(["finetune", "--qlora", "--lora-r", "4", "--steps", "3", "--output-dir", str(output)]) == 0
    out = capsys.readouterr().out
    assert "quantization: bitsandbytes 4-bit NF4, blocks of 64 with double-quantized absmax" in out
    assert "LoRA adapters: new, initialized as PEFT does (float32 beside the 4-bit layers" in out
    first, last = _losses(out)
    assert last < first
    assert sorted(p.name for p in output.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "config.yaml", "logs", "training_complete.json"
    ]  # the adapter, the resolved recipe, the metrics and the record that the run finished
    assert main(["plan", "--quantization", "fp4", "--nproc", "2"]) == 0
    assert "bitsandbytes 4-bit FP4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["plan", "--quantization", "nf4", "--nproc", "2", "--tp-size", "2"])
    assert refused.value.code == 2 and "does not compose with tp_size=2" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
def test_plan_of_a_megatron_fsdp_job_prints_on_a_cpu_machine(cache, capsys):
    """A plan describes a job for another machine: no CUDA check until a model is sharded."""
    assert main(["plan", "--strategy", "megatron_fsdp", "--nproc", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("load plan: NeMoLlamaForCausalLM") and "megatron_fsdp on 8 rank(s), tp=1" in out
    assert "megatron_fsdp needs real full weights: shard after they are in place" in out
    with pytest.raises(SystemExit) as excinfo:  # loading here still refuses, naming the reason
        main(["report", "--strategy", "megatron_fsdp"])
    assert excinfo.value.code == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_plan_exits_2_where_the_load_would_refuse(tmp_path, capsys):
    from tests.support.tiny_models import tiny_config

    config = tiny_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", str(tmp_path), "--nproc", "8", "--tp-size", "2"])
    assert excinfo.value.code == 2
    assert "num_key_value_heads=3" in capsys.readouterr().err


def test_report_lists_every_tensor_and_verifies(cache, capsys):
    assert main(["report", "--strategy", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "load report: 27 tensors — 26 checkpoint, 1 tied" in out
    assert "verify: checksums of every tensor match the checkpoint" in out
    assert "model.embed_tokens.weight" in out and "tied to model.embed_tokens.weight" in out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["finetune", "--strategy", "ddp", "--tp-size", "2"], "tp_size=2"),
        (["finetune", "--sequence-parallel"], "sequence_parallel=True"),
        (["report", "{tmp}/no-such-checkpoint"], "no-such-checkpoint"),
        (["finetune", "--steps", "1", "--data", "{tmp}/missing.txt"], "missing.txt"),
    ],
    ids=["bad-setup", "sequence-parallel-without-tp", "missing-checkpoint", "missing-data"],
)
def test_errors_exit_2_with_one_line_naming_the_problem(cache, tmp_path, capsys, argv, named):
    with pytest.raises(SystemExit) as excinfo:
        main([arg.format(tmp=tmp_path) for arg in argv])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("nemo-wrap: error: ") and named in err[-1]
    assert not dist.is_initialized()


def test_a_checkpoint_without_tokenizer_exits_2_naming_it(cache, tmp_path, capsys):
    checkpoint = tmp_path / "no-tokenizer"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(default_model_path() / name, checkpoint / name)
    with pytest.raises(SystemExit) as excinfo:
        main(["finetune", str(checkpoint), "--steps", "1", "--output-dir", str(tmp_path / "out")])
    assert excinfo.value.code == 2
    assert "no-tokenizer: no tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not dist.is_initialized()


def test_default_checkpoint_is_byte_identical_when_built_again(cache, tmp_path):
    assert _files(default_model_path(tmp_path)) == _files(default_model_path(cache))


def test_concurrent_first_use_builds_one_checkpoint(cache, tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from nemo_wrap.default_model import default_model_path
        print(default_model_path(sys.argv[1]))
        """
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for _ in range(2)
    ]
    results = [process.communicate(timeout=180) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [err[-2000:] for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert paths == {str(tmp_path / "default-llama-v1")}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["default-llama-v1", "default-llama-v1.lock"]
    assert _files(tmp_path / "default-llama-v1") == _files(default_model_path(cache))


CHATML_TEXT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_model(cache, tmp_path) -> Path:
    """The default model with a ChatML-style template on its tokenizer."""
    model = tmp_path / "chat-model"
    shutil.copytree(default_model_path(), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHATML_TEXT
    tokenizer.save_pretrained(model)
    return model


def _chat_file(path: Path, count: int) -> Path:
    import json

    rows = [{"messages": [{"role": "user", "content": f"Rain falls on garden {i}?"},
                          {"role": "assistant", "content": f"The garden {i} drinks the rain."}]} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _records(log_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_lora_chat_sft_with_packing_evaluation_metrics_and_resume(cache, tmp_path, capsys):
    model = _chat_model(cache, tmp_path)
    data, held_out = _chat_file(tmp_path / "chat.jsonl", 24), _chat_file(tmp_path / "eval.jsonl", 6)
    common = ["finetune", str(model), "--data", str(data), "--pack", "--max-length", "64",
              "--batch-size", "2", "--steps", "4", "--warmup-steps", "1", "--lr", "1e-2", "--lora-r", "4",
              "--eval-data", str(held_out), "--eval-every", "2", "--save-every", "2"]
    assert main([*common, "--output-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out
    assert "data: " in out and "(messages)" in out and "examples (0 truncated, 0 dropped)" in out
    records = _records(tmp_path / "log")
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert len(losses) == 4 and [r["step"] for r in evals] == [2, 4] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert f"eval loss {evals[-1]['eval_loss']:.4f} after step 4" in out  # the closing summary names it, once
    assert [r["lr"] for r in records if "lr" in r][:2] == [1e-2, 1e-2]  # warm-up of one step, then the peak
    assert list((tmp_path / "log").glob("events.out.tfevents.*"))
    assert (tmp_path / "out" / "adapter_config.json").is_file() and (tmp_path / "out" / "checkpoint-2").is_dir()
    resumed = [*common, "--output-dir", str(tmp_path / "again"), "--log-dir", str(tmp_path / "log2"),
               "--resume", str(tmp_path / "out" / "checkpoint-2")]
    assert main(resumed) == 0
    assert [r["loss"] for r in _records(tmp_path / "log2") if "loss" in r] == losses[2:]


def test_prompt_completion_sft_with_mapped_columns_on_two_ranks(cache, tmp_path):
    import json

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"Rain on {i}?", "answer": f" The garden {i}."}) + "\n"
                            for i in range(16)))
    completed = subprocess.run(
        [sys.executable, "-m", "nemo_wrap.cli", "finetune", "--nproc", "2", "--data", str(data),
         "--columns", "prompt=question,completion=answer", "--max-length", "32", "--batch-size", "2",
         "--steps", "3", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "(prompt_completion): 16 examples" in completed.stdout
    assert completed.stdout.count("loss: first step") == 1 and "(3 steps)" in completed.stdout
    _assert_loads_with_plain_transformers(tmp_path / "out")


def test_sft_and_the_text_job_under_pipeline_and_context_parallel_on_two_ranks(cache, tmp_path):
    model = _chat_model(cache, tmp_path)
    data = _chat_file(tmp_path / "chat.jsonl", 16)
    sft = [sys.executable, "-m", "nemo_wrap.cli", "finetune", str(model), "--nproc", "2", "--pp-size", "2",
           "--data", str(data), "--pack", "--max-length", "64", "--batch-size", "1", "--accumulation", "2",
           "--steps", "3", "--lr", "1e-2", "--lora-r", "4", "--output-dir", str(tmp_path / "sft")]
    text = [sys.executable, "-m", "nemo_wrap.cli", "finetune", str(model), "--nproc", "2", "--pp-size", "2",
            "--pp-schedule", "gpipe", "--batch-size", "2", "--seq-len", "32", "--steps", "3",
            "--output-dir", str(tmp_path / "text")]
    context = [sys.executable, "-m", "nemo_wrap.cli", "finetune", str(model), "--nproc", "2", "--cp-size", "2",
               "--batch-size", "2", "--seq-len", "64", "--steps", "3", "--output-dir", str(tmp_path / "context")]
    for command in (sft, context, text):
        completed = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert completed.returncode == 0, completed.stderr[-3000:]
        first, last = _losses(completed.stdout)
        assert last < first and "(3 steps)" in completed.stdout
    assert "pipeline stage 1: layers" in completed.stdout  # the text job prints its plan
    assert (tmp_path / "sft" / "adapter_config.json").is_file()
    _assert_loads_with_plain_transformers(tmp_path / "text")
    _assert_loads_with_plain_transformers(tmp_path / "context")


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("max_shard_size", ["5GB", "100KB"], ids=["one-file", "sharded"])
def test_report_refuses_a_consolidated_save_with_a_flipped_bit(cache, tmp_path, capsys, max_shard_size):
    from nemo_wrap import NeMoAutoModelForCausalLM

    saved = tmp_path / "saved"
    NeMoAutoModelForCausalLM.from_pretrained(default_model_path()).save_pretrained(
        saved, max_shard_size=max_shard_size, tokenizer=AutoTokenizer.from_pretrained(default_model_path())
    )
    weights = sorted(saved.glob("model*.safetensors"))
    assert main(["report", str(saved)]) == 0
    assert f"weights: {len(weights)} file(s) hold the contents the save wrote" in capsys.readouterr().out
    _flip_a_bit(weights[-1])
    with pytest.raises(SystemExit) as refused:
        main(["report", str(saved)])
    assert refused.value.code == 2
    said = capsys.readouterr().err
    assert f"{weights[-1]}: its contents changed since the save" in said and said.count("\n") == 1, said


@pytest.mark.parametrize("command", ["finetune", "plan", "report"])
def test_help_groups_every_flag_once_by_recipe_section_with_its_default(command, capsys):
    from nemo_wrap.recipes.config_file import recipe_fields
    from nemo_wrap.recipes.config_file import recipe_sections

    with pytest.raises(SystemExit) as excinfo:
        main([command, "--help"])
    assert excinfo.value.code == 0
    text = capsys.readouterr().out
    sections = [name for name, _ in recipe_sections()] if command != "report" else ["distributed", "load"]
    headings = re.findall(r"^(\w+):$", text, re.M)
    assert headings == ["options", "job", *(["memory"] if command == "plan" else []), *sections, "example"]
    keys = [key for key in recipe_fields() if key != "model" and (key.split(".")[0] in sections or "." not in key)]
    for key in keys:
        assert len(re.findall(rf"--{re.escape(key)}\b(?![._])", text)) == 1, key
    assert "--tp-size, --distributed.tp_size N" in text and "(default: fsdp2)" in text
    assert f"  nemo-wrap {command} " in text and "``" not in text


def test_a_hub_id_is_resolved_from_the_hub_cache_and_an_absent_one_is_named_offline(cache, tmp_path):
    from tests.support.hub_cache import plant_in_hub_cache

    plant_in_hub_cache(default_model_path(), tmp_path / "hf", "nemo-wrap-tests/tiny-llama")
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "nemo_wrap.cli", "finetune", "--steps", "2", "--output-dir", str(tmp_path / "out")]
    tuned = subprocess.run([*command, "nemo-wrap-tests/tiny-llama"], env=environment, capture_output=True, text=True)
    assert tuned.returncode == 0, tuned.stderr
    assert "loss: first step" in tuned.stdout
    _assert_loads_with_plain_transformers(tmp_path / "out")
    absent = subprocess.run([*command, "nemo-wrap-tests/absent"], env=environment, capture_output=True, text=True)
    assert absent.returncode == 2
    line = absent.stderr.strip().splitlines()[-1]
    assert line.startswith("nemo-wrap: error: nemo-wrap-tests/absent: not a local directory") and "hf download" in line
    assert str(tmp_path / "hf" / "hub") in line
