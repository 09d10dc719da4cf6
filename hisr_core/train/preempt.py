"""SIGTERM and SIGINT as a clean stop (a preempted job, a Ctrl-C, ``dvc repro`` interrupted).

Inside a training loop (:func:`deferred`) the first signal only sets a flag: the loop finishes
its optimizer step, writes a checkpoint and raises :class:`Preempted`. Anywhere else the signal
raises :class:`Preempted` at once, as Python's own SIGINT raises ``KeyboardInterrupt``. A second
signal exits at once (after the stop callbacks, :func:`on_stop`).

:class:`Preempted` is a ``SystemExit`` with status ``128 + signal``: nothing that catches
``Exception`` swallows it, Prefect and MLflow see the run end (``stage_run`` marks it KILLED),
``atexit`` handlers run (Prefect stops its API server there), and the process exits with the
status a shell reports for a killed job, without a traceback. The one line saying how to resume
is printed after every other exit handler (:func:`install`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """A stop asked for by a signal; ``code`` is ``128 + signum``, ``message`` says where the
    work stands (the checkpoint written, or none)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message or f"stopped by {signal.Signals(signum).name}"


_received: list[int] = []
_deferring = 0
_callbacks: list[Callable[[], None]] = []
_first_callbacks: list[Callable[[], None]] = []
_final: list[str] = []
_installed = False
_how_to_resume: list[str] = ["run the same command again to resume"]


def requested() -> int | None:
    """The first stop signal received in this process, or ``None``."""
    return _received[0] if _received else None


def on_stop(callback: Callable[[], None]) -> None:
    """Run ``callback`` (stop a server this process started) when a second signal exits at
    once, and last at a :class:`Preempted` exit. It must be quick and never raise."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def on_first_signal(callback: Callable[[], None]) -> None:
    """Run ``callback`` in the signal handler when the first stop signal arrives, before the
    step, checkpoint and exit handlers that follow it. It must be quick and never raise."""
    if callback not in _first_callbacks:
        _first_callbacks.append(callback)


def _run_callbacks(callbacks: list[Callable[[], None]] = _callbacks) -> None:
    for callback in callbacks:
        with contextlib.suppress(Exception):
            callback()


def _handler(signum: int, frame: object) -> None:
    _received.append(signum)
    if len(_received) > 1:
        # A second signal: no more waiting for a step, a checkpoint or exit handlers.
        _run_callbacks()
        os._exit(128 + signum)
    _run_callbacks(_first_callbacks)
    if _deferring:
        return  # the training loop stops at its next step boundary
    raise stopped(signum, f"stopped by {signal.Signals(signum).name} outside a training step")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _final_line() -> None:
    _run_callbacks()
    if os.environ.get("RANK", "0") != "0":
        return  # several processes of one run: rank 0 says it once
    for line in _final:
        print(line, file=sys.stderr, flush=True)


def stopped(signum: int, message: str) -> Preempted:
    """The :class:`Preempted` to raise; ``message`` plus how to resume becomes the process's
    last line (printed by :func:`install`'s exit handler)."""
    _final[:] = [f"{message}; {_how_to_resume[0]}"]
    return Preempted(signum, message)


def install(how_to_resume: str | None = None) -> None:
    """Handle SIGTERM and SIGINT in this process (from the main thread; once). ``how_to_resume``
    ends the last line printed after a stop (default: run the same command again)."""
    global _installed
    if how_to_resume:
        _how_to_resume[0] = how_to_resume
    if _installed or not _main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    # Registered first, so it runs after every later atexit handler (LIFO): the line is last.
    atexit.register(_final_line)
    _installed = True


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside, a first SIGTERM or SIGINT only sets :func:`requested`; the caller checks it at
    its safe points and raises :class:`Preempted`. Other handlers (Prefect installs one during a
    flow run that raises at once) are set aside meanwhile and restored after. A signal that came
    after the caller's last check raises :class:`Preempted` on the way out."""
    global _deferring
    previous = {}
    if _main_thread():
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, _handler)
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if _received and not _deferring:
        raise stopped(_received[0], f"stopped by {signal.Signals(_received[0]).name} after "
                                    "the training loop")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside :func:`deferred`, a part that changes no training state (rollouts, scoring): there
    a signal raises :class:`Preempted` at once (one received before, on entry), as outside a
    training loop; the caller keeps the state the part started from."""
    global _deferring
    if _received:
        raise stopped(_received[0], f"stopped by {signal.Signals(_received[0]).name}")
    saved, _deferring = _deferring, 0
    try:
        yield
    finally:
        _deferring = saved


def reset() -> None:
    """Forget the signals received (a process that goes on after a :class:`Preempted`, such as
    a test that resumes in the same process)."""
    _received.clear()
    _final.clear()
