"""Episodes of a slow environment stepped in worker processes.

ALFWorld takes 0.1-0.2 s a step; B episodes stepped one after another would leave the
generator idle for seconds every turn. Here each worker process holds some of the episodes
(assigned round-robin as they start); a batch of steps is sent to every worker at once and
read back later, so the workers step in parallel with each other and, in
:func:`hisr_core.rollout.engine.play`, with the generation of the other episodes.

The worker builds its own environment from the registry name and options; a task travels as
its ``tasks`` row. A worker that dies or raises is reported with the task it was stepping.

:func:`expert_episodes` plays the benchmark's expert over many tasks in a pool of processes
that are replaced every few games: TextWorld keeps about 4 MB per ALFWorld game played in a
process, which over the 3,554 training games would grow one process past 10 GB.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Hashable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Self

from hisr_core.envs.base import ExpertEpisode, StepResult, Task

#: Expert games a pool process plays before it is replaced (bounds its memory, see above).
GAMES_PER_PROCESS = 50


def exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """End this worker process soon after its parent process ``parent`` is gone.

    A parent killed outright (SIGKILL, the second signal of an impatient stop) runs no cleanup;
    its workers would live on as orphans, stepping nothing and holding memory. A daemon
    thread watches the parent id (portable, unlike Linux's parent-death signal, which follows
    the parent *thread*)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def _worker(conn: Connection, env_name: str, max_turns: int, options: dict[str, Any],
            parent: int) -> None:
    exit_with_parent(parent)
    from hisr_core.envs import make_environment

    env = make_environment(env_name, max_turns, **options)
    episodes: dict[Hashable, Any] = {}
    while True:
        ticket, op, batch = conn.recv()
        if op == "stop":
            conn.send((ticket, "ok", None))
            return
        try:
            if op == "start":
                out: list[Any] = []
                for key, row in batch:
                    episodes[key] = env.start(Task.from_row(row))
                    out.append((episodes[key].reset(), episodes[key].distance_to_goal()))
            elif op == "step":
                out = []
                for key, action in batch:
                    result = episodes[key].step(action)
                    if result.done:
                        del episodes[key]
                    out.append(dataclasses.astuple(result))
            else:
                raise ValueError(f"unknown operation {op!r}")
            conn.send((ticket, "ok", out))
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it
            conn.send((ticket, "error", traceback.format_exc()))


class EnvWorkers:
    """``n`` worker processes stepping the episodes of one environment.

    Use as a context manager; :meth:`start` and :meth:`send_steps` / :meth:`receive_steps`
    take lists of ``(key, ...)`` pairs, the key naming an episode for its whole life.
    """

    def __init__(self, env_name: str, max_turns: int, options: dict[str, Any], n: int) -> None:
        if n < 1:
            raise ValueError(f"need at least one worker, got {n}")
        ctx = mp.get_context("spawn")  # never fork a process holding torch threads or CUDA
        self.max_turns = max_turns
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker,
                               args=(child, env_name, max_turns, dict(options), os.getpid()),
                               daemon=True, name=f"env-worker-{i}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._owner: dict[Hashable, int] = {}
        self._next = 0
        self._tickets = 0
        #: Answers read while waiting for another one, by (worker, ticket).
        self._early: dict[tuple[int, int], tuple[str, Any]] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if proc.is_alive():
                try:
                    conn.send((-1, "stop", None))
                    conn.recv()
                except (OSError, EOFError):
                    pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
            conn.close()

    def _send(self, op: str, per_worker: dict[int, list[Any]]) -> dict[int, int]:
        """Send each worker its batch; the ticket of each request, by worker."""
        tickets = {}
        for w, batch in per_worker.items():
            self._tickets += 1
            tickets[w] = self._tickets
            try:
                self._conns[w].send((self._tickets, op, batch))
            except OSError as exc:
                raise self._died(w) from exc
        return tickets

    def _died(self, w: int) -> RuntimeError:
        return RuntimeError(f"environment worker {w} died (exit code {self._procs[w].exitcode})")

    def _pull(self, w: int) -> None:
        """Read worker ``w``'s next answer into the answers kept for their turn."""
        try:
            got, status, payload = self._conns[w].recv()
        except (EOFError, OSError) as exc:
            raise self._died(w) from exc
        self._early[(w, got)] = (status, payload)

    def _recv(self, w: int, ticket: int) -> Any:
        """The answer to request ``ticket`` of worker ``w`` (answers to other requests read on
        the way are kept for their turn)."""
        while (w, ticket) not in self._early:
            self._pull(w)
        status, payload = self._early.pop((w, ticket))
        if status != "ok":
            raise RuntimeError(f"environment worker {w} failed:\n{payload}")
        return payload

    def start(self, items: Sequence[tuple[Hashable, Task]]) -> list[tuple[str, int]]:
        """Start and reset one episode per ``(key, task)``; their first observations, each with
        the episode's distance to its goal (``Episode.distance_to_goal``)."""
        per: dict[int, list[Any]] = {}
        for key, task in items:
            w = self._owner[key] = self._next % len(self._conns)
            self._next += 1
            per.setdefault(w, []).append((key, task.to_row()))
        answers = {w: iter(self._recv(w, t)) for w, t in self._send("start", per).items()}
        return [next(answers[self._owner[key]]) for key, _ in items]

    def send_steps(self, items: Sequence[tuple[Hashable, str]]) -> Any:
        """Send one action per episode; the workers step while the caller does other work.
        Returns the ticket to pass to :meth:`receive_steps`."""
        per: dict[int, list[Any]] = {}
        for key, action in items:
            per.setdefault(self._owner[key], []).append((key, action))
        tickets = self._send("step", per)
        return [(w, tickets[w], [key for key, _ in batch]) for w, batch in per.items()]

    def ready(self, ticket: Any) -> bool:
        """Whether every answer of a :meth:`send_steps` has arrived (never blocks)."""
        for w, t, _ in ticket:
            while (w, t) not in self._early:
                try:
                    if not self._conns[w].poll(0):
                        return False
                except (EOFError, OSError) as exc:
                    raise self._died(w) from exc
                self._pull(w)
        return True

    def receive_steps(self, ticket: Any) -> dict[Hashable, StepResult]:
        """The results of a :meth:`send_steps`, by key."""
        out: dict[Hashable, StepResult] = {}
        for w, t, keys in ticket:
            for key, fields in zip(keys, self._recv(w, t), strict=True):
                out[key] = StepResult(*fields)
                if out[key].done:
                    del self._owner[key]
        return out


#: The environment of this pool process (one per pool: same name, turns and options).
_POOL_ENV: list[Any] = []


def _expert_game(env_name: str, max_turns: int, options: dict[str, Any], row: dict[str, Any],
                 slip_rate: float) -> ExpertEpisode:
    if not _POOL_ENV:
        from hisr_core.envs import make_environment

        _POOL_ENV.append(make_environment(env_name, max_turns, **options))
    return _POOL_ENV[0].expert_play(Task.from_row(row), slip_rate)


def expert_episodes(env_name: str, max_turns: int, options: dict[str, Any],
                    tasks: Sequence[Task], slip_rate: float, workers: int,
                    games_per_process: int | None = None) -> Iterator[ExpertEpisode]:
    """The expert's play of every task of ``tasks``, in their order, by ``workers`` processes
    (replaced after about ``games_per_process`` games each, default
    :data:`GAMES_PER_PROCESS`). An error in a game is raised here."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    # A fresh pool for every workers x games_per_process games rather than Python 3.11's
    # max_tasks_per_child, which can deadlock when a process is replaced (CPython gh-115634).
    # spawn: never fork a process holding torch threads.
    per_pool = workers * (games_per_process or GAMES_PER_PROCESS)
    for first in range(0, len(tasks), per_pool):
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                 initializer=exit_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            futures = [pool.submit(_expert_game, env_name, max_turns, options, t.to_row(),
                                   slip_rate) for t in tasks[first:first + per_pool]]
            try:
                for future in futures:
                    yield future.result()
            finally:
                for future in futures:
                    future.cancel()
