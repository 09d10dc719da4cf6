"""Tests of the built-in household environment: generator, episode rules, expert."""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hisr_core.envs import NOTHING_HAPPENS, UNKNOWN_DISTANCE, Task, make_environment, registered
from hisr_core.envs import household as hh

SPLITS = ("train", "valid_seen", "valid_unseen")
N = 500
MAX_TURNS = 40


@functools.cache
def _env():
    return make_environment("household", max_turns=MAX_TURNS)


@functools.cache
def _tasks(split: str, n: int = N, seed: int = 0) -> tuple[Task, ...]:
    return tuple(_env().make_tasks(split, n, seed))


@functools.cache
def _experts(split: str):
    return tuple(_env().expert_play(t) for t in _tasks(split))


# ---- a tiny hand-built room ---------------------------------------------------------------


def _tiny_task(goal_type: str = "PICK", obj: str = "apple", target: str = "countertop",
               instruction: str = "put a apple in countertop") -> Task:
    spec = {
        "goal": {"object": obj, "target": target, "type": goal_type},
        "instruction": instruction,
        "objects": [
            {"in": "fridge 1", "name": "apple 1"},
            {"in": "cabinet 1", "name": "mug 1"},
            {"in": "desk 1", "name": "desklamp 1"},
            {"in": "desk 1", "name": "book 1"},
            {"in": "countertop 1", "name": "knife 1"},
            {"in": "countertop 1", "name": "apple 2"},
        ],
        "receptacles": [
            {"closed": True, "name": "cabinet 1", "openable": True},
            {"closed": False, "name": "countertop 1", "openable": False},
            {"closed": False, "name": "desk 1", "openable": False},
            {"closed": True, "name": "fridge 1", "openable": True},
            {"closed": True, "name": "microwave 1", "openable": True},
            {"closed": False, "name": "sinkbasin 1", "openable": False},
            {"closed": False, "name": "shelf 1", "openable": False},
        ],
        "v": 1,
    }
    return Task(task_id="household/test/00000", env="household", split="train",
                task_type=goal_type, instruction=instruction, seed=7, spec=hh.dump_spec(spec))


def _episode(max_turns: int = 40, **kw):
    env = make_environment("household", max_turns=max_turns)
    ep = env.start(_tiny_task(**kw))
    return ep, ep.reset()


def _do(ep, action: str) -> str:
    assert action in ep.admissible_commands(), (action, ep.admissible_commands())
    res = ep.step(action)
    assert res.admissible
    return res.observation


# ---- registry and options ----------------------------------------------------------------


def test_registered_and_class_attributes():
    assert "household" in registered()
    env = _env()
    assert env.task_types == ("PICK", "CLEAN", "HEAT", "COOL", "LOOK", "PICK2")
    assert env.splits == SPLITS
    assert "put {obj} in/on {recep}" in env.command_grammar


def test_unknown_option_and_split_rejected():
    with pytest.raises(ValueError, match="colour"):
        make_environment("household", max_turns=40, colour="red")
    with pytest.raises(ValueError, match="test_split"):
        _env().make_tasks("test_split", 3, 0)


# ---- generator ---------------------------------------------------------------------------


@pytest.mark.parametrize("split", SPLITS)
def test_task_types_balanced(split):
    counts = collections.Counter(t.task_type for t in _tasks(split))
    assert set(counts) == set(hh.TASK_TYPES)
    for tt, c in counts.items():
        assert abs(c / N - 1 / 6) <= 0.05, (tt, c)


def test_tasks_deterministic_and_well_formed():
    env = make_environment("household", max_turns=MAX_TURNS)
    a = env.make_tasks("train", 60, 3)
    b = env.make_tasks("train", 60, 3)
    assert a == b
    assert env.make_tasks("train", 10, 3) == a[:10]
    assert [e.turns for e in map(env.expert_play, a)] == [e.turns for e in map(env.expert_play, b)]
    assert env.make_tasks("train", 60, 4) != a
    for i, t in enumerate(a):
        assert t.task_id == f"household/train/{i:05d}"
        assert t.env == "household" and t.split == "train"
        spec = json.loads(t.spec)
        assert t.spec == json.dumps(spec, sort_keys=True, separators=(",", ":"))
        assert spec["instruction"] == t.instruction and spec["goal"]["type"] == t.task_type
        assert 0 <= t.seed < 2**63


_DIGEST = """
import hashlib, json
from hisr_core.envs import make_environment
env = make_environment("household", max_turns=40)
tasks = env.make_tasks("valid_unseen", 30, 11)
text = json.dumps([[t.to_row(), [u.response for u in env.expert_play(t).turns]] for t in tasks])
print(hashlib.sha256(text.encode()).hexdigest())
"""


def test_same_across_processes_and_hash_seeds():
    # str hashing is salted per process; nothing may depend on it.
    root = Path(__file__).resolve().parents[3]
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", _DIGEST], env=env, cwd=root, check=True,
                             capture_output=True, text=True)
        digests.add(out.stdout.strip())
    env_ = make_environment("household", max_turns=40)
    tasks = env_.make_tasks("valid_unseen", 30, 11)
    text = json.dumps([[t.to_row(), [u.response for u in env_.expert_play(t).turns]]
                       for t in tasks])
    digests.add(hashlib.sha256(text.encode()).hexdigest())
    assert len(digests) == 1


def test_split_seeds_disjoint():
    seeds = {s: {t.seed for t in _tasks(s)} for s in SPLITS}
    assert all(len(v) == N for v in seeds.values())
    assert not seeds["train"] & seeds["valid_seen"]
    assert not seeds["train"] & seeds["valid_unseen"]
    assert not seeds["valid_seen"] & seeds["valid_unseen"]
    # Structurally so: the low bits name the split.
    assert hh.task_seed(0, "train", 5) != hh.task_seed(0, "valid_seen", 5)


def test_partition_keeps_both_parts_per_task_type():
    for tt, (seen, unseen) in hh.goal_combos().items():
        assert seen and unseen, tt
        assert not set(seen) & set(unseen)
    seen_l, unseen_l = hh.room_layouts()
    assert seen_l and unseen_l and not set(seen_l) & set(unseen_l)


def test_valid_unseen_combos_and_layouts_disjoint():
    def parts(split):
        specs = [json.loads(t.spec) for t in _tasks(split)]
        return {hh.spec_combo(s) for s in specs}, {hh.spec_layout(s) for s in specs}

    unseen_c, unseen_l = parts("valid_unseen")
    for split in ("train", "valid_seen"):
        c, lay = parts(split)
        assert not c & unseen_c, split
        assert not lay & unseen_l, split
    all_unseen_c = {c for _, u in hh.goal_combos().values() for c in u}
    assert unseen_c <= all_unseen_c
    assert unseen_l <= set(hh.room_layouts()[1])


@pytest.mark.parametrize("split", SPLITS)
def test_generated_rooms_follow_the_rules(split):
    for t in _tasks(split):
        spec = json.loads(t.spec)
        recs = spec["receptacles"]
        assert hh.MIN_RECEPTACLES <= len(recs) <= hh.MAX_RECEPTACLES
        types = {r["name"].rsplit(" ", 1)[0] for r in recs}
        for r in recs:
            kind = r["name"].rsplit(" ", 1)[0]
            assert r["openable"] == (kind in hh.OPENABLE_TYPES) == r["closed"]
        goal = spec["goal"]
        if goal["target"]:
            assert goal["target"] in types
        n_goal = 0
        for o in spec["objects"]:
            kind, where = o["name"].rsplit(" ", 1)[0], o["in"].rsplit(" ", 1)[0]
            assert where in hh.PRIORS[kind], (o, t.task_id)
            if kind == goal["object"]:
                n_goal += 1
                assert where != goal["target"], t.task_id
        assert n_goal >= (2 if t.task_type == "PICK2" else 1)
        assert sum(o["name"].startswith("desklamp ") for o in spec["objects"]) == 1


def test_worst_case_expert_cost_fits_the_turn_limit():
    # Searching visits at most every prior receptacle once (go, plus open if openable); the
    # rest is bounded per task type: take, go to appliance, transform, go to target, open, put
    # (PICK2: twice, plus one go back; LOOK: take, two lamp places, use).
    overhead = {"PICK": 4, "CLEAN": 6, "HEAT": 6, "COOL": 6, "LOOK": 4, "PICK2": 9}
    worst = 0
    for tt, parts in hh.goal_combos().items():
        for unseen, combos in enumerate(parts):
            for _, obj, target in combos:
                for lay in hh._compatible_layouts(bool(unseen), obj, target):
                    counts = dict(zip(hh.RECEPTACLE_TYPES, lay, strict=True))
                    search = sum(counts[t] * (2 if t in hh.OPENABLE_TYPES else 1)
                                 for t in hh.PRIORS[obj] if t != target)
                    worst = max(worst, search + overhead[tt])
    assert worst <= MAX_TURNS, worst


# ---- expert ------------------------------------------------------------------------------

_RESPONSE = re.compile(r"^Thought: ([^\n]+)\nAction: ([^\n]+)$")


@pytest.mark.parametrize("split", SPLITS)
def test_expert_wins_with_admissible_actions(split):
    env = _env()
    for task, ex in zip(_tasks(split), _experts(split), strict=True):
        assert ex.won and ex.score == 1.0, task.task_id
        assert len(ex.turns) <= MAX_TURNS
        # Replay, checking each action against the admissible list at the moment it is issued.
        ep = env.start(task)
        obs = ep.reset()
        for turn in ex.turns:
            assert turn.observation == obs
            assert turn.admissible
            m = _RESPONSE.match(turn.response)
            assert m and m.group(2) == turn.action, turn.response
            assert turn.action in ep.admissible_commands(), (task.task_id, turn.action)
            obs = ep.step(turn.action).observation
        assert obs == ex.final_observation and ep.won and ep.done


@pytest.mark.parametrize("split", SPLITS)
def test_thoughts_never_name_unseen_objects(split):
    for ex in _experts(split):
        shown = ""
        for turn in ex.turns:
            shown += turn.observation + "\n"
            thought = turn.response.split("\nAction:")[0]
            for mention in hh.object_mentions(thought):
                assert re.search(rf"\b{mention}\b", shown), (ex.task.task_id, thought)


def test_thoughts_are_varied_and_plan_first():
    firsts = [ex.turns[0].response for ex in _experts("train")]
    assert len({f.split(",")[0].split(":")[1][:20] for f in firsts}) >= 3
    assert all("find" in f.split("\nAction:")[0] for f in firsts)
    closed_lines = collections.Counter()
    for ex in _experts("train"):
        for turn in ex.turns:
            if turn.response.startswith("Thought: The drawer") or " is closed." in turn.response:
                closed_lines[turn.response.split("\n")[0]] += 1
    assert len(closed_lines) > 3


def test_expert_cannot_cheat_on_thoughts_about_found():
    # "find"/"see" claims about the goal object come only once the observation shows it.
    for ex in _experts("valid_seen"):
        x = json.loads(ex.task.spec)["goal"]["object"]
        for turn in ex.turns:
            thought = turn.response.split("\nAction:")[0]
            if re.search(rf"(I see|Now I find|There is) (an? )?{x} \d", thought):
                assert re.search(rf"\b{x} \d+\b", turn.observation), thought


# ---- episode rules -----------------------------------------------------------------------


def test_reset_observation_and_reset_twice():
    ep, first = _episode()
    assert first.startswith("You are in the middle of a room. Looking quickly around you, "
                            "you see a cabinet 1, a countertop 1, ")
    assert first.endswith(", and a shelf 1.\n\nYour task is to: put a apple in countertop.")
    assert "apple" not in first.split("\n")[0]
    _do(ep, "go to fridge 1")
    _do(ep, "open fridge 1")
    _do(ep, "take apple 1 from fridge 1")
    assert ep.turns == 3 and ep.holding == "apple 1"
    assert ep.reset() == first
    assert ep.turns == 0 and ep.holding is None and ep.location is None


def test_closed_receptacle_hides_contents_until_opened():
    ep, _ = _episode()
    obs = _do(ep, "go to fridge 1")
    assert obs == "You arrive at fridge 1. The fridge 1 is closed."
    assert "apple" not in " ".join(ep.admissible_commands())
    assert _do(ep, "examine fridge 1") == "The fridge 1 is closed."
    assert ep.step("take apple 1 from fridge 1").observation == NOTHING_HAPPENS
    obs = _do(ep, "open fridge 1")
    assert obs == "You open the fridge 1. The fridge 1 is open. In it, you see a apple 1."
    assert _do(ep, "close fridge 1") == "You close the fridge 1."
    obs = _do(ep, "go to countertop 1")
    assert obs == "You arrive at countertop 1. On the countertop 1, you see a knife 1, and a apple 2."
    assert _do(ep, "go to shelf 1") == "You arrive at shelf 1. On the shelf 1, you see nothing."


def test_inadmissible_counts_as_a_turn_and_limit_ends_episode():
    ep, _ = _episode(max_turns=3)
    res = ep.step("fly to the moon")
    assert res.observation == NOTHING_HAPPENS and not res.admissible
    assert ep.turns == 1 and not res.done
    res = ep.step("go to fridge 1")
    assert res.admissible and not res.done
    res = ep.step("go to fridge 1")  # already here: not admissible
    assert res.observation == NOTHING_HAPPENS and not res.admissible
    assert res.done and not res.won and ep.done and not ep.won
    with pytest.raises(RuntimeError):
        ep.step("look")


def test_admissible_list_order_and_normalisation():
    ep, _ = _episode()
    adm = ep.admissible_commands()
    assert adm[:7] == [f"go to {r}" for r in ("cabinet 1", "countertop 1", "desk 1", "fridge 1",
                                            "microwave 1", "sinkbasin 1", "shelf 1")]
    assert adm[7:] == ["look", "inventory"]
    _do(ep, "go to countertop 1")
    adm = ep.admissible_commands()
    assert "go to countertop 1" not in adm
    assert adm[6:] == ["take knife 1 from countertop 1", "take apple 2 from countertop 1",
                       "examine countertop 1", "examine knife 1", "examine apple 2", "look",
                       "inventory"]
    # Case and whitespace do not matter.
    assert ep.step("  Take   APPLE 2 from countertop 1 ").admissible
    assert ep.holding == "apple 2"


def test_take_put_inventory_examine_look():
    ep, _ = _episode(obj="book", target="shelf", instruction="put a book in shelf")
    assert _do(ep, "look") == ("You are in the middle of a room. Looking quickly around you, "
                               "you see nothing.")
    assert _do(ep, "inventory") == "You are not carrying anything."
    _do(ep, "go to desk 1")
    assert _do(ep, "look") == "You are facing the desk 1. Next to it, you see nothing."
    assert "take desklamp 1 from desk 1" not in ep.admissible_commands()
    assert _do(ep, "take book 1 from desk 1") == "You pick up the book 1 from the desk 1."
    assert _do(ep, "inventory") == "You are carrying: a book 1."
    assert _do(ep, "examine book 1") == "There's nothing special about book 1."
    assert _do(ep, "examine desk 1") == "On the desk 1, you see a desklamp 1."
    assert not any(c.startswith("take ") for c in ep.admissible_commands())
    assert ep.score == 0.5 and not ep.won
    _do(ep, "go to shelf 1")
    res = ep.step("put book 1 in/on shelf 1")
    assert res.observation == "You put the book 1 in/on the shelf 1."
    assert res.won and res.done and res.score == 1.0


def test_put_needs_open_receptacle():
    ep, _ = _episode(obj="mug", target="cabinet", instruction="put a mug in cabinet")
    _do(ep, "go to countertop 1")
    _do(ep, "take knife 1 from countertop 1")
    _do(ep, "go to cabinet 1")
    assert "put knife 1 in/on cabinet 1" not in ep.admissible_commands()
    _do(ep, "open cabinet 1")
    assert _do(ep, "put knife 1 in/on cabinet 1") == "You put the knife 1 in/on the cabinet 1."
    assert not ep.won  # an X that starts in the target type never counts
    assert ep.score == 0.0


@pytest.mark.parametrize(
    ("goal", "verb", "app", "word"),
    [("CLEAN", "clean", "sinkbasin 1", "clean"), ("HEAT", "heat", "microwave 1", "heat"),
     ("COOL", "cool", "fridge 1", "cool")],
)
def test_clean_heat_cool(goal, verb, app, word):
    ep, _ = _episode(goal_type=goal, target="shelf", instruction=f"put a {word} apple in shelf")
    _do(ep, "go to countertop 1")
    _do(ep, "take apple 2 from countertop 1")
    assert ep.score == pytest.approx(1 / 3)
    assert f"{verb} apple 2 with {app}" not in ep.admissible_commands()
    _do(ep, f"go to {app}")
    # Like ALFWorld, the appliance works closed or open.
    assert _do(ep, f"{verb} apple 2 with {app}") == f"You {verb} the apple 2 using the {app}."
    assert ep.score == pytest.approx(2 / 3) and not ep.won
    _do(ep, "go to shelf 1")
    res = ep.step("put apple 2 in/on shelf 1")
    assert res.won and res.score == 1.0


def test_put_without_transform_is_not_a_win():
    ep, _ = _episode(goal_type="HEAT", target="shelf", instruction="put a hot apple in shelf")
    _do(ep, "go to countertop 1")
    _do(ep, "take apple 2 from countertop 1")
    _do(ep, "go to shelf 1")
    res = ep.step("put apple 2 in/on shelf 1")
    assert res.admissible and not res.won and not res.done
    # Heating then cooling loses "hot".
    _do(ep, "take apple 2 from shelf 1")
    _do(ep, "go to microwave 1")
    _do(ep, "heat apple 2 with microwave 1")
    _do(ep, "go to fridge 1")
    _do(ep, "cool apple 2 with fridge 1")
    _do(ep, "go to shelf 1")
    assert not ep.step("put apple 2 in/on shelf 1").won


def test_use_desklamp_and_look_goal():
    ep, _ = _episode(goal_type="LOOK", obj="book", target="",
                     instruction="look at book under the desklamp")
    _do(ep, "go to desk 1")
    assert "use desklamp 1" in ep.admissible_commands()
    assert _do(ep, "use desklamp 1") == "You turn on the desklamp 1."
    assert "use desklamp 1" not in ep.admissible_commands()
    assert ep.score == 0.5 and not ep.won
    res = ep.step("take book 1 from desk 1")
    assert res.won and res.done and res.score == 1.0


def test_pick2_needs_two():
    ep, _ = _episode(goal_type="PICK2", target="shelf", instruction="put two apple in shelf")
    _do(ep, "go to countertop 1")
    _do(ep, "take apple 2 from countertop 1")
    _do(ep, "go to shelf 1")
    _do(ep, "put apple 2 in/on shelf 1")
    assert not ep.won and ep.score == pytest.approx(1 / 3)
    _do(ep, "go to fridge 1")
    _do(ep, "open fridge 1")
    _do(ep, "take apple 1 from fridge 1")
    assert ep.score == pytest.approx(2 / 3)
    _do(ep, "go to shelf 1")
    assert ep.step("put apple 1 in/on shelf 1").won


def test_show_admissible_option():
    env = make_environment("household", max_turns=10, show_admissible=True)
    ep = env.start(_tiny_task())
    first = ep.reset()
    assert first.endswith("\nAdmissible actions: " + ", ".join(ep.admissible_commands()))
    res = ep.step("dance")
    assert res.observation.startswith(NOTHING_HAPPENS + "\nAdmissible actions: go to cabinet 1")


def test_step_before_reset_raises_and_wrong_env_rejected():
    env = _env()
    ep = env.start(_tiny_task())
    with pytest.raises(RuntimeError):
        ep.step("look")
    t = _tiny_task()
    with pytest.raises(ValueError):
        env.start(Task(t.task_id, "alfworld", t.split, t.task_type, t.instruction, t.seed, t.spec))


def test_expert_plays_hand_built_room():
    env = make_environment("household", max_turns=40)
    for goal, instr in [("PICK", "put a apple in shelf"), ("COOL", "put a cool apple in shelf")]:
        task = _tiny_task(goal_type=goal, target="shelf", instruction=instr)
        ex = env.expert_play(task)
        assert ex.won
        assert ex.turns[0].action == "go to fridge 1"  # the apple prior starts with fridge


def test_expert_slips_then_recovers_and_still_wins():
    from hisr_core.envs.base import MAX_SLIPS

    env = make_environment("household", max_turns=40)
    n_slipped = 0
    for task in env.make_tasks("train", 200, seed=3):
        ep = env.expert_play(task, slip_rate=0.3)
        assert ep.won, task.task_id
        slips = [k for k, t in enumerate(ep.turns) if not t.admissible]
        assert len(slips) <= MAX_SLIPS
        n_slipped += bool(slips)
        for k in slips:
            assert k > 0 and k + 1 < len(ep.turns), "a slip is never first or last"
            assert ep.turns[k + 1].observation == "Nothing happens."
            nxt = ep.turns[k + 1]
            assert nxt.admissible and nxt.response.startswith(
                ("Thought: That did not work.", "Thought: Nothing happened",
                 "Thought: That command did nothing"))
    assert n_slipped > 50
    # No slips without a slip rate; the same slip rate gives the same episode.
    task = env.make_tasks("train", 1, seed=3)[0]
    assert all(t.admissible for t in env.expert_play(task).turns)
    assert env.expert_play(task, 0.3) == env.expert_play(task, 0.3)
    with pytest.raises(ValueError, match="slip_rate"):
        env.expert_play(task, 1.5)


# ---- oracle distance ---------------------------------------------------------------------

#: The tiny room's tasks and their oracle distances from the start (counted by hand).
_TINY_GOALS = {
    # go to fridge 1, open fridge 1, take apple 1, go to countertop 1, put (apple 2 lies in a
    # countertop from the start and never counts)
    "PICK": ({"goal_type": "PICK"}, 5),
    # apple 2: go to countertop 1, take, go to sinkbasin 1, clean, go to shelf 1, put
    "CLEAN": ({"goal_type": "CLEAN", "target": "shelf",
               "instruction": "put a clean apple in shelf"}, 6),
    "HEAT": ({"goal_type": "HEAT", "target": "shelf",
              "instruction": "put a hot apple in shelf"}, 6),
    # apple 1: go to fridge 1, open, take, cool right there, go to shelf 1, put
    "COOL": ({"goal_type": "COOL", "target": "shelf",
              "instruction": "put a cool apple in shelf"}, 6),
    # go to desk 1, take book 1, use desklamp 1
    "LOOK": ({"goal_type": "LOOK", "obj": "book", "target": "",
              "instruction": "look at book under the desklamp"}, 3),
    # apple 2 to the shelf (4 steps), then apple 1 from the closed fridge (5 steps)
    "PICK2": ({"goal_type": "PICK2", "target": "shelf",
               "instruction": "put two apple in shelf"}, 9),
}
_NO_CHANGE = {hh._EXAM_R, hh._EXAM_O, hh._LOOK, hh._INV}


def _state(ep) -> tuple:
    return (ep._loc, ep._holding, tuple(tuple(sorted(c)) for c in ep._contents),
            tuple(ep._closed), tuple(map(tuple, ep._props)), tuple(ep._lamp_on), ep._won)


def _restore(ep, state: tuple) -> None:
    ep._loc, ep._holding = state[0], state[1]
    ep._contents = [list(c) for c in state[2]]
    ep._closed, ep._props = list(state[3]), [list(p) for p in state[4]]
    ep._lamp_on, ep._won, ep._cmds = list(state[5]), state[6], None


def _bfs_distance(ep, limit: int) -> int | None:
    """The fewest commands from ``ep``'s state to a win, by breadth-first search over the
    episode's own rules (None beyond ``limit``); ``ep`` is left as it was."""
    start = _state(ep)
    seen, frontier = {start}, [start]
    try:
        for depth in range(1, limit + 1):
            nxt = []
            for state in frontier:
                _restore(ep, state)
                for op in list(ep._commands().values()):
                    if op[0] in _NO_CHANGE:
                        continue
                    _restore(ep, state)
                    ep._apply(*op)
                    after = _state(ep)
                    if ep._won:
                        return depth
                    if after not in seen:
                        seen.add(after)
                        nxt.append(after)
            frontier = nxt
        return None
    finally:
        _restore(ep, start)


@pytest.mark.parametrize("goal", list(_TINY_GOALS))
def test_oracle_plan_drops_the_distance_by_one_per_step(goal):
    kw, expected = _TINY_GOALS[goal]
    ep, _ = _episode(**kw)
    assert ep.distance_to_goal() == expected
    plan = ep.oracle_plan()
    assert len(plan) == expected
    for k, cmd in enumerate(plan):
        res = ep.step(cmd)
        assert res.admissible and res.distance == expected - k - 1 == ep.distance_to_goal(), cmd
    assert ep.won and ep.oracle_plan() == []


def test_direct_pick_play_and_detours():
    ep, _ = _episode()
    assert ep.distance_to_goal() == 5
    # Detours: going somewhere useless, looking, examining, a refused command.
    for detour in ("go to shelf 1", "examine shelf 1", "look", "inventory", "fly away",
                   "go to cabinet 1", "open cabinet 1", "examine mug 1"):
        assert ep.step(detour).distance == 5, detour
    distances = [ep.step(cmd).distance for cmd in (
        "go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to countertop 1",
        "put apple 1 in/on countertop 1")]
    assert distances == [4, 3, 2, 1, 0] and ep.won


def test_moves_that_undo_progress_raise_the_distance():
    ep, _ = _episode()
    assert [ep.step(c).distance for c in ("go to fridge 1", "open fridge 1")] == [4, 3]
    assert ep.step("close fridge 1").distance == 4
    assert [ep.step(c).distance for c in ("open fridge 1", "take apple 1 from fridge 1")] == [3, 2]
    # Dropping the apple where it was (take again, go, put), or on a wrong shelf.
    assert ep.step("put apple 1 in/on fridge 1").distance == 3
    assert ep.step("take apple 1 from fridge 1").distance == 2
    assert ep.step("go to shelf 1").distance == 2
    assert ep.step("put apple 1 in/on shelf 1").distance == 3
    # Picking up the wrong object costs a put to free the hands.
    ep2, _ = _episode(**_TINY_GOALS["CLEAN"][0])
    assert ep2.step("go to countertop 1").distance == 5
    assert ep2.step("take knife 1 from countertop 1").distance == 6
    assert ep2.step("put knife 1 in/on countertop 1").distance == 5


def test_a_transform_undone_raises_the_distance():
    ep, _ = _episode(**_TINY_GOALS["COOL"][0])
    for cmd in ("go to fridge 1", "open fridge 1", "take apple 1 from fridge 1"):
        ep.step(cmd)
    assert ep.step("cool apple 1 with fridge 1").distance == 2
    assert ep.step("go to microwave 1").distance == 2
    assert ep.step("heat apple 1 with microwave 1").distance == 4  # cool again, then go on


@pytest.mark.parametrize("goal", list(_TINY_GOALS))
def test_oracle_distance_equals_breadth_first_search(goal):
    kw, _ = _TINY_GOALS[goal]
    rng = random.Random(goal)
    ep, _ = _episode(max_turns=10_000, **kw)
    checked = 0
    while checked < 6:
        d = ep.distance_to_goal()
        if d <= 6:
            assert _bfs_distance(ep, d + 1) == d, (goal, ep.oracle_plan())
            checked += 1
        for _ in range(rng.randint(1, 3)):
            ep.step(rng.choice(ep.admissible_commands()))
            if ep.won:
                ep.reset()


def test_oracle_plans_win_from_random_states_of_generated_rooms():
    rng = random.Random(0)
    env = make_environment("household", max_turns=10_000)
    for task in _tasks("valid_unseen")[:120]:
        ep = env.start(task)
        ep.reset()
        for _ in range(rng.randint(0, 25)):
            if not ep.won:
                ep.step(rng.choice(ep.admissible_commands()))
        d = ep.distance_to_goal()
        plan = ep.oracle_plan()
        assert len(plan) == d
        for k, cmd in enumerate(plan):
            assert ep.step(cmd).distance == d - k - 1, (task.task_id, plan, k)
        assert ep.won


def test_expert_progress_ends_at_zero_and_slips_change_nothing():
    env = _env()
    for task in _tasks("train")[:150]:
        played = env.expert_play(task, slip_rate=0.2)
        ep = env.start(task)
        ep.reset()
        distances = [ep.distance_to_goal()]
        distances += [ep.step(t.action).distance for t in played.turns]
        assert distances[-1] == 0 and min(distances[:-1]) > 0, task.task_id
        for k, turn in enumerate(played.turns):
            if not turn.admissible:
                assert distances[k + 1] == distances[k]
        if task.task_type != "LOOK":  # LOOK's searcher may leave the lamp it passed
            assert all(b <= a for a, b in itertools.pairwise(distances)), task.task_id


def test_unreachable_goal_has_unknown_distance():
    ep, _ = _episode(goal_type="PICK2", target="countertop", instruction="put two apple in "
                     "countertop")  # apple 2 starts on the countertop: one apple counts
    assert ep.distance_to_goal() == UNKNOWN_DISTANCE and ep.oracle_plan() is None
    with pytest.raises(RuntimeError, match="reset"):
        _env().start(_tiny_task()).distance_to_goal()
