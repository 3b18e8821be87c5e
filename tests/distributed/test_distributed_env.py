"""initialize_distributed: single process (notebook), real torchrun, and inside rank pools."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_wrap import DistributedStateError, destroy_distributed, initialize_distributed

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_launcher(monkeypatch):
    """A notebook-like process: no torchrun variables, no process group."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    destroy_distributed()


def test_single_process_world_and_rerun_of_the_cell(no_launcher):
    env = initialize_distributed()
    assert (env.rank, env.world_size, env.local_rank, env.backend) == (0, 1, 0, "gloo")
    assert env.device == torch.device("cpu") and env.is_main_process
    assert dist.is_initialized() and dist.get_world_size() == 1
    value = torch.tensor([2.0])
    dist.all_reduce(value)
    assert value.item() == 2.0
    assert initialize_distributed() == env  # re-running the cell: same env, no re-init
    assert initialize_distributed(backend="gloo") == env


def test_backend_mismatch_and_unknown_backend_raise(no_launcher):
    with pytest.raises(DistributedStateError, match="backend='mpi'"):
        initialize_distributed(backend="mpi")
    initialize_distributed(backend="gloo")
    with pytest.raises(DistributedStateError, match="already initialized with backend 'gloo'"):
        initialize_distributed(backend="nccl")


def test_destroy_then_initialize_again(no_launcher):
    initialize_distributed()
    destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()  # a second teardown is a no-op
    env = initialize_distributed()
    assert env.world_size == 1 and dist.is_initialized()


def test_two_notebooks_at_once_get_different_ports():
    """Two single-process worlds on one machine must not collide on a port."""
    script = textwrap.dedent(
        """
        import time, torch.distributed as dist
        from nemo_wrap import initialize_distributed, destroy_distributed
        env = initialize_distributed()
        time.sleep(2)
        dist.barrier()
        print("ok", env.world_size)
        destroy_distributed()
        """
    )
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    processes = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, cwd=REPO_ROOT)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert all(out.strip() == "ok 1" for out, _ in outputs)


def test_real_torchrun_two_ranks(tmp_path):
    """The launcher path for real: env:// rendezvous, rank facts, a collective, an idempotent re-call."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch, torch.distributed as dist
            from pathlib import Path
            from nemo_wrap import initialize_distributed, destroy_distributed
            env = initialize_distributed()
            assert initialize_distributed() == env
            total = torch.tensor([float(env.rank + 1)])
            dist.all_reduce(total)
            # one file per rank: the ranks' stdout streams interleave
            Path(sys.argv[1], f"rank{env.rank}.txt").write_text(
                f"rank={env.rank} world={env.world_size} local={env.local_rank} backend={env.backend} sum={total.item()}"
            )
            destroy_distributed()
            """
        )
    )
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert lines == [
        "rank=0 world=2 local=0 backend=gloo sum=3.0",
        "rank=1 world=2 local=1 backend=gloo sum=3.0",
    ]


def case_env_inside_an_existing_group():
    env = initialize_distributed()
    again = initialize_distributed()
    return env.rank, env.world_size, env.local_rank, env.backend, again == env


def test_env_describes_an_existing_group(ranks2):
    assert ranks2.run(case_env_inside_an_existing_group) == [(0, 2, 0, "gloo", True), (1, 2, 1, "gloo", True)]


_TORCHRUN_AGENT = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip


@pytest.mark.parametrize(
    ("nodes", "restarts", "shared_store", "refused"),
    [("2", "1", "True", True), ("2", "0", "True", False), ("1", "3", "True", False), ("2", "1", "False", False)],
)  # fmt: skip
def test_a_multi_node_launch_whose_restart_would_hang_is_refused_before_the_group_forms(
    monkeypatch, nodes, restarts, shared_store, refused
):
    """A refused launch fails in ``initialize_distributed`` before any connection is tried (port 1
    has no store: a launch let through would fail there, with another error); the check lets the
    others through."""
    for name, value in {**_TORCHRUN_AGENT, "GROUP_WORLD_SIZE": nodes, "TORCHELASTIC_MAX_RESTARTS": restarts,
                        "TORCHELASTIC_USE_AGENT_STORE": shared_store}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    if refused:
        with pytest.raises(DistributedStateError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
            initialize_distributed(timeout_s=1)
    else:
        from nemo_wrap.distributed import env

        env._require_restartable_launch()  # passes: the launch's restarts can work
