"""Requests to an OpenAI-compatible server, retried the same way everywhere.

Connection errors, timeouts, 429 and 5xx answers are retried with exponential back-off (with
jitter, and at least the server's ``Retry-After`` when it sends one), then the call fails with
:class:`BackendError` naming the server and the last error. Other errors (400, 401, ...) fail
at once: retrying cannot fix them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

#: The longest wait between two attempts, in seconds.
MAX_BACKOFF_S = 30.0


class BackendError(RuntimeError):
    """The server could not answer (after retries), or rejected the request."""


def retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError,
                        openai.RateLimitError)):
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


def _retry_after(exc: BaseException) -> float:
    response = getattr(exc, "response", None)
    try:
        return float(response.headers.get("retry-after", 0)) if response is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


async def with_retries(call: Callable[[], Awaitable[T]], server: str, max_retries: int,
                       backoff_s: float, rng: random.Random,
                       stats: MutableMapping[str, Any]) -> T:
    """Await ``call()`` until it answers, at most ``max_retries`` retries; counts
    ``requests`` and ``retries`` in ``stats``."""
    last: BaseException | None = None
    for attempt in range(max_retries + 1):
        if attempt:
            stats["retries"] += 1
            delay = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S) * (0.5 + rng.random())
            await asyncio.sleep(min(max(delay, _retry_after(last)), MAX_BACKOFF_S))
        stats["requests"] += 1
        try:
            return await call()
        except Exception as exc:
            if not retryable(exc):
                raise BackendError(f"{server}: request rejected: {exc}") from exc
            last = exc
    raise BackendError(f"{server}: no answer after {max_retries} retries "
                       f"(last error: {type(last).__name__}: {last})") from last
