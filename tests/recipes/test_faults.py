"""A run survives its faults: a killed rank, a SIGTERM (preemption), a hung peer — with real ranks.

Every case is a real job in subprocesses (torchrun ranks, or one process), hit with real signals.
The training step is patched in the workers by :data:`HOOK`, a script torchrun runs in place of
``-m nemo_wrap.cli`` (or, under the command line's own ``--nproc`` relaunch, a ``sitecustomize``
that imports it in each rank): it prints ``PID rank pid`` and ``STEP rank n`` lines so the test
knows whom to signal and when, can slow each step down, and can send a signal to its own rank at a
given step of the first attempt. Losses are compared step by step (the last record of each step in
``metrics.jsonl``) with a 2-rank run that was never interrupted. Every process a case started is
gone at its end (checked, and killed in ``finally`` otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from nemo_wrap.checkpoint.rotation import is_complete_checkpoint
from nemo_wrap.recipes.preemption import PREEMPTED_EXIT_STATUS, REPEAT_GRACE_S

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
JOB = ["finetune", "--steps", str(STEPS), "--save-every", "3", "--batch-size", "4", "--seq-len", "32",
       "--report-to", "none"]  # fmt: skip
LAUNCH_TIMEOUT_S = 180  # a guard against hangs, not a measure of speed
# torchrun 2.13's agent stops the other ranks of a failed group with SIGTERM and SIGKILLs them only
# after this long (LocalElasticAgent._stop_workers: its default, not --shutdown-timeout); a stopped
# rank cannot run its SIGTERM handler, so the job ends that much after the failure.
TORCHRUN_STOP_GRACE_S = 30

HOOK = r'''
"""nemo-wrap with its training step patched for tests/recipes/test_faults.py (see its docstring)."""
import os, signal, sys, time


def say(line):
    os.write(1, f"{line}\n".encode())  # one write: the ranks share the pipe, their lines must not interleave


def install():
    from nemo_wrap.recipes import sft

    rank = int(os.environ.get("RANK", "0"))
    real_step, calls = sft.train_step, [0]
    slow, slow_from = float(os.environ.get("FAULT_SLOW_S", "0")), int(os.environ.get("FAULT_SLOW_FROM", "1"))
    fault = os.environ.get("FAULT_SIGNAL")  # "rank:step:SIGNAME", on the first attempt only
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    say(f"PID {rank} {os.getpid()}")

    def step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        calls[0] += 1
        say(f"STEP {rank} {calls[0]}")
        if fault and first_attempt and fault.split(":")[:2] == [str(rank), str(calls[0])]:
            os.kill(os.getpid(), getattr(signal, fault.split(":")[2]))
        if slow and calls[0] >= slow_from:
            time.sleep(slow)
        return result

    sft.train_step = step
    if os.environ.get("FAULT_PHASE") and first_attempt:  # "rank:phase:SIGNAME"
        target, phase, name = os.environ["FAULT_PHASE"].split(":")
        if target == str(rank):
            signal_during(phase, getattr(signal, name))


def signal_during(phase, signum):
    """Send ``signum`` to this rank once, as ``phase`` starts: the model's load, a step, an
    evaluation, a periodic checkpoint, the final save (right after the closing evaluation), or the
    end of a background save (``--async-save``)."""
    from nemo_wrap.checkpoint.rotation import CheckpointRotation
    from nemo_wrap.recipes import sft

    from nemo_wrap.checkpoint.resume import PendingSave

    owner, name = {"load": (sft, "_load_model"), "step": (sft, "train_step"), "eval": (sft, "evaluate"),
                   "save": (CheckpointRotation, "save"), "final": (sft, "_train_and_evaluate"),
                   "finish": (PendingSave, "finish")}[phase]  # fmt: skip
    real, sent = getattr(owner, name), []

    def hit(*args, **kwargs):
        if phase != "final" and not sent:
            say(f"SIGNALLED {phase}")  # first: a SIGKILL ends the rank at once
            sent.append(os.kill(os.getpid(), signum))
        result = real(*args, **kwargs)
        if phase == "final":
            say(f"SIGNALLED {phase}")
            os.kill(os.getpid(), signum)
        return result

    setattr(owner, name, hit)


if __name__ == "__main__":
    install()
    from nemo_wrap.cli import main

    try:
        status = main(sys.argv[1:])
    except SystemExit as stop:
        status = stop.code
    say(f"EXIT {os.environ.get('RANK', '0')} {status}")
    sys.exit(status)
'''
SITECUSTOMIZE = 'import os\nif "LOCAL_RANK" in os.environ:\n    import fault_hook\n    fault_hook.install()\n'


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private ``NEMO_WRAP_CACHE`` with the embedded default built once, before any rank needs it."""
    root = tmp_path_factory.mktemp("nemo_wrap_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEMO_WRAP_CACHE", str(root))
        from nemo_wrap.default_model import default_model_path

        default_model_path()
        yield root


@pytest.fixture(scope="module")
def hook(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fault_hook")
    (directory / "fault_hook.py").write_text(HOOK)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


class Job:
    """A subprocess whose stdout and stderr lines are read as they come, each with its arrival time."""

    def __init__(self, command: list[str], cwd: Path, **env: str) -> None:
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.seen: list[tuple[float, str]] = []
        self.process = subprocess.Popen(command, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        self.family: set[int] = {self.process.pid}  # every process of the job seen so far
        self._ended: float | None = None
        for stream in (self.process.stdout, self.process.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, predicate, timeout: float = LAUNCH_TIMEOUT_S) -> tuple[float, str]:
        """The first line (and its arrival time) for which ``predicate`` holds; fails on the timeout."""
        deadline = time.monotonic() + timeout
        for seen in self.seen:
            if predicate(seen[1]):
                return seen
        while time.monotonic() < deadline:
            self.note_family()
            try:
                seen = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and time.monotonic() > self.ended + 2:  # output read
                    break
                continue
            self.seen.append(seen)
            if predicate(seen[1]):
                return seen
        pytest.fail(f"no such line (within {timeout} s, or before the job ended); it said:\n{self.text()[-4000:]}")

    @property
    def ended(self) -> float:
        """When the command was first seen to have exited (``inf`` while it runs)."""
        if self.process.poll() is not None and self._ended is None:
            self._ended = time.monotonic()
        return float("inf") if self._ended is None else self._ended

    def note_family(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.family.update(child.pid for child in psutil.Process(self.process.pid).children(recursive=True))

    def pids(self) -> dict[int, int]:
        """Each rank's pid, from the ``PID rank pid`` lines."""
        self.drain()
        return {int(line.split()[1]): int(line.split()[2]) for _, line in self.seen if line.startswith("PID ")}

    def last_steps(self) -> dict[int, int]:
        """The last step each rank finished, from the ``STEP rank n`` lines."""
        self.drain()
        steps: dict[int, int] = {}
        for _, line in self.seen:
            if line.startswith("STEP "):
                steps[int(line.split()[1])] = int(line.split()[2])
        return steps

    def finish(self, timeout: float = LAUNCH_TIMEOUT_S) -> int:
        status = self.process.wait(timeout=timeout)
        self.drain()
        return status

    def drain(self) -> None:
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return

    def text(self) -> str:
        self.drain()
        return "\n".join(line for _, line in self.seen)

    def kill_everything(self) -> None:
        """SIGCONT and SIGKILL whatever of the job is left (a stopped rank included)."""
        self.note_family()
        self.family.update(self.pids().values())
        for pid in self.family:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        self.process.wait(timeout=30)

    def assert_nothing_left(self) -> None:
        self.note_family()
        self.family.update(self.pids().values())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in self.family):
            time.sleep(0.1)
        assert not [pid for pid in self.family if _alive(pid)], "processes of the job are still running"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _torchrun(hook: Path, output: Path, *extra: str, restarts: int = 0, script: bool = True) -> list[str]:
    worker = [str(hook / "fault_hook.py")] if script else ["-m", "nemo_wrap.cli"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), *worker, *JOB, "--output-dir", str(output), *extra]  # fmt: skip


def _run(command: list[str], cwd: Path, **env: str) -> Job:
    """Run ``command`` to its end; fail with its output unless it exits 0."""
    job = Job(command, cwd, **env)
    try:
        assert job.finish() == 0, job.text()[-4000:]
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    job.assert_nothing_left()
    return job


def _step_losses(output: Path) -> dict[int, float]:
    """The loss of each step in ``metrics.jsonl``: a step logged again after a resume, its last record."""
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _assert_same_losses(output: Path, reference: dict[int, float]) -> None:
    losses = _step_losses(output)
    assert losses.keys() == reference.keys()
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6), step


def _latest_step(output: Path) -> int:
    name = (output / "latest").read_text().strip()
    assert is_complete_checkpoint(output / name)
    return int(name.removeprefix("checkpoint-"))


@pytest.fixture(scope="module")
def uninterrupted(cache, hook, tmp_path_factory) -> dict[int, float]:
    """Each step's loss in a 2-rank run of ``JOB`` that nothing interrupts (its ``nproc`` of 4, a
    recipe written for another world, set aside for torchrun's, said once)."""
    output = tmp_path_factory.mktemp("uninterrupted") / "out"
    job = _run(_torchrun(hook, output, "--distributed.nproc", "4"), output.parent)  # a recipe for 4 ranks
    assert job.text().count("the recipe's nproc 4 is set aside: torchrun started 2 rank(s)") == 1
    losses = _step_losses(output)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_a_killed_rank_restarts_the_group_which_goes_on_with_the_uninterrupted_losses(uninterrupted, hook, tmp_path):
    output = tmp_path / "out"
    job = _run(_torchrun(hook, output, "--resume", "auto", restarts=1), tmp_path, FAULT_SIGNAL="1:5:SIGKILL")
    text = job.text()
    assert f"resumed from {output / 'checkpoint-3'} at step 3" in text  # the second attempt
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records].count(4) == 2  # steps 4 and 5 ran twice: once before the kill
    _assert_same_losses(output, uninterrupted)


def _two_agents(hook: Path, output: Path, cwd: Path, **env: str) -> list[Job]:
    """Two torchrun agents on this machine as two nodes of 2 ranks (c10d rendezvous), restarting
    once, with a store of each attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: see
    ``nemo_wrap.distributed.env._require_restartable_launch``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-agents",
               "--max-restarts", "1", str(hook / "fault_hook.py"), *JOB, "--output-dir", str(output),
               "--resume", "auto"]  # fmt: skip
    environment = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", **env}
    return [Job([*command[:5], "--node-rank", str(node), *command[5:]], cwd, **environment) for node in (0, 1)]


def _finish_all(jobs: list[Job]) -> None:
    try:
        statuses = [job.finish() for job in jobs]
        assert statuses == [0, 0], "\n".join(job.text()[-3000:] for job in jobs)
    finally:
        for job in jobs:
            if job.process.poll() is None:
                job.kill_everything()
    for job in jobs:
        job.assert_nothing_left()


def test_a_rank_killed_on_the_second_node_restarts_both_nodes_on_the_uninterrupted_losses(cache, hook, tmp_path):
    plain, killed = tmp_path / "plain", tmp_path / "killed"
    _finish_all(_two_agents(hook, plain, tmp_path))
    jobs = _two_agents(hook, killed, tmp_path, FAULT_SIGNAL="2:5:SIGKILL")  # rank 2: node 1's first rank
    _finish_all(jobs)
    assert f"resumed from {killed / 'checkpoint-3'} at step 3" in jobs[0].text()
    records = [json.loads(line) for line in (killed / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records].count(4) == 2  # steps 4 and 5 ran twice: once before the kill
    _assert_same_losses(killed, _step_losses(plain))


def test_sigterm_to_one_rank_stops_every_rank_after_one_step_with_a_checkpoint_to_resume(uninterrupted, hook, tmp_path):
    output = tmp_path / "out"
    job = Job(_torchrun(hook, output), tmp_path, FAULT_SLOW_S="1")
    try:
        job.wait_for(lambda line: line == "STEP 1 2")
        os.kill(job.pids()[1], signal.SIGTERM)
        assert job.finish() != 0  # torchrun reports the ranks' status 75 as a failure
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    job.assert_nothing_left()
    stopped = _latest_step(output)
    assert job.last_steps() == {0: stopped, 1: stopped} and stopped < STEPS
    assert max(_step_losses(output)) == stopped
    assert f"EXIT 1 {PREEMPTED_EXIT_STATUS}" in job.text() or f"EXIT 0 {PREEMPTED_EXIT_STATUS}" in job.text()
    assert f"stopped by SIGTERM after step {stopped} of {STEPS}" in job.text()
    assert not (output / "model.safetensors").exists()  # the run did not finish

    _run(_torchrun(hook, output, "--resume", "auto", script=False), tmp_path)
    _assert_same_losses(output, uninterrupted)


EVAL_EVERY = 4


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("eval") / "eval.jsonl"
    path.write_text("".join(json.dumps({"text": f"held-out line {i}: the quick brown fox"}) + "\n" for i in range(4)))
    return path


def _interrupted(hook: Path, output: Path, cwd: Path, fault: str, *extra: str) -> tuple[int, Job]:
    """A 2-rank run of ``JOB`` whose rank signals itself as ``FAULT_PHASE`` says; its status and output."""
    job = Job(_torchrun(hook, output, *extra), cwd, FAULT_PHASE=fault)
    try:
        status = job.finish()
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    job.assert_nothing_left()
    assert "SIGNALLED" in job.text(), job.text()[-4000:]
    return status, job


def _each_step_trained_once(output: Path) -> None:
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(("phase", "stopped"), [("eval", EVAL_EVERY), ("save", 3)])
def test_sigterm_during_an_evaluation_or_a_save_finishes_it_and_keeps_every_finished_step(
    phase, stopped, uninterrupted, hook, eval_data, tmp_path
):
    output, extra = tmp_path / "out", ["--eval-data", str(eval_data), "--eval-every", str(EVAL_EVERY)]
    status, job = _interrupted(hook, output, tmp_path, f"1:{phase}:SIGTERM", *extra)
    assert status != 0  # torchrun reports the ranks' status 75 as a failure
    assert f"EXIT 0 {PREEMPTED_EXIT_STATUS}" in job.text() and f"EXIT 1 {PREEMPTED_EXIT_STATUS}" in job.text()
    assert job.last_steps() == {0: stopped, 1: stopped}  # no step after the one whose phase was signalled
    assert _latest_step(output) == stopped

    _run(_torchrun(hook, output, *extra, "--resume", "auto", script=False), tmp_path)
    _each_step_trained_once(output)
    _assert_same_losses(output, uninterrupted)


def test_sigterm_while_loading_stops_every_rank_before_the_first_step_with_nothing_saved(cache, hook, tmp_path):
    output = tmp_path / "out"
    status, job = _interrupted(hook, output, tmp_path, "1:load:SIGTERM")
    assert status != 0
    assert f"EXIT 0 {PREEMPTED_EXIT_STATUS}" in job.text() and f"EXIT 1 {PREEMPTED_EXIT_STATUS}" in job.text()
    assert job.last_steps() == {}
    assert "stopped by SIGTERM before the first step (after loading the model)" in job.text()
    assert not list(output.glob("checkpoint-*")) and not (output / "model.safetensors").exists()


def test_sigterm_after_the_last_step_finishes_the_final_save_and_a_rerun_trains_nothing(uninterrupted, hook, tmp_path):
    output = tmp_path / "out"
    status, job = _interrupted(hook, output, tmp_path, "1:final:SIGTERM")
    assert status == 0, job.text()[-4000:]
    assert "EXIT 0 0" in job.text() and "EXIT 1 0" in job.text()
    assert "a SIGTERM arrived after the last step" in job.text()
    final = (output / "model.safetensors").read_bytes()

    rerun = _run(_torchrun(hook, output, "--resume", "auto"), tmp_path)
    assert rerun.last_steps() == {} and f"this run's {STEPS} steps are done: nothing to train" in rerun.text()
    assert (output / "model.safetensors").read_bytes() == final
    _each_step_trained_once(output)
    _assert_same_losses(output, uninterrupted)


@pytest.mark.parametrize(
    ("phase", "doing"),
    [("load", "loading the model"), ("step", "training step 1"), ("eval", f"the evaluation after step {EVAL_EVERY}"),
     ("save", "the checkpoint of step 3"), ("final", "the final save"),
     ("finish", "finishing the background save of step 3")],
)  # fmt: skip
def test_a_dead_peer_is_named_by_every_survivor_with_what_it_was_doing(phase, doing, cache, hook, eval_data, tmp_path):
    extra = ["--eval-data", str(eval_data), "--eval-every", str(EVAL_EVERY), *(["--async-save"] * (phase == "finish"))]
    status, job = _interrupted(hook, tmp_path / "out", tmp_path, f"1:{phase}:SIGKILL", *extra)
    assert status != 0 and "EXIT 0 2" in job.text(), job.text()[-4000:]
    _, said = job.wait_for(lambda line: line.startswith("nemo-wrap: error: rank 0 of 2"), timeout=0)
    assert said.startswith(f"nemo-wrap: error: rank 0 of 2: {doing}: rank 1 is gone (killed, crashed"), said


def test_sigterm_to_every_process_of_an_nproc_job_checkpoints_and_exits_75(uninterrupted, hook, tmp_path):
    """As SLURM does: the command, torchrun's agent and both ranks get a SIGTERM at once; the ranks
    also get the copies their agent forwards (and the one the command passes on to the agent)."""
    output = tmp_path / "out"
    command = [sys.executable, "-m", "nemo_wrap.cli", *JOB, "--nproc", "2", "--output-dir", str(output)]
    pythonpath = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    job = Job(command, tmp_path, FAULT_SLOW_S="1", PYTHONPATH=pythonpath)
    try:
        job.wait_for(lambda line: line == "STEP 1 2")
        job.note_family()
        for pid in sorted(job.family, reverse=True):  # the ranks (youngest) first, the command last
            os.kill(pid, signal.SIGTERM)
        status = job.finish()
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    job.assert_nothing_left()
    assert status == PREEMPTED_EXIT_STATUS, job.text()[-4000:]
    stopped = _latest_step(output)
    assert job.last_steps() == {0: stopped, 1: stopped} and stopped < STEPS
    _, said = job.wait_for(lambda line: line.startswith("nemo-wrap: stopped by SIGTERM"), timeout=0)
    assert str(output / f"checkpoint-{stopped}") in said and "--resume auto" in said

    _run([*command, "--resume", "auto"], tmp_path)
    _assert_same_losses(output, uninterrupted)


def test_one_process_stops_with_the_preempted_status_and_a_checkpoint(cache, hook, tmp_path):
    output = tmp_path / "out"
    job = Job([sys.executable, str(hook / "fault_hook.py"), *JOB, "--output-dir", str(output)], tmp_path,
              FAULT_SIGNAL="0:4:SIGTERM")  # fmt: skip
    try:
        status = job.finish()
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    assert status == PREEMPTED_EXIT_STATUS, job.text()[-4000:]
    assert f"EXIT 0 {PREEMPTED_EXIT_STATUS}" in job.text()
    assert f"nemo-wrap: stopped by SIGTERM after step 4 of {STEPS}" in job.text()
    assert _latest_step(output) == 4 and max(_step_losses(output)) == 4


def test_a_second_sigterm_exits_at_once(cache, hook, tmp_path):
    output = tmp_path / "out"
    job = Job([sys.executable, str(hook / "fault_hook.py"), *JOB, "--output-dir", str(output)], tmp_path,
              FAULT_SLOW_S="120", FAULT_SLOW_FROM="2")  # fmt: skip
    try:
        job.wait_for(lambda line: line == "STEP 0 2")  # step 2 now takes two minutes
        job.process.send_signal(signal.SIGTERM)
        time.sleep(REPEAT_GRACE_S + 0.5)
        assert job.process.poll() is None  # the first one asks to stop after the step: it goes on
        sent = time.monotonic()
        job.process.send_signal(signal.SIGTERM)
        status = job.finish(timeout=60)
        took = time.monotonic() - sent
    finally:
        if job.process.poll() is None:
            job.kill_everything()
    assert status == -signal.SIGTERM and took < 30  # not after the step
    assert not (output / "checkpoint-2").exists()


def test_a_stopped_rank_makes_the_others_fail_within_the_timeout(cache, hook, tmp_path):
    timeout = 8
    output = tmp_path / "out"
    job = Job(_torchrun(hook, output, "--timeout", str(timeout)), tmp_path, FAULT_SLOW_S="0.5")
    try:
        job.wait_for(lambda line: line == "STEP 1 2")
        os.kill(job.pids()[1], signal.SIGSTOP)
        stopped = time.monotonic()
        failed, said = job.wait_for(lambda line: line.startswith("nemo-wrap: error: rank 0 of 2"))
        status = job.finish()
        ended = time.monotonic()
    finally:
        job.kill_everything()
    job.assert_nothing_left()
    assert status != 0
    assert f"timeout of {timeout} s" in said and "step" in said, said
    assert failed - stopped <= 2 * timeout
    assert ended - stopped <= 2 * timeout + TORCHRUN_STOP_GRACE_S + 5


def test_the_fault_flags_are_recipe_keys(capsys):
    from nemo_wrap.cli import main

    assert main(["finetune", "--max-restarts", "2", "--timeout", "5", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "max_restarts: 2" in printed and "timeout_s: 5.0" in printed
    assert main(["finetune", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "max_restarts: 0" in printed and "timeout_s: 1800.0" in printed

