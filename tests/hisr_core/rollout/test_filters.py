"""Rollout filtering: unparsable responses, inadmissible actions, the turn limit, loops."""

from __future__ import annotations

import pytest

from hisr_core.agent.models import train_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.envs import make_environment
from hisr_core.rollout.engine import Sampling, play
from hisr_core.rollout.filters import Loop, drop_reason, find_loop
from tests.scripted import ScriptedBackend


def test_find_loop_periods():
    assert find_loop(["a", "b", "c", "d"], 3, 2) is None
    assert find_loop(["x", "a", "a", "a"], 3, 2) == Loop(1, 1, 3)
    assert find_loop(["a", "b", "a", "b", "a", "b", "c"], 3, 2) == Loop(0, 2, 3)
    assert find_loop(["a", "b", "a", "b", "c"], 3, 2) is None
    assert find_loop(["a", "b", "c"] * 3, 3, 2) is None, "period 3 is beyond max_period"
    assert find_loop(["a", "b", "c"] * 3, 3, 3) == Loop(0, 3, 3)
    assert find_loop(["", "", "", ""], 3, 2) is None, "missing actions are not a loop"
    with pytest.raises(ValueError):
        find_loop(["a"], 1, 2)


class Scripted(ScriptedBackend):
    """Each episode answers from a fixed script, chosen by a word of its instruction, one
    response per turn (the last one repeats)."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer)
        self.scripts, self.turn = scripts, {}

    def answer(self, key, prompt):
        k = self.turn.get(key, 0)
        self.turn[key] = k + 1
        text = self.tokenizer.decode(prompt)
        script = next(v for word, v in self.scripts.items() if word in text)
        return script[min(k, len(script) - 1)]


def test_each_failure_is_recorded_and_filtered_as_specified():
    env = make_environment("household", max_turns=6)
    tasks = env.make_tasks("train", 60, 0)
    by_type = {}
    for t in tasks:
        by_type.setdefault(t.task_type, t)
    picked = [by_type["PICK"], by_type["LOOK"], by_type["HEAT"], by_type["COOL"]]
    tokenizer = train_tokenizer([t.instruction for t in tasks] * 3, vocab_size=300)
    builder = PromptBuilder(tokenizer)
    words = [t.instruction for t in picked]
    go = [f"Thought: go.\nAction: go to {r}" for r in
          ("cabinet 1", "drawer 1", "countertop 1", "fridge 1", "microwave 1", "sinkbasin 1")]
    scripts = {
        words[0]: ["I do not know.", "Thought: still unsure.", *go],     # 2 unparsable
        words[1]: ["Thought: try.\nAction: take apple 9 from fridge 1", *go],  # inadmissible once
        words[2]: ["Thought: look.\nAction: look"],                      # the same action x6
        words[3]: go,                                                    # runs out of turns
    }
    rows = play(env, picked, Scripted(tokenizer, scripts), builder, Sampling(), batch_size=4)
    unparsable, inadmissible, looping, limit = rows
    assert [t["parsed"] for t in unparsable["turns"]][:3] == [False, False, True]
    assert not inadmissible["turns"][0]["admissible"] and inadmissible["turns"][0]["parsed"]
    assert inadmissible["turns"][1]["observation"] == "Nothing happens."
    assert all(r["truncated"] and not r["won"] and r["n_turns"] == 6 for r in rows)

    def reason(row, max_unparsed=1):
        return drop_reason(row["turns"], max_unparsed, loop_repeats=3, loop_max_period=2)

    assert reason(unparsable).startswith("unparsable: 2 responses")
    assert reason(unparsable, max_unparsed=2) == ""
    assert reason(inadmissible) == "", "an inadmissible action alone is not a drop"
    assert reason(looping) == "loop: [look] x6 from turn 1"
    assert reason(limit) == "", "running out of turns is a failure to learn from, not a drop"
