"""SIGTERM / SIGINT handling (:mod:`hisr_core.train.preempt`) in real processes: a signal in a
training loop waits for the step boundary, outside one it stops at once; a second signal
exits at once after stopping the servers the process registered (callbacks registered for the
first signal run once, when it arrives); environment workers end
with a parent killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[3]

# A stand-in for a stage: a "server" child process it started (registered to be stopped), then
# a training loop whose steps take 0.2 s and check the stop flag at each boundary.
STAGE = textwrap.dedent("""
    import subprocess, sys, time
    from hisr_core.train import preempt

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    preempt.install("run it again")
    preempt.on_stop(server.kill)
    preempt.on_first_signal(lambda: print("first signal", file=sys.stderr, flush=True))
    print(server.pid, flush=True)
    mode = sys.argv[1]
    if mode == "outside":
        time.sleep(600)
    with preempt.deferred():
        for step in range(1, 10_000):
            time.sleep(0.2)            # the step under way
            print("step", step, flush=True)
            if mode == "loop" and preempt.requested():
                raise preempt.stopped(preempt.requested(), f"stopped after step {step}")
""")


def _start(mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", STAGE, mode], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    server = int(proc.stdout.readline())
    return proc, server


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _kill(*pids: int) -> None:
    """End what a test started and left running (a failed assertion)."""
    for pid in pids:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)


def _finish(proc: subprocess.Popen, server: int) -> tuple[int, str, str, bool]:
    """The stage's status and output once it exits, and whether its server is gone."""
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    try:
        return proc.returncode, out, err, _gone(server)
    finally:
        _kill(server)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_in_the_loop_ends_the_step_then_stops_with_one_line(sig):
    proc, server = _start("loop")
    assert proc.stdout.readline().startswith("step 1")
    proc.send_signal(sig)
    status, out, err, server_gone = _finish(proc, server)
    assert status == 128 + sig
    # The loop saw the flag at the boundary of the step under way (1 or 2), not later.
    last = err.strip().splitlines()[-1]
    assert last in ("stopped after step 1; run it again", "stopped after step 2; run it again")
    assert f"step {last.split()[3][:-1]}" == ("step 1\n" + out).strip().splitlines()[-1]
    assert server_gone, "the registered server is stopped at exit"
    assert err.count("first signal") == 1


def test_a_signal_outside_a_training_step_stops_at_once():
    proc, server = _start("outside")
    time.sleep(0.5)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    status, _, err, server_gone = _finish(proc, server)
    assert status == 128 + signal.SIGTERM and time.monotonic() - start < 10
    assert err.strip().splitlines()[-1] == \
        "stopped by SIGTERM outside a training step; run it again"
    assert server_gone


def test_a_second_signal_exits_at_once_and_stops_the_servers():
    proc, server = _start("ignore")  # a loop that never checks the flag: only a 2nd signal ends it
    assert proc.stdout.readline().startswith("step 1")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None, "the first signal waits for the loop"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    status, _, err, server_gone = _finish(proc, server)
    assert status == 128 + signal.SIGTERM and time.monotonic() - start < 5
    assert server_gone
    assert err.count("first signal") == 1, "the first-signal callbacks run once"


def test_environment_workers_end_with_a_parent_killed_outright():
    """The expert's process pool, idle between games when its parent is SIGKILLed: without the
    watch they live on (with the resource tracker they hold open) as orphans."""
    script = textwrap.dedent("""
        import time
        import psutil
        from hisr_core.envs import make_environment
        from hisr_core.envs.workers import expert_episodes

        tasks = make_environment("household", 8).make_tasks("train", 8, 0)
        episodes = expert_episodes("household", 8, {}, tasks, 0.0, 2)
        next(episodes)
        print(" ".join(str(c.pid) for c in psutil.Process().children(recursive=True)),
              flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) >= 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()  # SIGKILL: no cleanup of its own runs
        proc.wait()
    try:
        assert all(_gone(p) for p in pids)
    finally:
        _kill(*pids)
