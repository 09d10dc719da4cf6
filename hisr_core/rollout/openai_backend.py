"""Generation through an OpenAI-compatible completions server (production: a vLLM server).

Prompts are sent as token ids (``/v1/completions`` accepts a list of ids; vLLM takes them as
they are), so the server sees exactly the tokens the prompt builder made, and the response
comes back as token ids too (vLLM's ``return_tokens_as_token_ids``). Requests run concurrently
up to a bound, each with a timeout; connection errors, timeouts, 429 and 5xx answers are
retried with exponential back-off, then the call fails with :class:`BackendError` naming the
server. The API key is read from the environment variable named in params, never from params.

The entropy recorded per response is computed from the ``top_logprobs`` most likely tokens at
each position (renormalised): exact for peaked distributions, a lower bound otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import random
import threading
from collections.abc import Hashable, Sequence
from typing import Any, Self

from transformers import PreTrainedTokenizerBase

from hisr_core.retry import BackendError, with_retries
from hisr_core.rollout.engine import Generation, Sampling, Streaming, key_seed

__all__ = ["BackendError", "OpenAIGenerator", "entropy_from_top"]


#: Token strings vLLM returns with ``return_tokens_as_token_ids``: ``"token_id:123"``.
_ID_PREFIX = "token_id:"


def entropy_from_top(top: dict[str, float]) -> float:
    """Entropy (nats) of the distribution restricted to the returned top tokens."""
    if not top:
        return 0.0
    m = max(top.values())
    weights = {k: math.exp(v - m) for k, v in top.items()}
    z = sum(weights.values())
    return -sum(w / z * math.log(w / z) for w in weights.values() if w > 0)


class OpenAIGenerator(Streaming):
    """The ``openai`` backend of :class:`~hisr_core.rollout.engine.Generator`: each submitted request
    goes to the server at once (up to ``concurrency`` in flight, the rest wait their turn), and
    the server batches them continuously (vLLM).

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model name (vLLM: the ``--model`` folder or ``--served-model-name``).
        tokenizer: the policy's tokenizer (decodes returned ids).
        stop_ids: token ids that end a response.
        api_key_env: environment variable holding the key (a vLLM server without ``--api-key``
            accepts any; ``"EMPTY"`` is sent when the variable is unset).
        concurrency: most requests in flight at once.
        timeout_s: per-request timeout.
        max_retries: retries of a failed request before :class:`BackendError`.
        backoff_s: first back-off; doubles per retry (with jitter), capped at 30 s.
        top_logprobs: alternatives requested per position, for the entropy.
        seed: base of the per-request sampling seeds (each derived from the request's key and
            its turn, so a response does not depend on which requests were in flight).
    """

    def __init__(self, base_url: str, model: str, tokenizer: PreTrainedTokenizerBase,
                 stop_ids: Sequence[int], api_key_env: str = "OPENAI_API_KEY",
                 concurrency: int = 32, timeout_s: float = 120.0, max_retries: int = 5,
                 backoff_s: float = 0.5, top_logprobs: int = 20, seed: int = 0) -> None:
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("concurrency >= 1, max_retries >= 0 and timeout_s > 0 are required")
        self.base_url, self.model, self.tokenizer = base_url, model, tokenizer
        self.stop_ids = sorted(set(stop_ids))
        self.api_key = os.environ.get(api_key_env) or "EMPTY"
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.top_logprobs = top_logprobs
        self.seed = seed
        self._inflight: dict[concurrent.futures.Future[Generation], Hashable] = {}
        self._turns: dict[Hashable, int] = {}
        #: Requests retried and requests sent, so far.
        self.stats = {"requests": 0, "retries": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="openai-backend")
        self._thread.start()
        self._client, self._gate = self._run(self._make_client())

    async def _make_client(self) -> tuple[Any, asyncio.Semaphore]:
        import openai

        # Retries are ours (counted, and the last error is reported), not the client's.
        return (openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                   timeout=self.timeout_s, max_retries=0),
                asyncio.Semaphore(self.concurrency))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def release(self, key: Hashable) -> None:
        """Forget the key's turn count (the server's prefix cache works without sessions)."""
        self._turns.pop(key, None)

    def close(self) -> None:
        if self._loop.is_running():
            for future in self._inflight:
                future.cancel()
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, key: Hashable, prompt: Sequence[int], sampling: Sampling) -> None:
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        future = asyncio.run_coroutine_threadsafe(
            self._bounded(list(prompt), sampling, key_seed(self.seed, (key, turn))), self._loop)
        self._inflight[future] = key

    def poll(self) -> list[tuple[Hashable, Generation]]:
        """Wait for at least one answer; every answer that is in. A request that failed after
        its retries raises :class:`BackendError` here."""
        if not self._inflight:
            return []
        done, _ = concurrent.futures.wait(self._inflight,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        return [(self._inflight.pop(f), f.result()) for f in done]

    async def _bounded(self, prompt: list[int], sampling: Sampling, seed: int) -> Generation:
        async with self._gate:
            return await self._request(prompt, sampling, seed)

    async def _request(self, prompt: list[int], sampling: Sampling, seed: int) -> Generation:
        seed %= 2**31  # servers take a 32-bit seed
        out = await with_retries(
            lambda: self._client.completions.create(
                model=self.model, prompt=prompt, max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature, top_p=sampling.top_p, seed=seed,
                logprobs=self.top_logprobs,
                extra_body={"stop_token_ids": self.stop_ids, "skip_special_tokens": True,
                            "return_tokens_as_token_ids": True}),
            self.base_url, self.max_retries, self.backoff_s, random.Random(seed), self.stats)
        return self._parse(out)

    def _parse(self, out: Any) -> Generation:
        choice = out.choices[0]
        lp = choice.logprobs
        if lp is None or lp.tokens is None:
            raise BackendError(f"{self.base_url}: the answer has no token logprobs; the server "
                               "must support `logprobs` and `return_tokens_as_token_ids` (vLLM)")
        ids: list[int] = []
        entropies: list[float] = []
        stop = set(self.stop_ids)
        for pos, tok in enumerate(lp.tokens):
            if not tok.startswith(_ID_PREFIX):
                raise BackendError(f"{self.base_url}: token {tok!r} is not an id; the server "
                                   "must support `return_tokens_as_token_ids` (vLLM)")
            tid = int(tok[len(_ID_PREFIX):])
            if tid in stop:
                break
            ids.append(tid)
            tops = lp.top_logprobs[pos] if lp.top_logprobs else None
            entropies.append(entropy_from_top(dict(tops)) if tops else 0.0)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(ids, text, sum(entropies) / len(entropies) if entropies else 0.0)
