"""``nemo_wrap.notebook.launch``: several ranks from one call, rank 0's value back, failures in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_wrap.errors import LaunchError
from nemo_wrap.notebook import launch


def report_world(offset: int) -> tuple[int, int, float]:
    total = torch.tensor([dist.get_rank() + offset], dtype=torch.float32)
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says hello")
    return dist.get_rank(), dist.get_world_size(), float(total)


def fail_on_rank_1(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 waits for a partner that never comes


def sleep_forever(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _gone(pid_dir: Path) -> bool:
    for path in pid_dir.glob("*.pid"):
        try:
            os.kill(int(path.read_text()), 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_launch_returns_rank_zeros_value_and_streams_its_output(capfd):
    assert launch(report_world, 2, 10) == (0, 2, 21.0)
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" not in out


def test_a_failure_on_one_rank_raises_within_seconds_and_leaves_no_process(tmp_path):
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)rank 1 of 2 failed:.*ValueError: boom on rank 1"):
        launch(fail_on_rank_1, 2, str(tmp_path))
    failed_after = time.monotonic() - started
    assert len(list(tmp_path.glob("*.pid"))) == 2 and _gone(tmp_path)
    started = time.monotonic()
    assert launch(report_world, 2, 0) == (0, 2, 1.0)  # the next launch works
    trivial = time.monotonic() - started
    # Rank 0 waits in a barrier for the failed rank: without the launcher ending the job it would wait
    # for gloo's timeout (30 min). Measured against a trivial launch on the same machine just now, so a
    # loaded machine does not fail it: the failure costs about one launch, not minutes.
    assert failed_after < 3 * trivial + 10, (failed_after, trivial)


def test_a_timeout_ends_the_job(tmp_path):
    started = time.monotonic()
    assert launch(report_world, 2, 0) == (0, 2, 1.0)
    trivial = time.monotonic() - started
    started = time.monotonic()
    with pytest.raises(LaunchError, match="timeout=3"):
        launch(sleep_forever, 2, str(tmp_path), timeout=3)
    # the 3 s, plus about one launch (measured just now, so a loaded machine does not fail it)
    assert time.monotonic() - started < 3 + 3 * trivial + 10 and _gone(tmp_path)


def test_three_launches_in_one_kernel_the_middle_one_failing(tmp_path):
    """Functions defined in cells travel by value; a failed launch leaves the kernel able to launch."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    cells = [
        "import torch, torch.distributed as dist\nfrom nemo_wrap import initialize_distributed\n"
        "from nemo_wrap.notebook import launch\ninitialize_distributed()  # a world of one in the kernel",
        "def world():\n    return dist.get_world_size(), dist.get_rank()\n\n"
        "def fail():\n    if dist.get_rank() == 1:\n        raise KeyError('rank one says no')\n    dist.barrier()",
        "assert launch(world, 2) == (2, 0)",
        "launch(fail, 2)",
        "assert launch(world, 2) == (2, 0)",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    kernel = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(notebook, km=kernel, timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        for index in (0, 1, 2):
            client.execute_cell(notebook.cells[index], index)
        with pytest.raises(CellExecutionError, match="(?s)rank 1 of 2 failed.*rank one says no"):
            client.execute_cell(notebook.cells[3], 3)
        client.execute_cell(notebook.cells[4], 4)


def fine_tune_three_steps(path: str) -> list[float]:
    from nemo_wrap import DistributedSetup
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    setup = DistributedSetup.build("fsdp2", dist.get_world_size())
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [{"input_ids": torch.randint(0, 257, (2, 16), generator=generator)} for _ in range(3)]
    return [train_step(model, optimizer, [batch]).loss for batch in batches]


def test_an_fsdp2_fine_tune_through_launch_equals_the_same_function_on_launched_ranks(ranks2, tmp_path):
    from tests.support.checkpoints import write_checkpoint

    path = str(write_checkpoint(tmp_path / "base", "own-llama", "distinct", tie=False))
    assert launch(fine_tune_three_steps, 2, path) == ranks2.run(fine_tune_three_steps, path)[0]


def test_an_interrupt_ends_every_rank(tmp_path):
    """The kernel's stop button is a KeyboardInterrupt in the launching process."""
    import signal
    import subprocess
    import sys

    # a kernel turns SIGINT into KeyboardInterrupt even where the test runner was started with SIGINT
    # ignored (a background job of a non-interactive shell), which its children would inherit
    script = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" \
             "from tests.notebooks.test_notebook_launch import sleep_forever\n" \
             "from nemo_wrap.notebook import launch\n" \
             f"launch(sleep_forever, 2, {str(tmp_path)!r})"
    caller = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(tmp_path.glob("*.pid"))) == 2
    caller.send_signal(signal.SIGINT)
    assert caller.wait(timeout=30) != 0
    assert _gone(tmp_path)


def abort_on_rank_1(after_returning: bool) -> None:
    """Ends rank 1 the way a crash in C++ code does: SIGABRT, no Python traceback of its own."""
    import atexit
    import threading

    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a second thread to report
    if dist.get_rank() == 1 and after_returning:
        atexit.register(os.abort)  # once the function has returned and the group is torn down
    elif dist.get_rank() == 1:
        os.abort()
    dist.barrier()


@pytest.mark.parametrize("after_returning", [False, True], ids=["while-running", "after-returning"])
def test_a_rank_killed_by_a_signal_says_which_when_and_where_its_threads_were(after_returning):
    phase = "after its function had returned" if after_returning else "while its function ran"
    with pytest.raises(LaunchError) as raised:
        launch(abort_on_rank_1, 2, after_returning, timeout=120)
    message = str(raised.value)
    assert f"rank 1 of 2 failed:\nkilled by SIGABRT, {phase}; its Python threads then:" in message
    # the main thread, the sleeping one, and (while the group exists) the rank's heartbeat (liveness.py)
    assert message.count("(most recent call first)") == (2 if after_returning else 3)
    assert ("in abort_on_rank_1" in message) != after_returning
    assert "Extension modules" not in message  # faulthandler's list of them is noise here
