"""Tests of the ``virtualhome`` environment: goal extraction, splits, episode rules, expert.

Goal extraction is pure and runs everywhere; the rest plays the bundled programs on the
evolving-graph simulator and is skipped when ``virtualhome-eval`` is not installed.
"""

from __future__ import annotations

import collections
import functools
import json
import sys

import pytest

from hisr_core.envs import NOTHING_HAPPENS, Task, environment_class, make_environment, registered
from hisr_core.envs import virtualhome as vh

SPLITS = ("train", "valid_seen", "valid_unseen")
MAX_TURNS = 60  # the longest program has 54 lines


def _sim() -> None:
    pytest.importorskip("virtualhome_eval", reason="needs the virtualhome extra")


@functools.cache
def _env():
    return make_environment("virtualhome", max_turns=MAX_TURNS)


@functools.cache
def _tasks(split: str) -> tuple[Task, ...]:
    return tuple(_env().make_tasks(split, 10_000, 0))


def _task(program: str) -> Task:
    return next(t for s in SPLITS for t in _tasks(s) if t.task_id.endswith(f"/{program}"))


# ---- goal extraction on a hand-built graph pair ------------------------------------------


def _node(i: int, cls: str, states: list[str], category: str = "Furniture") -> dict:
    return {"id": i, "class_name": cls, "category": category, "properties": [],
            "states": states}


def _edge(a: int, rel: str, b: int) -> dict:
    return {"from_id": a, "relation_type": rel, "to_id": b}


def test_goal_conditions_on_a_hand_built_pair():
    # Before: the agent (1) stands in the kitchen (2) next to a closed fridge (3) holding a cup
    # (4) in its right hand; the TV (5) is off. After: the fridge is open, the cup is inside
    # it, the agent holds an apple (6) in its left hand, the TV is on and faces the agent.
    init = {
        "nodes": [_node(1, "character", [], "Characters"), _node(2, "kitchen", [], "Rooms"),
                  _node(3, "fridge", ["CLOSED"]), _node(4, "cup", []),
                  _node(5, "tv", ["OFF"]), _node(6, "apple", [])],
        "edges": [_edge(1, "INSIDE", 2), _edge(1, "HOLDS_RH", 4), _edge(1, "CLOSE", 3),
                  _edge(6, "ON", 3)],
    }
    final = {
        "nodes": [_node(1, "character", [], "Characters"), _node(2, "kitchen", [], "Rooms"),
                  _node(3, "fridge", ["OPEN"]), _node(4, "cup", []),
                  _node(5, "tv", ["ON"]), _node(6, "apple", [])],
        "edges": [_edge(1, "INSIDE", 2), _edge(4, "INSIDE", 3), _edge(1, "HOLDS_LH", 6),
                  _edge(1, "CLOSE", 5), _edge(1, "FACING", 5), _edge(5, "BETWEEN", 2)],
    }
    # New states: fridge OPEN, tv ON (CLOSED and OFF are gone: only additions count).
    # New relations: cup INSIDE fridge, agent HOLDS apple (hand merged), agent FACING tv.
    # Not goals: CLOSE (proximity), BETWEEN, and INSIDE kitchen (already true before).
    assert vh.goal_conditions(init, final) == [
        ("state", 3, "OPEN", -1), ("state", 5, "ON", -1),
        ("edge", 1, "FACING", 5), ("edge", 1, "HOLDS", 6), ("edge", 4, "INSIDE", 3),
    ]
    # A cup moved from the right hand to the left is no new goal: hands are one relation.
    moved = {**init, "edges": [*init["edges"][:1], _edge(1, "HOLDS_LH", 4)]}
    assert vh.goal_conditions(init, moved) == []
    assert vh.goal_conditions(init, init) == []


def test_conditions_met_counts_each_condition():
    goal = [("state", 3, "OPEN", -1), ("edge", 4, "INSIDE", 3), ("edge", 1, "HOLDS", 6)]
    states = {3: {"OPEN"}}.get
    edges = {(4, "INSIDE", 3)}
    met = vh.conditions_met(goal, lambda i: states(i, set()), lambda a, r, b: (a, r, b) in edges)
    assert met == [True, True, False]


def test_program_lines_and_names():
    assert vh.parse_program_line("[PUTBACK] <cup> (1.1000) <table> (1.231)") == (
        "PUTBACK", (1000, 231))
    assert vh.parse_program_line("[STANDUP]") == ("STANDUP", ())
    with pytest.raises(ValueError, match="not a program line"):
        vh.parse_program_line("walk to the kitchen")
    nodes = [_node(9, "kitchen_counter", []), _node(3, "kitchen_counter", []),
             _node(2, "bedroom", [], "Rooms"), _node(7, "wall", [], "Walls"),
             _node(1, "character", [], "Characters")]
    assert vh.node_names(nodes) == {3: "kitchen counter 1", 9: "kitchen counter 2",
                                    2: "bedroom"}
    assert vh.task_type_of("Put groceries in Fridge") == "PUT_GROCERIES_IN_FRIDGE"
    assert len(set(vh.TASK_TYPES)) == len(vh.ACTIVITIES) == 26


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "virtualhome_eval", None)  # import now fails
    with pytest.raises(ValueError, match=r"virtualhome extra \(EXTRAS=virtualhome make install"):
        make_environment("virtualhome", max_turns=5)


def test_registered_with_a_grammar_and_verbs():
    assert "virtualhome" in registered()
    cls = environment_class("virtualhome")
    assert cls.splits == SPLITS
    assert "walk to {obj}" in cls.command_grammar and "put {obj} on {obj}" in cls.command_grammar
    assert {"grab", "put", "open", "switch"} <= set(cls.state_changing_verbs)
    assert "walk" not in cls.state_changing_verbs


# ---- tasks and splits ------------------------------------------------------------------------


def test_splits_partition_the_programs_and_hold_out_activities():
    _sim()
    tasks = {s: _tasks(s) for s in SPLITS}
    assert {s: len(t) for s, t in tasks.items()} == {"train": 361, "valid_seen": 62,
                                                     "valid_unseen": 80}
    ids = [t.task_id.rsplit("/", 1)[1] for s in SPLITS for t in tasks[s]]
    assert len(ids) == len(set(ids)) == 503  # 518 programs, 15 with an empty goal
    unseen = {vh.task_type_of(a) for a in vh.UNSEEN_ACTIVITIES}
    assert {t.task_type for t in tasks["valid_unseen"]} == unseen
    assert not unseen & {t.task_type for t in tasks["train"] + tasks["valid_seen"]}
    assert {t.task_type for t in tasks["valid_seen"]} <= {t.task_type for t in tasks["train"]}
    for t in tasks["train"][:5]:
        spec = json.loads(t.spec)
        assert spec["goal"] and spec["scene"] == vh.SCENE
        assert t.instruction.startswith(spec["activity"] + ".")


def test_make_tasks_is_deterministic_and_limited():
    _sim()
    env = _env()
    a, b = env.make_tasks("train", 20, 3), env.make_tasks("train", 20, 3)
    assert a == b and len(a) == 20
    assert [t.task_id for t in env.make_tasks("train", 20, 4)] != [t.task_id for t in a]
    assert {t.task_id for t in env.make_tasks("train", 10_000, 4)} == {
        t.task_id for t in _tasks("train")}
    with pytest.raises(ValueError, match="no split"):
        env.make_tasks("test", 1, 0)


def test_bad_options_and_tasks_are_errors():
    _sim()
    with pytest.raises(ValueError, match="unknown option.*virtualhome.*show_admisible"):
        make_environment("virtualhome", max_turns=5, show_admisible=True)
    with pytest.raises(TypeError, match="show_admissible"):
        make_environment("virtualhome", max_turns=5, show_admissible="yes")
    with pytest.raises(ValueError, match="cannot slip"):
        _env().expert_play(_tasks("train")[0], slip_rate=0.1)
    household = make_environment("household", max_turns=5).make_tasks("train", 1, 0)[0]
    with pytest.raises(ValueError, match="belongs to environment 'household'"):
        _env().start(household)


# ---- the expert: programs replayed through the environment ----------------------------------


def _sample_50() -> list[Task]:
    every = [t for s in SPLITS for t in _tasks(s)]
    every.sort(key=lambda t: t.task_id.rsplit("/", 1)[1])
    return every[:: len(every) // 50][:50]


def test_fifty_programs_replay_to_success():
    _sim()
    sample = _sample_50()
    assert len(sample) == 50 and len({t.task_type for t in sample}) >= 15
    for task in sample:
        ep = _env().expert_play(task)
        lines = vh.read_program(vh.SCENE, json.loads(task.spec)["program"]).lines
        assert ep.won and ep.score == 1.0, task.task_id
        assert all(t.admissible for t in ep.turns), task.task_id
        assert 1 <= len(ep.turns) <= len(lines)
        assert ep.final_observation != NOTHING_HAPPENS
        for t in ep.turns:
            assert t.response.endswith(f"\nAction: {t.action}")


def test_expert_is_deterministic():
    _sim()
    task = _task("1003_2")
    assert _env().expert_play(task) == _env().expert_play(task)


def test_score_is_the_fraction_of_goal_conditions():
    _sim()
    task = _task("1004_2")  # put groceries in the fridge: freezer open, food inside it
    ep = _env().start(task)
    ep.reset()
    n = len(ep.goal)
    scores = []
    for turn in _env().expert_play(task).turns:
        res = ep.step(turn.action)
        scores.append(res.score)
        assert res.score == sum(ep.conditions()) / n or res.won
    assert scores[-1] == 1.0 and ep.won and ep.done
    assert all(s in {k / n for k in range(n + 1)} for s in scores)


def test_distance_counts_unmet_conditions_down_to_zero_on_replay():
    _sim()
    task = _task("1004_2")  # walk, find and grab the food, open the freezer, put it inside
    ep = _env().start(task)
    ep.reset()
    distances = [ep.distance_to_goal()]
    for turn in _env().expert_play(task).turns:
        distances.append(ep.step(turn.action).distance)
        assert distances[-1] == len(ep.goal) - sum(ep.conditions())
    assert distances == [3, 2, 2, 2, 2, 1, 0] and ep.won


def test_undoing_a_met_condition_raises_the_distance():
    _sim()
    task = _task("1004_2")
    ep = _env().start(task)
    ep.reset()
    turns = _env().expert_play(task).turns
    for turn in turns[:-1]:
        ep.step(turn.action)
    assert turns[-2].action == "open freezer 1" and ep.distance_to_goal() == 1
    res = ep.step("close freezer 1")
    assert res.admissible and res.distance == 2
    assert ep.step("open freezer 1").distance == 1
    assert ep.step(turns[-1].action).distance == 0 and ep.won


# ---- episode rules --------------------------------------------------------------------------


def test_inadmissible_commands_are_flagged_and_change_nothing():
    _sim()
    ep = _env().start(_task("1003_2"))
    first = ep.reset()
    assert first.startswith("You are in the ") and "Your task is to: " in first
    for bad in ("fly to the moon", "grab unicorn 1", "walk to", "grab cup 99",
                "put cup 1 on table 1",  # not held
                "switch on walking",
                "walk to wall 1"):  # scenery has no name
        before = ep.conditions()
        res = ep.step(bad)
        assert res.observation == NOTHING_HAPPENS and not res.admissible, bad
        assert not res.won and ep.conditions() == before
    assert ep.turns == 7
    # The simulator refuses what its preconditions forbid: grabbing something far away.
    far = next(n for n in ep.names.values() if n.startswith("cup "))
    res = ep.step(f"grab {far}")
    assert not res.admissible and res.observation == NOTHING_HAPPENS
    res = ep.step(f"walk to {far}")
    assert res.admissible and res.observation.startswith(f"You walk to the {far}.")
    res = ep.step(f"  GRAB   {far} ")  # case and spacing do not matter
    assert res.admissible and f"You hold {far}." in res.observation


def test_admissible_list_matches_step():
    _sim()
    task = _task("1004_2")
    expert = _env().expert_play(task)
    ep = _env().start(task)
    ep.reset()
    for turn in expert.turns[:2]:
        ep.step(turn.action)
    adm = ep.admissible_commands()
    assert expert.turns[2].action in adm
    assert len(adm) == len(set(adm)) and any(a.startswith("walk to ") for a in adm)
    # Every listed non-movement command steps admissibly from this state; a few unlisted
    # commands do not.
    prefix = [t.action for t in expert.turns[:2]]
    listed = [a for a in adm if not a.startswith(("walk to", "run to", "find", "turn to"))]
    names = sorted(ep.names.values())
    unlisted = [c for c in (f"grab {n}" for n in names) if c not in adm][:5]
    assert listed and unlisted
    for cmd in [*listed[:8], *unlisted]:
        replay = _env().start(task)
        replay.reset()
        for a in prefix:
            assert replay.step(a).admissible
        assert replay.step(cmd).admissible == (cmd in adm), cmd


def test_closed_containers_hide_their_contents():
    _sim()
    task = _task("1004_2")
    ep = _env().start(task)
    ep.reset()
    fridge = next(n for n in ep.names.values() if n.startswith("freezer "))
    res = ep.step(f"walk to {fridge}")
    assert res.observation == f"You walk to the {fridge}. It is closed."
    res = ep.step(f"open {fridge}")
    assert res.admissible and res.observation.startswith(f"You open the {fridge}.")


def test_show_admissible_lists_commands():
    _sim()
    env = make_environment("virtualhome", max_turns=5, show_admissible=True)
    ep = env.start(_tasks("valid_seen")[0])
    obs = ep.reset()
    listed = obs.split("\nAdmissible actions: ", 1)[1].split(", ")
    assert listed == ep.admissible_commands()


def test_turn_limit_ends_the_episode():
    _sim()
    env = make_environment("virtualhome", max_turns=2)
    ep = env.start(_tasks("train")[0])
    ep.reset()
    assert not ep.step("look around").done
    res = ep.step("look around")
    assert res.done and not res.won and res.score < 1.0
    with pytest.raises(RuntimeError, match="done"):
        ep.step("look around")


def test_task_types_cover_every_activity_in_report_order():
    _sim()
    counts = collections.Counter(t.task_type for s in SPLITS for t in _tasks(s))
    assert set(counts) == set(vh.TASK_TYPES)


def test_rule_segmenter_cuts_after_state_changes():
    _sim()
    from hisr_core.segment.segmenter import by_rule, validate

    verbs = environment_class("virtualhome").state_changing_verbs
    actions = [t.action for t in _env().expert_play(_task("1004_2")).turns]
    segments = by_rule(actions, verbs)
    validate(segments, len(actions))
    for s in segments[:-1]:  # every segment but the last ends with a state change
        assert actions[s.last].split()[0] in verbs
        assert not any(a.split()[0] in verbs for a in actions[s.first:s.last])
    assert 1 < len(segments) < len(actions)
