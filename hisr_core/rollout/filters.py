"""Filtering of collected rollouts (docs/method.md, stage 2).

A trajectory is dropped when it fails instruction following (more responses without a
parsable action than a tolerance) or repeats itself (the same action, or the same short cycle
of actions, issued over and over in a row). Every drop keeps its reason; episodes that merely
run out of turns are kept (they are failures RL learns from) unless they also loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Loop:
    """``period`` actions starting at turn ``start`` (0-based), repeated ``repeats`` times."""

    start: int
    period: int
    repeats: int


def find_loop(actions: Sequence[str], min_repeats: int, max_period: int) -> Loop | None:
    """The first block of at most ``max_period`` actions repeated ``min_repeats`` or more times
    back to back (``a a a`` is period 1, ``a b a b a b`` period 2), or None.

    Shape: ``actions`` has one entry per turn (``""`` for a response without an action, which
    never counts as a repetition: that is the unparsable filter's business).
    """
    if min_repeats < 2 or max_period < 1:
        raise ValueError("min_repeats >= 2 and max_period >= 1 are required")
    n = len(actions)
    for start in range(n):
        for period in range(1, max_period + 1):
            block = list(actions[start:start + period])
            if len(block) < period or "" in block or (period > 1 and len(set(block)) == 1):
                continue  # a period-1 loop is found with period 1
            repeats = 1
            while list(actions[start + repeats * period:start + (repeats + 1) * period]) == block:
                repeats += 1
            if repeats >= min_repeats:
                return Loop(start, period, repeats)
    return None


def drop_reason(turns: Sequence[Mapping[str, Any]], max_unparsed: int, loop_repeats: int,
                loop_max_period: int) -> str:
    """Why an episode is dropped, or ``""`` to keep it.

    ``turns`` are the episode's turn records (``parsed``, ``action``); ``max_unparsed`` is the
    tolerated number of responses without a parsable action.
    """
    unparsed = sum(not t["parsed"] for t in turns)
    if unparsed > max_unparsed:
        return (f"unparsable: {unparsed} responses without a parsable action "
                f"(tolerance {max_unparsed})")
    loop = find_loop([t["action"] if t["parsed"] else "" for t in turns], loop_repeats,
                     loop_max_period)
    if loop is not None:
        block = " | ".join(t["action"] for t in turns[loop.start:loop.start + loop.period])
        return f"loop: [{block}] x{loop.repeats} from turn {loop.start + 1}"
    return ""
