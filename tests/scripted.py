"""A scripted policy behind the generation protocol, for tests of the episode loop.

A test double, not a model: the tests that use it check how :func:`hisr_core.rollout.engine.play`
records, steps and filters episodes for given responses, which a real model cannot be made to
produce on demand. Every request submitted is answered on the next :meth:`poll`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hisr_core.rollout.engine import Generation, Sampling


class ScriptedBackend:
    """Subclasses define :meth:`answer` (the response text for a key's prompt)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pending: list[tuple[Hashable, list[int]]] = []
        self.polls: list[int] = []      # requests answered by each poll
        self.released: list[Hashable] = []
        self.stats: dict[str, int] = {}

    def answer(self, key: Hashable, prompt: list[int]) -> str:
        raise NotImplementedError

    def submit(self, key: Hashable, prompt: Sequence[int], sampling: Sampling) -> None:
        assert all(k != key for k, _ in self.pending), f"{key} already in flight"
        self.pending.append((key, list(prompt)))

    def poll(self) -> list[tuple[Hashable, Generation]]:
        batch, self.pending = self.pending, []
        self.polls.append(len(batch))
        out = []
        for key, prompt in batch:
            text = self.answer(key, prompt)
            out.append((key, Generation(self.tokenizer(text)["input_ids"], text, 0.5)))
        return out

    def release(self, key: Hashable) -> None:
        self.released.append(key)
