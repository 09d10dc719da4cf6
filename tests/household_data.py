"""Household rollout rows for the tests of the stages after collection (no policy needed):
expert episodes with slips, every third one cut short and counted a failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hisr_core import contracts
from hisr_core.envs import Environment, Task, environment_class, make_environment
from hisr_core.segment.segmenter import by_rule


def rollout_rows(n: int = 6, split: str = "train", seed: int = 0, fail_every: int = 3,
                 cut: int = 2, slip_rate: float = 0.1) -> list[dict[str, Any]]:
    """``n`` rows of the ``rollouts`` contract; row i fails when ``(i + i // 6) % fail_every
    == 0`` (task types cycle in 6, so failures shift across them; its last ``cut`` turns
    removed, outcome 0), the others succeed (outcome 1)."""
    env = make_environment("household", max_turns=40)
    rows = []
    for i, t in enumerate(env.make_tasks(split, n, seed)):
        ep = env.expert_play(t, slip_rate)
        distances = replayed_distances(env, t, [x.action for x in ep.turns])
        turns = [{"observation": x.observation, "response": x.response, "action": x.action,
                  "admissible": x.admissible, "parsed": True, "prompt_tokens": 100 + k,
                  "response_tokens": 12, "entropy": 0.3 + 0.4 * (k % 3),
                  "distance_before": distances[k], "distance_after": distances[k + 1]}
                 for k, x in enumerate(ep.turns)]
        won = (i + i // 6) % fail_every != 0
        turns = turns if won else turns[:-cut]
        row = {**t.to_row(), "sample": 0, "policy": "pi_ref", "turns": turns,
               "n_turns": len(turns), "won": won, "score": float(won), "truncated": not won,
               "final_observation": ep.final_observation if won else turns[-1]["observation"],
               "outcome": float(won), "drop_reason": ""}
        del row["seed"], row["spec"]
        rows.append(row)
    return rows


def replayed_distances(env: Environment, task: Task, actions: list[str]) -> list[int]:
    """The oracle distance to the goal after reset and after each of ``actions``."""
    ep = env.start(task)
    ep.reset()
    return [ep.distance_to_goal()] + [ep.step(a).distance for a in actions]


def segmented_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with rule segments, as the ``segment`` stage writes them (``D_st``)."""
    verbs = environment_class("household").state_changing_verbs
    keep = [f.name for f in contracts.schema("segmented")]
    return [{**{k: r[k] for k in keep if k in r}, "segmenter": "rule",
             "segments": [s.to_row() for s in by_rule([t["action"] for t in r["turns"]], verbs)],
             "fallback": False, "fallback_reason": ""} for r in rows]


def write_d_ct(data: Path, n: int = 6) -> list[dict[str, Any]]:
    rows = rollout_rows(n)
    contracts.write_rows(rows, data / "collect" / "d_ct.parquet", "rollouts")
    return rows
