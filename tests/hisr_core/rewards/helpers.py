"""Small builders the reward tests share."""

from __future__ import annotations

import torch

from hisr_core.segment.segmenter import Segment


def spans(*lengths: int) -> list[Segment]:
    """Consecutive segments of the given numbers of turns, from turn 0."""
    out, start = [], 0
    for n in lengths:
        out.append(Segment(start, start + n - 1, "g"))
        start += n
    return out


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)
