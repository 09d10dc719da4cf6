"""The ``llm`` segmenter: an OpenAI-compatible chat server splits each trajectory.

The prompt (:func:`hisr_core.segment.segmenter.llm_messages`) gives the task and the numbered turns and
asks for JSON; the request asks for structured output (a JSON schema) and, if the server
rejects that, plain JSON from then on. An answer that is not JSON or breaks a segment rule is
asked again, at most ``attempts`` times in all; then the trajectory falls back to ``turn``
segmentation. Transport failures (connection, timeout, 429, 5xx) are retried with back-off
(:mod:`hisr_core.retry`) and, when they persist, also fall back. Every count is kept in
:attr:`LLMSegmenter.stats`.

Answers are cached on disk, one JSON file per (model, prompt) hash, so a rerun with the same
trajectories makes no request. Transport failures are not cached (the server may be back).
The API key is read from the environment variable named in params and goes nowhere else.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hisr_core.contracts import write_json
from hisr_core.retry import BackendError, with_retries
from hisr_core.segment.segmenter import (
    ANSWER_SCHEMA,
    Segment,
    SegmentError,
    by_turn,
    llm_messages,
    parse_answer,
)


class LLMSegmenter:
    """Segments trajectories through a chat-completions server.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name the server knows.
        api_key_env: the environment variable holding the key (``"EMPTY"`` when unset: a local
            vLLM server without ``--api-key`` accepts anything).
        cache_dir: where answers are cached.
        concurrency: most requests in flight at once.
        timeout_s: per-request timeout.
        max_retries: transport retries of one request.
        attempts: requests per trajectory while answers are invalid (then: fallback).
        max_tokens: longest answer.
        backoff_s: first back-off; doubles per retry (with jitter).
    """

    def __init__(self, base_url: str, model: str, api_key_env: str, cache_dir: Path,
                 concurrency: int = 8, timeout_s: float = 120.0, max_retries: int = 5,
                 attempts: int = 3, max_tokens: int = 1024, backoff_s: float = 1.0) -> None:
        if concurrency < 1 or attempts < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("concurrency >= 1, attempts >= 1, max_retries >= 0 and "
                             "timeout_s > 0 are required")
        self.base_url, self.model, self.api_key_env = base_url, model, api_key_env
        self.cache_dir = Path(cache_dir)
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.max_retries, self.attempts = max_retries, attempts
        self.max_tokens, self.backoff_s = max_tokens, backoff_s
        self.structured = True
        #: requests sent, transport retries, invalid answers, trajectories that fell back
        #: (``fallbacks``, of which ``transport_failures``), answers taken from the cache.
        self.stats = {"requests": 0, "retries": 0, "invalid_answers": 0, "fallbacks": 0,
                      "transport_failures": 0, "cache_hits": 0}

    def key(self, messages: Sequence[Mapping[str, str]]) -> str:
        blob = json.dumps({"model": self.model, "messages": list(messages)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def segment_all(self, trajectories: Sequence[Mapping[str, Any]],
                    on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Per trajectory (a row with ``instruction``, ``turns``, ``outcome``):
        ``{"segments": [Segment], "fallback": bool, "reason": str}``, in input order."""
        return asyncio.run(self._all(trajectories, on_done))

    async def _all(self, trajectories: Sequence[Mapping[str, Any]],
                   on_done: Callable[[], None] | None) -> list[dict[str, Any]]:
        import openai

        gate = asyncio.Semaphore(self.concurrency)
        key = os.environ.get(self.api_key_env) or "EMPTY"
        async with openai.AsyncOpenAI(base_url=self.base_url, api_key=key,
                                      timeout=self.timeout_s, max_retries=0) as client:

            async def one(i: int, row: Mapping[str, Any]) -> dict[str, Any]:
                async with gate:
                    out = await self._one(client, row, random.Random(i))
                if on_done is not None:
                    on_done()
                return out

            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(trajectories))))

    async def _one(self, client: Any, row: Mapping[str, Any],
                   rng: random.Random) -> dict[str, Any]:
        turns = row["turns"]
        messages = llm_messages(row["instruction"], turns, row.get("outcome"))
        path = self.cache_dir / (self.key(messages) + ".json")
        if path.is_file():
            self.stats["cache_hits"] += 1
            cached = json.loads(path.read_text(encoding="utf-8"))
            return {"segments": [Segment.from_row(s) for s in cached["segments"]],
                    "fallback": cached["fallback"], "reason": cached["reason"]}
        reason, fallback = "", False
        for _ in range(self.attempts):
            try:
                text = await self._ask(client, messages, rng)
            except BackendError as exc:
                self.stats["transport_failures"] += 1
                self.stats["fallbacks"] += 1
                return {"segments": by_turn([t["action"] for t in turns]), "fallback": True,
                        "reason": f"server: {exc}"}
            try:
                segments = parse_answer(text, len(turns))
                break
            except SegmentError as exc:
                self.stats["invalid_answers"] += 1
                reason = f"invalid answer: {exc}"
        else:
            self.stats["fallbacks"] += 1
            segments, fallback = by_turn([t["action"] for t in turns]), True
        result = {"segments": segments, "fallback": fallback, "reason": reason if fallback else ""}
        write_json({**result, "segments": [s.to_row() for s in segments]}, path)
        return result

    async def _ask(self, client: Any, messages: list[dict[str, str]],
                   rng: random.Random) -> str:
        """The answer text; structured output while the server takes it."""
        import openai

        async def call(structured: bool) -> Any:
            extra = ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "segments", "schema": ANSWER_SCHEMA, "strict": True}}}
                if structured else {})
            return await client.chat.completions.create(
                model=self.model, messages=messages, temperature=0.0,
                max_tokens=self.max_tokens, **extra)

        structured = self.structured
        try:
            out = await with_retries(lambda: call(structured), self.base_url, self.max_retries,
                                     self.backoff_s, rng, self.stats)
        except BackendError as exc:
            rejected = isinstance(exc.__cause__, openai.BadRequestError)
            if not (structured and rejected):
                raise
            self.structured = False  # the server has no structured output: plain JSON
            out = await with_retries(lambda: call(False), self.base_url, self.max_retries,
                                     self.backoff_s, rng, self.stats)
        return out.choices[0].message.content or ""
