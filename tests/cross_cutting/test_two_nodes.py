"""Two nodes, simulated: two torchrun agents on this machine meet through torch's c10d rendezvous.

HSDP with one replica per node gives the one-process losses; an agent whose peer never comes
fails within the rendezvous timeout instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.training import train_step
from tests.support.batches import local_micro_batches
from tests.support.checkpoints import write_checkpoint
from tests.support.launch_lines import torchrun_words

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agent(node_rank: int, port: int, *job_arguments: str, join_timeout: int = 60) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node-test",
        "--rdzv-conf", f"join_timeout={join_timeout}",
        str(ROOT / "tests" / "support" / "two_node_job.py"), *job_arguments,
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    environment["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _one_process_losses(checkpoint: Path) -> list[float]:
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    return [train_step(model, optimizer, local_micro_batches(step, 0, 1, 1)).loss for step in range(3)]


def test_hsdp_with_one_replica_per_node_matches_one_process(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "distinct", tie=True)
    port = _free_port()
    agents = [_agent(node, port, str(checkpoint), str(tmp_path / "losses.json")) for node in (0, 1)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    result = json.loads((tmp_path / "losses.json").read_text())
    assert result["world"] == 4 and result["replica_of_rank0"] == 0
    expected = _one_process_losses(checkpoint)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)


def test_an_agent_whose_peer_node_never_comes_fails_instead_of_hanging(tmp_path):
    alone = _agent(0, _free_port(), "unused", "unused", join_timeout=10)
    output = alone.communicate(timeout=120)[0]
    assert alone.returncode != 0
    assert "Rendezvous" in output or "rendezvous" in output, output[-2000:]


SBATCH = ROOT / "docs" / "how-to" / "launch" / "multinode.sbatch"
PYTORCHJOB = ROOT / "docs" / "how-to" / "launch" / "pytorchjob.yaml"


def _as_two_local_agents(words: list[str], port: int) -> list[str]:
    """The launch line with the site's values replaced by two agents of 2 ranks on this machine."""
    local = {"--nnodes": "2", "--nproc-per-node": "2", "--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": "docs-job"}
    replaced = [local.get(before, word) for before, word in zip(["", *words], words)]
    return [sys.executable, "-m", "torch.distributed.run", *replaced[1:]]


def test_the_slurm_and_kubernetes_launch_lines_agree_and_run_on_two_local_agents(tmp_path):
    slurm = torchrun_words(SBATCH.read_text())
    manifest = yaml.safe_load(PYTORCHJOB.read_text())
    containers = [spec["template"]["spec"]["containers"][0] for spec in manifest["spec"]["pytorchReplicaSpecs"].values()]
    kubernetes = [torchrun_words(container["args"][0]) for container in containers]
    assert kubernetes[0] == kubernetes[1]
    for words in (slurm, kubernetes[0]):
        assert words[words.index("-m") :] == slurm[slurm.index("-m") :]
        assert words[1 : words.index("-m") : 2] == slurm[1 : slurm.index("-m") : 2]  # the same launcher options
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    port = _free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [*_as_two_local_agents(slurm, port), "--steps", "4"]
    agents = [subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]  # fmt: skip
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    records = [json.loads(line) for line in (tmp_path / "nemo_wrap_output" / "logs" / "metrics.jsonl").open()]
    assert [record["step"] for record in records if "loss" in record] == [1, 2, 3, 4]
    assert (tmp_path / "nemo_wrap_output" / "model.safetensors").is_file()
