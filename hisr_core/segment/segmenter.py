"""Segmentation of a trajectory into sub-goal segments (docs/method.md, stage 3).

A segment is a contiguous, non-empty run of turns serving one sub-goal; a trajectory's segments
are in order and cover every turn exactly once. Turns are indexed from 0 here (``first`` and
``last`` are inclusive indices into the episode's ``turns``); the LLM sees and answers turn
numbers from 1, as the method writes them.

Segmenters (all pure functions of a trajectory, except ``llm`` which asks a server, see
:mod:`hisr_core.segment.llm`): ``turn``, ``rule``, ``entropy``. Every result goes through
:func:`validate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Longest sub-goal text accepted (a short phrase, not a paragraph).
MAX_SUBGOAL_CHARS = 200


class SegmentError(ValueError):
    """Segments that break the rules (the message says which rule and where)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Turns ``first..last`` (0-based, inclusive) serving ``subgoal``."""

    first: int
    last: int
    subgoal: str

    @property
    def turns(self) -> int:
        return self.last - self.first + 1

    def to_row(self) -> dict[str, Any]:
        return {"first_turn": self.first, "last_turn": self.last, "subgoal": self.subgoal}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Segment:
        return cls(int(row["first_turn"]), int(row["last_turn"]), str(row["subgoal"]))


def check_cover(segments: Sequence[Segment], n_turns: int) -> None:
    """Raise :class:`~hisr_core.segment.segmenter.SegmentError` (a ``ValueError``) unless
    ``segments`` are non-empty, in order, and cover turns ``0..n_turns-1`` exactly once; the
    message names the problem (turns numbered from 1). Sub-goal texts are not checked."""
    if n_turns < 1:
        raise SegmentError("the trajectory has no turns")
    if not segments:
        raise SegmentError(f"no segments for {n_turns} turns")
    for i, s in enumerate(segments, 1):
        if s.first > s.last:
            raise SegmentError(f"segment {i} is empty (turns {s.first + 1}-{s.last + 1})")
        if s.first < 0 or s.last >= n_turns:
            raise SegmentError(f"segment {i} (turns {s.first + 1}-{s.last + 1}) is out of "
                               f"range: the trajectory has turns 1-{n_turns}")
    for i in range(1, len(segments)):
        a, b = segments[i - 1], segments[i]
        if b.first < a.first:
            raise SegmentError(f"segment {i + 1} (from turn {b.first + 1}) is out of order: it "
                               f"starts before segment {i} (turn {a.first + 1})")
        if b.first <= a.last:
            raise SegmentError(f"segments {i} and {i + 1} overlap at turns "
                               f"{b.first + 1}-{min(a.last, b.last) + 1}")
        if b.first > a.last + 1:
            raise SegmentError(f"turns {a.last + 2}-{b.first} are in no segment "
                               f"(gap between segments {i} and {i + 1})")
    if segments[0].first != 0:
        raise SegmentError(f"turns 1-{segments[0].first} are in no segment (gap at the start)")
    if segments[-1].last != n_turns - 1:
        raise SegmentError(f"turns {segments[-1].last + 2}-{n_turns} are in no segment "
                           "(gap at the end)")


def validate(segments: Sequence[Segment], n_turns: int) -> None:
    """Raise :class:`SegmentError` unless ``segments`` cover the turns (:func:`check_cover`),
    each with a short sub-goal text."""
    check_cover(segments, n_turns)
    for i, s in enumerate(segments, 1):
        if not s.subgoal.strip():
            raise SegmentError(f"segment {i} has no sub-goal text")
        if len(s.subgoal) > MAX_SUBGOAL_CHARS:
            raise SegmentError(f"segment {i}'s sub-goal is {len(s.subgoal)} characters "
                               f"(at most {MAX_SUBGOAL_CHARS})")


def _split(actions: Sequence[str], starts: Sequence[int]) -> list[Segment]:
    """Segments starting at ``starts`` (sorted, first 0); each named by its last action."""
    ends = [*starts[1:], len(actions)]
    return [Segment(a, b - 1, _name(actions[b - 1])) for a, b in zip(starts, ends, strict=True)]


def _name(action: str) -> str:
    return (action.strip() or "(no action)")[:MAX_SUBGOAL_CHARS]


def by_turn(actions: Sequence[str]) -> list[Segment]:
    """``turn``: every turn its own segment (the "w/o SPR" ablation)."""
    return _split(actions, range(len(actions)))


def by_rule(actions: Sequence[str], verbs: Sequence[str]) -> list[Segment]:
    """``rule``: a boundary after every turn whose action starts with a state-changing verb
    (``take``, ``put``, ``open``, ...: the environment's ``state_changing_verbs``)."""
    verbs = {v.lower() for v in verbs}
    starts = [0]
    for k, action in enumerate(actions[:-1]):
        words = action.split()
        if words and words[0].lower() in verbs:
            starts.append(k + 1)
    return _split(actions, starts)


def by_entropy(actions: Sequence[str], entropy: Sequence[float], threshold: float,
               min_turns: int) -> list[Segment]:
    """``entropy``: a boundary before turn k when the response entropy jumps up, i.e.
    ``entropy[k] - entropy[k-1] > threshold * std(entropy)`` (the policy grows unsure: a new
    sub-goal begins), unless the running segment is shorter than ``min_turns``.

    Shape: ``actions`` and ``entropy`` have one entry per turn (mean token entropy, nats)."""
    if len(entropy) != len(actions):
        raise ValueError(f"{len(entropy)} entropies for {len(actions)} turns")
    if threshold < 0 or min_turns < 1:
        raise ValueError("threshold >= 0 and min_turns >= 1 are required")
    n = len(entropy)
    mean = sum(entropy) / n if n else 0.0
    std = math.sqrt(sum((e - mean) ** 2 for e in entropy) / n) if n else 0.0
    starts = [0]
    for k in range(1, n):
        if k - starts[-1] >= min_turns and std > 0 and \
                entropy[k] - entropy[k - 1] > threshold * std:
            starts.append(k)
    return _split(actions, starts)


OFFLINE = ("rule", "entropy", "turn")


def segment_offline(segmenter: str, turns: Sequence[Mapping[str, Any]], verbs: Sequence[str],
                    entropy_threshold: float, entropy_min_turns: int) -> list[Segment]:
    """The segments of one trajectory (``turns``: rows with ``action`` and, for ``entropy``,
    ``entropy``) by an offline segmenter; the caller validates them (:func:`validate`), as it
    does every segmenter's."""
    actions = [t["action"] for t in turns]
    if segmenter == "rule":
        segments = by_rule(actions, verbs)
    elif segmenter == "entropy":
        segments = by_entropy(actions, [float(t["entropy"]) for t in turns], entropy_threshold,
                              entropy_min_turns)
    elif segmenter == "turn":
        segments = by_turn(actions)
    else:
        raise ValueError(f"unknown offline segmenter {segmenter!r}; expected one of {OFFLINE}")
    return segments


# -- the llm segmenter's prompt and answer (the client is in hisr_core.segment.llm) -----------

SYSTEM_PROMPT = (
    "You analyse the trajectory of an agent acting in a text environment. Split it into "
    "sub-goal segments: each segment is a run of consecutive turns that serves one sub-goal "
    "(for example: find the mug, take it, heat it, put it in place). Segments are in order, "
    "cover every turn exactly once, and most span two or more turns. Answer with JSON only: "
    '{"segments": [{"subgoal": "<a short phrase>", "start_turn": <int>, "end_turn": <int>}]}, '
    "turns numbered from 1, start_turn and end_turn inclusive."
)

#: JSON schema of the answer, for servers with structured output.
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"segments": {"type": "array", "items": {
        "type": "object",
        "properties": {"subgoal": {"type": "string"}, "start_turn": {"type": "integer"},
                       "end_turn": {"type": "integer"}},
        "required": ["subgoal", "start_turn", "end_turn"], "additionalProperties": False}}},
    "required": ["segments"], "additionalProperties": False,
}


def llm_messages(instruction: str, turns: Sequence[Mapping[str, Any]],
                 outcome: float | None = None) -> list[dict[str, str]]:
    """Chat messages asking for the segments of one trajectory (numbered turns, each the
    observation and the agent's response)."""
    lines = [f"Task: {instruction}"]
    if outcome is not None:
        lines.append(f"Outcome: {'success' if outcome >= 1 else f'failure (score {outcome:g})'}")
    for k, t in enumerate(turns, 1):
        lines.append(f"\nTurn {k}\nObservation: {t['observation']}\nAgent: {t['response']}")
    lines.append(f"\nThe trajectory has {len(turns)} turns. Give its segments as JSON.")
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "\n".join(lines)}]


def parse_answer(text: str, n_turns: int) -> list[Segment]:
    """The validated segments of an LLM answer: ``{"segments": [...]}`` or a bare list of
    ``{"subgoal", "start_turn", "end_turn"}`` (turns from 1); raise :class:`SegmentError`
    saying what is wrong (not JSON, wrong shape, or a rule :func:`validate` enforces)."""
    body = text.strip()
    if body.startswith("```"):  # a fenced block: ```json ... ```
        body = body.strip("`").removeprefix("json").strip()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise SegmentError(f"the answer is not JSON ({exc.msg} at character {exc.pos})") from None
    items = data.get("segments") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise SegmentError('the answer has no list of segments (expected {"segments": [...]})')
    segments = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise SegmentError(f"segment {i} is not an object")
        start, end, goal = item.get("start_turn"), item.get("end_turn"), item.get("subgoal")
        if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool):
            raise SegmentError(f"segment {i} lacks integer start_turn / end_turn")
        if not isinstance(goal, str):
            raise SegmentError(f"segment {i} lacks a subgoal string")
        segments.append(Segment(start - 1, end - 1, goal.strip()))
    validate(segments, n_turns)
    return segments
