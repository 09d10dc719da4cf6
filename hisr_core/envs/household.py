"""The built-in ``household`` environment: an ALFWorld-style text household in pure Python.

One room holds numbered receptacles (``cabinet 1``, ``fridge 1``, ...) and numbered objects
(``apple 2``) lying in or on them. The agent walks between receptacles, opens and closes the
openable ones, carries at most one object, and cleans / heats / cools what it carries at the
sinkbasin / microwave / fridge. The six task types and the observation wording follow ALFWorld.

Layout of this module: data (vocabularies, priors, instruction templates), the split partition,
the task generator, the episode, the oracle (:func:`oracle_plan`, the shortest plan with full
knowledge of the room, whose length is the episode's distance to its goal), the expert, and
the :class:`HouseholdEnv` that ties them.

Rules worth knowing (they are what an agent has to learn):

* Openable receptacles (cabinet, drawer, fridge, microwave) start closed; their contents are
  shown only once open. Nothing that the agent has not seen is ever named in an observation.
* ``take`` needs empty hands and a visible object at the current receptacle; ``put`` needs the
  current receptacle to be open (or not openable). The desklamp cannot be taken.
* ``clean``/``heat``/``cool`` apply to the held object and need the agent to be at a sinkbasin /
  microwave / fridge; like ALFWorld they work whether or not the microwave/fridge is open.
  Heating removes "cool" and cooling removes "hot".
* ``use desklamp N`` is admissible at the lamp's receptacle while the lamp is off; the lamp then
  stays on for the rest of the episode.
* Anything not in :meth:`HouseholdEpisode.admissible_commands` returns ``Nothing happens.`` and
  still costs a turn. Actions are compared after lower-casing and collapsing whitespace.

Goal conditions, and the partial score (the fraction of conditions met; 1.0 only when won):

* PICK:   holding an X; an X is in/on a Y.
* CLEAN/HEAT/COOL: holding an X; some X is clean/hot/cool; a clean/hot/cool X is in/on a Y.
* LOOK:   holding an X; the desklamp is on.
* PICK2:  holding an X; at least one X is in/on a Y; two Xs are in/on Ys.

The last condition of each list is the win condition (for LOOK: both). An X that already lay
in a Y-type receptacle at the start never counts (the generator never places one there).

Spec JSON (``Task.spec``, compact, sorted keys)::

    {"goal": {"object": "apple", "target": "fridge", "type": "CLEAN"},   # target "" for LOOK
     "instruction": "put a clean apple in fridge",
     "objects": [{"in": "countertop 1", "name": "apple 1"}, ...],        # listing order
     "receptacles": [{"closed": true, "name": "cabinet 1", "openable": true}, ...],
     "v": 1}
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from hisr_core.agent.react import format_response
from hisr_core.envs.base import (
    UNKNOWN_DISTANCE,
    Environment,
    ExpertEpisode,
    GoalEpisode,
    Slips,
    Task,
    Turn,
    register,
)

# --------------------------------------------------------------------------------------------
# Data: receptacles, objects, priors, task vocabularies
# --------------------------------------------------------------------------------------------

#: Receptacle types in canonical (listing) order with their instance-count range.
RECEPTACLE_COUNTS: dict[str, tuple[int, int]] = {
    "cabinet": (1, 2),
    "drawer": (1, 2),
    "countertop": (1, 1),
    "shelf": (0, 1),
    "stoveburner": (1, 1),
    "desk": (0, 1),
    "sidetable": (0, 1),
    "diningtable": (1, 1),
    "fridge": (1, 1),
    "microwave": (1, 1),
    "sinkbasin": (1, 1),
    "garbagecan": (1, 1),
    "coffeemachine": (0, 1),
    "toaster": (0, 1),
}
RECEPTACLE_TYPES: tuple[str, ...] = tuple(RECEPTACLE_COUNTS)
OPENABLE_TYPES: frozenset[str] = frozenset({"cabinet", "drawer", "fridge", "microwave"})
#: Receptacles one puts things *in* (for thoughts); the rest are surfaces one puts things *on*.
CONTAINER_TYPES: frozenset[str] = frozenset(
    {"cabinet", "drawer", "fridge", "microwave", "sinkbasin", "garbagecan", "coffeemachine",
     "toaster"}
)
MIN_RECEPTACLES, MAX_RECEPTACLES = 10, 15

#: Where each object type is usually found, most likely first. Objects are placed only on these
#: types, with weights PRIOR_WEIGHTS by rank among the types present in the room.
PRIORS: dict[str, tuple[str, ...]] = {
    "apple": ("fridge", "countertop", "diningtable", "garbagecan", "sinkbasin"),
    "bread": ("countertop", "diningtable", "fridge", "cabinet"),
    "lettuce": ("fridge", "countertop", "diningtable", "sinkbasin"),
    "tomato": ("fridge", "countertop", "diningtable", "sinkbasin", "garbagecan"),
    "potato": ("fridge", "countertop", "diningtable", "garbagecan", "stoveburner"),
    "egg": ("fridge", "countertop", "diningtable", "garbagecan", "sinkbasin"),
    "mug": ("coffeemachine", "cabinet", "countertop", "diningtable", "sinkbasin", "shelf"),
    "cup": ("cabinet", "countertop", "diningtable", "sinkbasin", "fridge"),
    "plate": ("cabinet", "countertop", "diningtable", "shelf", "fridge"),
    "bowl": ("cabinet", "countertop", "diningtable", "shelf", "fridge"),
    "pan": ("stoveburner", "cabinet", "countertop", "sinkbasin"),
    "pot": ("stoveburner", "cabinet", "countertop", "sinkbasin"),
    "knife": ("countertop", "drawer", "diningtable", "sinkbasin"),
    "fork": ("drawer", "countertop", "diningtable", "sinkbasin"),
    "spoon": ("drawer", "countertop", "diningtable", "sinkbasin"),
    "spatula": ("drawer", "countertop", "stoveburner", "sinkbasin"),
    "dishsponge": ("sinkbasin", "countertop", "cabinet"),
    "saltshaker": ("countertop", "cabinet", "diningtable", "shelf"),
    "winebottle": ("fridge", "countertop", "diningtable", "cabinet"),
    "book": ("desk", "shelf", "sidetable", "diningtable"),
    "cd": ("desk", "drawer", "shelf", "sidetable", "garbagecan"),
    "pen": ("desk", "drawer", "sidetable", "shelf", "diningtable"),
    "pencil": ("desk", "drawer", "sidetable", "shelf", "diningtable"),
    "keychain": ("sidetable", "drawer", "desk", "diningtable"),
    "creditcard": ("desk", "countertop", "sidetable", "drawer", "diningtable"),
    "cellphone": ("desk", "sidetable", "diningtable", "countertop"),
    "alarmclock": ("desk", "sidetable", "shelf", "diningtable"),
    "remotecontrol": ("sidetable", "diningtable", "shelf", "drawer"),
    "vase": ("shelf", "diningtable", "sidetable", "cabinet"),
    "statue": ("shelf", "sidetable", "desk", "diningtable"),
    "desklamp": ("desk", "sidetable"),
}
PRIOR_WEIGHTS: tuple[int, ...] = (8, 4, 2, 1, 1, 1)
LAMP = "desklamp"
OBJECT_TYPES: tuple[str, ...] = tuple(t for t in PRIORS if t != LAMP)

_FOOD_TARGETS = ("fridge", "countertop", "diningtable", "garbagecan", "microwave")
_DISH_TARGETS = ("cabinet", "countertop", "diningtable", "shelf", "fridge", "microwave",
                 "sinkbasin")
_UTENSIL_TARGETS = ("drawer", "countertop", "diningtable", "sinkbasin", "cabinet")
_SMALL_TARGETS = ("desk", "sidetable", "shelf", "drawer", "diningtable")
#: Receptacle types where an object type can sensibly be put away (goal targets).
TARGETS: dict[str, tuple[str, ...]] = {
    **{o: _FOOD_TARGETS for o in ("apple", "bread", "lettuce", "tomato", "potato", "egg")},
    "mug": _DISH_TARGETS + ("coffeemachine",),
    "cup": _DISH_TARGETS + ("coffeemachine",),
    "plate": _DISH_TARGETS,
    "bowl": _DISH_TARGETS,
    "pan": ("stoveburner", "cabinet", "countertop", "diningtable", "fridge", "sinkbasin"),
    "pot": ("stoveburner", "cabinet", "countertop", "diningtable", "fridge", "sinkbasin"),
    **{o: _UTENSIL_TARGETS for o in ("knife", "fork", "spoon", "spatula")},
    "dishsponge": ("sinkbasin", "cabinet", "countertop"),
    "saltshaker": ("cabinet", "countertop", "shelf", "diningtable", "drawer"),
    "winebottle": ("fridge", "cabinet", "countertop", "diningtable", "shelf"),
    **{o: _SMALL_TARGETS for o in ("book", "cd", "pen", "pencil", "keychain", "creditcard",
                                    "cellphone", "alarmclock", "remotecontrol", "vase",
                                    "statue")},
}
TASK_TYPES: tuple[str, ...] = ("PICK", "CLEAN", "HEAT", "COOL", "LOOK", "PICK2")
#: Object types each task type is posed with (ALFWorld's choices, roughly).
TASK_OBJECTS: dict[str, tuple[str, ...]] = {
    "PICK": OBJECT_TYPES,
    "CLEAN": ("apple", "lettuce", "tomato", "potato", "mug", "cup", "plate", "bowl", "pan",
              "pot", "knife", "fork", "spoon", "spatula", "dishsponge"),
    "HEAT": ("apple", "bread", "potato", "tomato", "egg", "mug", "cup", "plate"),
    "COOL": ("apple", "bread", "lettuce", "tomato", "potato", "egg", "mug", "cup", "plate",
             "bowl", "pan", "pot", "winebottle"),
    "LOOK": ("book", "cd", "pen", "pencil", "keychain", "creditcard", "cellphone",
             "alarmclock", "remotecontrol", "vase", "statue", "bowl", "mug"),
    "PICK2": ("apple", "tomato", "potato", "egg", "mug", "cup", "plate", "bowl", "knife",
              "fork", "spoon", "spatula", "saltshaker", "winebottle", "dishsponge", "book",
              "cd", "pen", "pencil", "keychain", "creditcard", "cellphone", "remotecontrol",
              "vase", "statue"),
}
#: The appliance (receptacle type) and the property each transforming task type needs.
TRANSFORMS: dict[str, tuple[str, str, str]] = {
    # task type: (verb, appliance type, adjective)
    "CLEAN": ("clean", "sinkbasin", "clean"),
    "HEAT": ("heat", "microwave", "hot"),
    "COOL": ("cool", "fridge", "cool"),
}
#: ALFWorld's instruction templates, two per task type, one chosen per task.
INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "PICK": ("put a {o} in {r}", "put some {o} on {r}"),
    "CLEAN": ("put a clean {o} in {r}", "clean some {o} and put it in {r}"),
    "HEAT": ("put a hot {o} in {r}", "heat some {o} and put it in {r}"),
    "COOL": ("put a cool {o} in {r}", "cool some {o} and put it in {r}"),
    "LOOK": ("look at {o} under the desklamp", "examine the {o} with the desklamp"),
    "PICK2": ("put two {o} in {r}", "find two {o} and put them in {r}"),
}
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
_SPLIT_CODE = {"train": 0, "valid_seen": 1, "valid_unseen": 2}
SPEC_VERSION = 1

# --------------------------------------------------------------------------------------------
# Split partition: goal combinations and room layouts that only valid_unseen uses
# --------------------------------------------------------------------------------------------

Combo = tuple[str, str, str]  # (task type, object type, target receptacle type or "")
Layout = tuple[int, ...]  # instance count per RECEPTACLE_TYPES entry


def _stable_hash(text: str) -> int:
    # hash() of a str is salted per process; crc32 is the same everywhere.
    return zlib.crc32(text.encode())


def _combo_targets(task_type: str, obj: str) -> tuple[str, ...]:
    if task_type == "LOOK":
        return ("",)
    appliance = TRANSFORMS[task_type][1] if task_type in TRANSFORMS else None
    return tuple(t for t in TARGETS[obj] if t != appliance)


@functools.cache
def goal_combos() -> dict[str, tuple[tuple[Combo, ...], tuple[Combo, ...]]]:
    """Per task type, (seen combos, unseen combos). Unseen: crc32 of the combo mod 5 == 0.

    A task type that would end up with no unseen (or no seen) combo moves its combo with the
    smallest (largest) hash across, so every type keeps both parts.
    """
    out: dict[str, tuple[tuple[Combo, ...], tuple[Combo, ...]]] = {}
    for tt in TASK_TYPES:
        combos = [(tt, o, t) for o in TASK_OBJECTS[tt] for t in _combo_targets(tt, o)]
        keyed = sorted(combos, key=lambda c: (_stable_hash("|".join(c)), c))
        unseen = {c for c in combos if _stable_hash("|".join(c)) % 5 == 0}
        if not unseen:
            unseen = {keyed[0]}
        if len(unseen) == len(combos):
            unseen.discard(keyed[-1])
        out[tt] = (
            tuple(c for c in combos if c not in unseen),
            tuple(c for c in combos if c in unseen),
        )
    return out


def _layout_valid(layout: Layout) -> bool:
    counts = dict(zip(RECEPTACLE_TYPES, layout, strict=True))
    total = sum(layout)
    # The desklamp needs a desk or a sidetable.
    return MIN_RECEPTACLES <= total <= MAX_RECEPTACLES and counts["desk"] + counts["sidetable"] > 0


def is_unseen_layout(layout: Layout) -> bool:
    return _stable_hash(",".join(map(str, layout))) % 5 == 0


@functools.cache
def room_layouts() -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    """All valid room layouts, as (seen, unseen)."""
    ranges = [range(lo, hi + 1) for lo, hi in RECEPTACLE_COUNTS.values()]
    layouts = [lay for lay in itertools.product(*ranges) if _layout_valid(lay)]
    return (
        tuple(lay for lay in layouts if not is_unseen_layout(lay)),
        tuple(lay for lay in layouts if is_unseen_layout(lay)),
    )


def _placement_types(obj: str, counts: Mapping[str, int], exclude: str) -> list[str]:
    return [t for t in PRIORS[obj] if counts.get(t, 0) > 0 and t != exclude]


@functools.cache
def _compatible_layouts(unseen: bool, obj: str, target: str) -> tuple[Layout, ...]:
    layouts = room_layouts()[1 if unseen else 0]
    out = []
    for lay in layouts:
        counts = dict(zip(RECEPTACLE_TYPES, lay, strict=True))
        if target and counts[target] == 0:
            continue
        if not _placement_types(obj, counts, target):
            continue
        out.append(lay)
    return tuple(out)


def spec_combo(spec: Mapping[str, Any]) -> Combo:
    """The goal combination of a parsed spec."""
    g = spec["goal"]
    return (g["type"], g["object"], g["target"])


def spec_layout(spec: Mapping[str, Any]) -> Layout:
    """The room layout (instance count per receptacle type) of a parsed spec."""
    counts = dict.fromkeys(RECEPTACLE_TYPES, 0)
    for r in spec["receptacles"]:
        counts[r["name"].rsplit(" ", 1)[0]] += 1
    return tuple(counts.values())


# --------------------------------------------------------------------------------------------
# Task generator
# --------------------------------------------------------------------------------------------


def task_seed(seed: int, split: str, index: int) -> int:
    """Per-task seed: 61 hash bits, then two bits naming the split, so splits never collide."""
    digest = hashlib.sha256(f"household|{seed}|{split}|{index}".encode()).digest()
    return ((int.from_bytes(digest[:8], "big") >> 3) << 2) | _SPLIT_CODE[split]


def _type_order(seed: int, split: str) -> list[str]:
    digest = hashlib.sha256(f"household|order|{seed}|{split}".encode()).digest()
    order = list(TASK_TYPES)
    random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


def generate_spec(split: str, task_type: str, seed: int) -> dict[str, Any]:
    """One room for ``task_type`` drawn from ``split``'s part of the partition."""
    rng = random.Random(seed)
    unseen = split == "valid_unseen"
    combos = goal_combos()[task_type][1 if unseen else 0]
    _, obj, target = combos[rng.randrange(len(combos))]
    layouts = _compatible_layouts(unseen, obj, target)
    layout = layouts[rng.randrange(len(layouts))]
    counts = dict(zip(RECEPTACLE_TYPES, layout, strict=True))

    def place(kind: str, exclude: str) -> str:
        kinds = _placement_types(kind, counts, exclude)
        rtype = rng.choices(kinds, weights=PRIOR_WEIGHTS[: len(kinds)])[0]
        return f"{rtype} {rng.randint(1, counts[rtype])}"

    # A spare goal instance now and then; rarely, so that searching stays the hard part.
    n_goal = (2 if task_type == "PICK2" else 1) + (rng.random() < 0.2)
    placed: list[tuple[str, str]] = [(obj, place(obj, target)) for _ in range(n_goal)]
    placed.append((LAMP, place(LAMP, "")))
    others = [o for o in OBJECT_TYPES if o != obj]
    for other in rng.sample(others, rng.randint(3, 5)):
        for _ in range(1 + (rng.random() < 0.3)):
            placed.append((other, place(other, "")))
    # Shuffle so the goal object is not always listed first where it lies.
    rng.shuffle(placed)
    numbers: dict[str, int] = {}
    objects = []
    for kind, where in placed:
        numbers[kind] = numbers.get(kind, 0) + 1
        objects.append({"in": where, "name": f"{kind} {numbers[kind]}"})
    receptacles = [
        {"closed": rtype in OPENABLE_TYPES, "name": f"{rtype} {i}",
         "openable": rtype in OPENABLE_TYPES}
        for rtype in RECEPTACLE_TYPES
        for i in range(1, counts[rtype] + 1)
    ]
    template = INSTRUCTIONS[task_type][rng.randrange(2)]
    return {
        "goal": {"object": obj, "target": target, "type": task_type},
        "instruction": template.format(o=obj, r=target),
        "objects": objects,
        "receptacles": receptacles,
        "v": SPEC_VERSION,
    }


def dump_spec(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# Episode
# --------------------------------------------------------------------------------------------

_MIDDLE_LOOK = "You are in the middle of a room. Looking quickly around you, you see nothing."

# Operation codes of the command table (ints: cheaper to dispatch than strings).
_GO, _OPEN, _CLOSE, _TAKE, _PUT, _CLEAN, _HEAT, _COOL, _USE, _EXAM_R, _EXAM_O, _LOOK, _INV = (
    range(13)
)
_TRANSFORM_OPS = {"sinkbasin": (_CLEAN, "clean"), "microwave": (_HEAT, "heat"),
                  "fridge": (_COOL, "cool")}


def _kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _see_list(names: Sequence[str]) -> str:
    # ALFWorld: "a apple 1", "a apple 1, and a knife 2", "a x, a y, and a z".
    if not names:
        return "nothing"
    if len(names) == 1:
        return f"a {names[0]}"
    return ", ".join(f"a {n}" for n in names[:-1]) + f", and a {names[-1]}"


class _Room:
    """The static part of an episode, parsed once from the spec."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        goal = spec["goal"]
        self.goal_type: str = goal["type"]
        self.goal_object: str = goal["object"]
        self.goal_target: str = goal["target"]
        self.instruction: str = spec["instruction"]
        recs = spec["receptacles"]
        self.rnames: list[str] = [r["name"] for r in recs]
        self.rtypes: list[str] = [_kind(n) for n in self.rnames]
        self.openable: list[bool] = [bool(r["openable"]) for r in recs]
        # "closed" may be omitted: openable receptacles then start closed.
        self.closed0: list[bool] = [
            bool(r.get("closed", True)) and bool(r["openable"]) for r in recs
        ]
        ridx = {n: i for i, n in enumerate(self.rnames)}
        self.ridx = ridx
        objs = spec["objects"]
        self.onames: list[str] = [o["name"] for o in objs]
        self.otypes: list[str] = [_kind(n) for n in self.onames]
        self.oidx = {n: i for i, n in enumerate(self.onames)}
        self.oloc0: list[int] = [ridx[o["in"]] for o in objs]
        self.portable: list[bool] = [t != LAMP for t in self.otypes]
        self.is_lamp: list[bool] = [t == LAMP for t in self.otypes]
        self.is_goal_obj: list[bool] = [t == self.goal_object for t in self.otypes]
        self.is_target: list[bool] = [t == self.goal_target for t in self.rtypes]
        # An X lying in a Y from the start never counts toward the goal.
        self.counts_for_goal: list[bool] = [
            g and not self.is_target[loc]
            for g, loc in zip(self.is_goal_obj, self.oloc0, strict=True)
        ]
        self.transform: tuple[str, str, str] | None = TRANSFORMS.get(self.goal_type)
        self.prop_index: int = (
            ("clean", "hot", "cool").index(self.transform[2]) if self.transform else -1
        )
        self.intro = (
            "You are in the middle of a room. Looking quickly around you, you see "
            f"{_see_list(self.rnames)}.\n\nYour task is to: {self.instruction}."
        )
        n = len(self.rnames)
        self.go_cmds: list[str] = [f"go to {r}" for r in self.rnames]
        self.arrive: list[str] = [f"You arrive at {r}. " for r in self.rnames]
        self.facing: list[str] = [
            f"You are facing the {r}. Next to it, you see nothing." for r in self.rnames
        ]
        # (command, op) pairs for "go to" from each location (-1: the middle of the room).
        self.go_table: list[list[tuple[str, tuple[int, int]]]] = [
            [(self.go_cmds[j], (_GO, j)) for j in range(n) if j != i] for i in range(n)
        ] + [[(self.go_cmds[j], (_GO, j)) for j in range(n)]]


class HouseholdEpisode(GoalEpisode):
    """One play of a household task; see the module docstring for the rules."""

    def __init__(self, task: Task, max_turns: int, show_admissible: bool = False) -> None:
        self.task = task
        self.max_turns = max_turns
        self.show_admissible = show_admissible
        self._room = _Room(json.loads(task.spec))
        self._ready = False
        self._turns = 0
        self._won = False

    # ---- state -------------------------------------------------------------------------
    def reset(self) -> str:
        room = self._room
        self._contents: list[list[int]] = [[] for _ in room.rnames]
        for o, loc in enumerate(room.oloc0):
            self._contents[loc].append(o)
        self._closed = list(room.closed0)
        self._loc = -1
        self._holding = -1
        # props[o] = [clean, hot, cool]
        self._props = [[False, False, False] for _ in room.onames]
        self._lamp_on = [False] * len(room.onames)
        self._turns = 0
        self._won = False
        self._cmds: dict[str, tuple[int, int]] | None = None
        self._adm: list[str] = []
        self._ready = True
        return self._decorate(room.intro)

    @property
    def location(self) -> str | None:
        """The receptacle the agent stands at (None in the middle of the room)."""
        return None if self._loc < 0 else self._room.rnames[self._loc]

    @property
    def holding(self) -> str | None:
        return None if self._holding < 0 else self._room.onames[self._holding]

    def _visible(self, r: int) -> bool:
        return not self._closed[r]

    def _in_target(self, need_prop: bool) -> int:
        room = self._room
        n = 0
        for r, is_t in enumerate(room.is_target):
            if is_t:
                for o in self._contents[r]:
                    if room.counts_for_goal[o] and (
                        not need_prop or self._props[o][room.prop_index]
                    ):
                        n += 1
        return n

    def conditions(self) -> list[bool]:
        room = self._room
        gt = room.goal_type
        held = self._holding >= 0 and room.is_goal_obj[self._holding]
        if gt == "LOOK":
            return [held, any(self._lamp_on)]
        if gt == "PICK":
            return [held, self._in_target(False) >= 1]
        if gt == "PICK2":
            n = self._in_target(False)
            return [held, n >= 1, n >= 2]
        pi = room.prop_index
        has_prop = any(
            room.is_goal_obj[o] and self._props[o][pi] for o in range(len(room.onames))
        )
        return [held, has_prop, self._in_target(True) >= 1]

    def _check_won(self) -> None:
        conds = self.conditions()
        self._won = all(conds) if self._room.goal_type == "LOOK" else conds[-1]

    # ---- commands ----------------------------------------------------------------------
    def _commands(self) -> dict[str, tuple[int, int]]:
        """The admissible commands with their parsed operation, cached until state changes."""
        if self._cmds is not None:
            return self._cmds
        room = self._room
        loc, held = self._loc, self._holding
        cmds = dict(room.go_table[loc])
        if loc >= 0:
            rname = room.rnames[loc]
            visible = not self._closed[loc]
            if room.openable[loc]:
                if visible:
                    cmds[f"close {rname}"] = (_CLOSE, loc)
                else:
                    cmds[f"open {rname}"] = (_OPEN, loc)
            here = self._contents[loc] if visible else ()
            if held < 0:
                for o in here:
                    if room.portable[o]:
                        cmds[f"take {room.onames[o]} from {rname}"] = (_TAKE, o)
            else:
                hname = room.onames[held]
                if visible:
                    cmds[f"put {hname} in/on {rname}"] = (_PUT, loc)
                tr = _TRANSFORM_OPS.get(room.rtypes[loc])
                if tr is not None:
                    cmds[f"{tr[1]} {hname} with {rname}"] = (tr[0], loc)
            for o in here:
                if room.is_lamp[o] and not self._lamp_on[o]:
                    cmds[f"use {room.onames[o]}"] = (_USE, o)
            cmds[f"examine {rname}"] = (_EXAM_R, loc)
            for o in here:
                cmds[f"examine {room.onames[o]}"] = (_EXAM_O, o)
        if held >= 0:
            cmds[f"examine {room.onames[held]}"] = (_EXAM_O, held)
        cmds["look"] = (_LOOK, 0)
        cmds["inventory"] = (_INV, 0)
        self._cmds = cmds
        self._adm = list(cmds)
        return cmds

    def admissible_commands(self) -> list[str]:
        if not self._ready:
            raise RuntimeError("call reset() before admissible_commands()")
        self._commands()
        return list(self._adm)

    def oracle_plan(self) -> list[str] | None:
        """The shortest command list from the current state to the goal for an agent that
        knows where everything is ([] when won, None when no plan exists); see
        :func:`oracle_plan`."""
        if not self._ready:
            raise RuntimeError("call reset() before oracle_plan()")
        return oracle_plan(self)

    def distance_to_goal(self) -> int:
        """The length of :meth:`oracle_plan` (:data:`UNKNOWN_DISTANCE` if there is none)."""
        if not self._ready:
            raise RuntimeError("call reset() before distance_to_goal()")
        if self._won:
            return 0
        route = _shortest_route(self, commands=False)
        return UNKNOWN_DISTANCE if route is None else route.n

    def _view(self, r: int) -> str:
        room = self._room
        names = [room.onames[o] for o in self._contents[r]]
        rname = room.rnames[r]
        if room.openable[r]:
            if self._closed[r]:
                return f"The {rname} is closed."
            return f"The {rname} is open. In it, you see {_see_list(names)}."
        return f"On the {rname}, you see {_see_list(names)}."

    def _act(self, action: str) -> str | None:
        op = self._commands().get(" ".join(action.lower().split()))
        return None if op is None else self._apply(*op)

    def _apply(self, code: int, arg: int) -> str:
        room = self._room
        if code == _GO:
            self._loc = arg
            self._cmds = None
            return room.arrive[arg] + self._view(arg)
        if code == _OPEN:
            self._closed[arg] = False
            self._cmds = None
            return f"You open the {room.rnames[arg]}. " + self._view(arg)
        if code == _CLOSE:
            self._closed[arg] = True
            self._cmds = None
            return f"You close the {room.rnames[arg]}."
        if code == _TAKE:
            self._contents[self._loc].remove(arg)
            self._holding = arg
            self._cmds = None
            self._check_won()
            return f"You pick up the {room.onames[arg]} from the {room.rnames[self._loc]}."
        if code == _PUT:
            o = self._holding
            self._contents[arg].append(o)
            self._holding = -1
            self._cmds = None
            self._check_won()
            return f"You put the {room.onames[o]} in/on the {room.rnames[arg]}."
        if code in (_CLEAN, _HEAT, _COOL):
            o = self._holding
            props = self._props[o]
            if code == _CLEAN:
                props[0] = True
                verb = "clean"
            elif code == _HEAT:
                props[1], props[2] = True, False
                verb = "heat"
            else:
                props[1], props[2] = False, True
                verb = "cool"
            self._check_won()
            return f"You {verb} the {room.onames[o]} using the {room.rnames[arg]}."
        if code == _USE:
            self._lamp_on[arg] = True
            self._cmds = None
            self._check_won()
            return f"You turn on the {room.onames[arg]}."
        if code == _EXAM_R:
            return self._view(arg)
        if code == _EXAM_O:
            return f"There's nothing special about {room.onames[arg]}."
        if code == _LOOK:
            return _MIDDLE_LOOK if self._loc < 0 else room.facing[self._loc]
        if self._holding >= 0:
            return f"You are carrying: a {room.onames[self._holding]}."
        return "You are not carrying anything."


# --------------------------------------------------------------------------------------------
# Oracle: the shortest plan with full knowledge of the room
# --------------------------------------------------------------------------------------------


class _Route:
    """A plan being built from an episode's current state: where the agent would stand, which
    receptacles it would have opened, and its steps (their commands, or only their number
    when ``cmds`` is None). Every method adds just the steps its precondition still needs, so
    the length of a route is the number of steps it really takes."""

    __slots__ = ("cmds", "ep", "loc", "n", "opened")

    def __init__(self, ep: HouseholdEpisode, commands: bool) -> None:
        self.ep = ep
        self.loc = ep._loc
        self.opened: frozenset[int] = frozenset()
        self.n = 0
        self.cmds: list[str] | None = [] if commands else None

    def copy(self) -> _Route:
        other = _Route.__new__(_Route)
        other.ep, other.loc, other.opened, other.n = self.ep, self.loc, self.opened, self.n
        other.cmds = None if self.cmds is None else list(self.cmds)
        return other

    def _add(self, cmd: str) -> None:
        self.n += 1
        if self.cmds is not None:
            self.cmds.append(cmd)

    def _at(self, r: int) -> None:
        if self.loc != r:
            self._add(self.ep._room.go_cmds[r])
            self.loc = r

    def _open(self, r: int) -> None:
        if self.ep._closed[r] and r not in self.opened:
            self._add(f"open {self.ep._room.rnames[r]}")
            self.opened = self.opened | {r}

    def take(self, o: int, r: int) -> None:
        self._at(r)
        self._open(r)
        self._add(f"take {self.ep._room.onames[o]} from {self.ep._room.rnames[r]}")

    def put(self, o: int, r: int) -> None:
        self._at(r)
        self._open(r)
        self._add(f"put {self.ep._room.onames[o]} in/on {self.ep._room.rnames[r]}")

    def treat(self, o: int, app: int, verb: str) -> None:
        self._at(app)
        self._add(f"{verb} {self.ep._room.onames[o]} with {self.ep._room.rnames[app]}")

    def use(self, lamp: int, r: int) -> None:
        self._at(r)
        self._open(r)
        self._add(f"use {self.ep._room.onames[lamp]}")


def _fetch(route: _Route, o: int, held: int, where: Mapping[int, int]) -> None:
    """Get ``o`` into the agent's hands: put down what it holds where ``o`` lies (one put
    wherever it goes), then take ``o``."""
    if held == o:
        return
    if held >= 0:
        route.put(held, where[o])
    route.take(o, where[o])


def _deliver(route: _Route, o: int, held: int, where: Mapping[int, int]) -> list[_Route]:
    """Every way to bring ``o`` into a target receptacle, treated on the way if the task needs
    it: one route per choice of appliance and target instance."""
    ep, room = route.ep, route.ep._room
    _fetch(route, o, held, where)
    routes = [route]
    if room.transform is not None and not ep._props[o][room.prop_index]:
        verb, app_type, _ = room.transform
        routes = []
        for app, rt in enumerate(room.rtypes):
            if rt == app_type:
                treated = route.copy()
                treated.treat(o, app, verb)
                routes.append(treated)
    out = []
    for r in routes:
        for y, is_t in enumerate(room.is_target):
            if is_t:
                placed = r.copy()
                placed.put(o, y)
                out.append(placed)
    return out


def _look_routes(route: _Route, held: int, where: Mapping[int, int]) -> list[_Route]:
    """LOOK: hold an X while a desklamp is on, in either order."""
    ep, room = route.ep, route.ep._room
    holding_x = held >= 0 and room.is_goal_obj[held]
    xs = [held] if holding_x else [o for o in where if room.is_goal_obj[o]]
    if any(ep._lamp_on):
        lamps: list[int] = [-1]
    else:
        lamps = [o for o in where if room.is_lamp[o]]
    out = []
    for o in xs:
        for lamp in lamps:
            for lamp_first in (False, True):
                r = route.copy()
                if lamp >= 0 and lamp_first:
                    r.use(lamp, where[lamp])
                _fetch(r, o, held, where)
                if lamp >= 0 and not lamp_first:
                    r.use(lamp, where[lamp])
                out.append(r)
    return out


def oracle_plan(ep: HouseholdEpisode) -> list[str] | None:
    """The shortest plan from ``ep``'s current state to its goal, knowing where everything is:
    [] when won, None when the goal cannot be reached.

    Every plan the goal allows is a few fixed steps (take, treat, put, use) at fixed places
    plus what getting there needs: a ``go to`` per change of place, an ``open`` per closed
    receptacle taken from or put into (once), and a put to free the hands. So enumerating the
    objects, appliances, target instances, lamps and orders, and building each route with
    exactly those steps, gives the minimum; the tests check it against breadth-first search.
    """
    if ep._won:
        return []
    route = _shortest_route(ep, commands=True)
    return None if route is None else route.cmds


def _shortest_route(ep: HouseholdEpisode, commands: bool) -> _Route | None:
    """:func:`oracle_plan`'s route (its commands kept only with ``commands``: counting them is
    faster), None when the goal cannot be reached."""
    room = ep._room
    where = {o: r for r, objs in enumerate(ep._contents) for o in objs}
    held = ep._holding
    if held >= 0:
        where[held] = -1
    start = _Route(ep, commands)
    gt = room.goal_type
    if gt == "LOOK":
        routes = _look_routes(start, held, where)
    else:
        def done(o: int) -> bool:
            return where[o] >= 0 and room.is_target[where[o]] and (
                room.transform is None or ep._props[o][room.prop_index])

        todo = [o for o in where if room.counts_for_goal[o] and not done(o)]
        placed = sum(room.counts_for_goal[o] and done(o) for o in where)
        need = 2 - placed if gt == "PICK2" else 1
        routes = []
        if need == 1:
            for o in todo:
                routes += _deliver(start.copy(), o, held, where)
        elif need == 2:
            # What the agent holds goes first: put down and taken again later costs more.
            for o1, o2 in itertools.permutations(todo, 2):
                if o2 == held:
                    continue
                for first in _deliver(start.copy(), o1, held, where):
                    routes += _deliver(first, o2, -1, where)
    return min(routes, key=lambda r: r.n) if routes else None


# --------------------------------------------------------------------------------------------
# Expert
# --------------------------------------------------------------------------------------------

#: Thought phrasings, several per situation; the expert picks one with the task's RNG.
_PLAN = (
    "To solve the task, I need to {steps}.",
    "My plan: {steps}.",
    "The task requires me to {steps}.",
    "I should {steps}.",
)
# Search thoughts list every likely place still unchecked, in order, so the next place to go
# is always the first of a list in a recent thought (a copy, not a recall from the first turn).
_FIRST_SEARCH = (
    ("First I need to find {a_x}. The likely places are {left}. "
     "I can check one by one, starting with {r}."),
    "First, I look for {a_x}; it is usually in {left}. I will start with {r}.",
    "To begin, I need {a_x}. Likely places are {left}, so I go to {r} first.",
)
_CLOSED = ("The {r} is closed.", "I find the {r} closed.", "The {r} is shut.")
_NOTHING_HERE = (
    "The {r} has nothing useful.",
    "There is no {x} {prep} the {r}.",
    "No {x} here.",
    "I do not see {a_x} {prep} the {r}.",
)
_EMPTY_HERE = ("The {r} is empty.", "There is nothing {prep} the {r}.", "Nothing here.")
# Search steps name what is searched for, so the sub-goal is always in the latest thought.
_NEXT_CHECK = (
    "Places left to check for {a_x}: {left}. Next I will check {r}.",
    "I still need to check {left} for {a_x}. Let me look in {r} next.",
    "Remaining places for {a_x}: {left}. I will go to {r}.",
)
_FALLBACK_CHECK = (
    "I have checked the likely places, so I will look for {a_x} in {r}.",
    "None of the usual places had {a_x}; I will look at {r}.",
)
_OPEN_IT = ("I will open it to look for {a_x}.", "Let me open it and look for {a_x}.",
            "I need to open it to see if {a_x} is inside.")
_SEE_IT = ("I see {x} here.", "Now I find {a_kind} ({x}).", "There is {x} here.")
_TAKE_IT = ("I will take it.", "Next, I need to take it.", "Let me pick it up.")
_ALSO_LAMP = ("I also notice {lamp} here, which I will need later.",
              "There is {lamp} here too; I will remember it.")
_ALSO_X = ("There is also {x2} here; I will come back for it.",
           "I will remember {x2} for later.")
# After a take, the rest of the plan is restated (what is left to do with the object).
_HAVE = ("Now I have {x}; next I {rest}.", "I picked up {x}. What is left: {rest}.",
         "Now I take {x}, and I still need to {rest}.")
_GO_APPLIANCE = (
    "Next, I need to go to {app} and {verb} it.",
    "Now I need to {verb} it with {app}.",
    "I will take it to {app} to {verb} it.",
)
_DO_TRANSFORM = (
    "I am at {app}. Now I {verb} the {x}.",
    "Now I can {verb} the {x} with {app}.",
    "Let me {verb} the {x} here.",
)
_TRANSFORMED = ("The {x} is now {adj}.", "Now I {verb} {x}.", "Done: {x} is {adj}.")
_GO_TARGET = (
    "Next, I need to put it {prep} {y}. I will go to {y1}.",
    "I will go to {y1} to put it there.",
    "I will bring it to {y1}.",
)
_OPEN_TARGET = ("The {y1} is closed, so I will open it first.",
                "I must open {y1} before putting anything in it.",
                "The {y1} is shut; let me open it.")
_PUT_IT = ("Now I put the {x} {prep} {y1}.", "I will put {x} {prep} {y1}.",
           "Let me put the {x} {prep} the {y1}.")
_PUT_DONE = ("I put {x} {prep} {y1}.", "Now {x} is {prep} {y1}.", "The first {kind} is placed.")
_SECOND_KNOWN = (
    "Next, I need a second {kind}. I remember seeing {x2} at {r}, so I will go back there.",
    "Now I need another {kind}; {x2} was at {r}.",
    "For the second {kind}, I go back to {r}, where I saw {x2}.",
)
_SECOND_SEARCH = (
    ("Next, I need to find a second {kind}. I have not seen another one yet; places left to "
     "check: {left}. Next is {r}."),
    "Now I need another {kind}. I will keep searching {left}, starting with {r}.",
    "I still need a second {kind}, so I continue with {left}, first {r}.",
)
_GO_BACK = ("I will go back to {r} to take {x}.", "Let me return to {r} for {x}.")
_LAMP_KNOWN = (
    "Next, I need to use the desklamp. I saw {lamp} at {r}, so I will go there.",
    "Now I go to {r}, where I saw {lamp}.",
)
_LAMP_SEARCH = (
    ("Next, I need to find a desklamp. The likely places are {left}. "
     "I will check {r}."),
    "Now I need a desklamp; it is usually in {left}. Let me try {r}.",
)
_USE_LAMP = ("Now I find {lamp}. Next, I need to turn it on.",
             "I will turn on {lamp} while holding the {x}.",
             "Let me use {lamp}.")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _prep(rtype: str) -> str:
    return "in" if rtype in CONTAINER_TYPES else "on"


class _Expert:
    """A prior-order searcher that remembers what it has seen.

    It reads the episode state only where the agent has observed it (the receptacle it stands
    at, once open), so its choices are a function of the observation history. The search order
    is the object type's prior (all instances of each type, skipping the target type where
    the goal object never starts), then, as a guarantee only, every other receptacle.
    """

    def __init__(self, ep: HouseholdEpisode, rng: random.Random) -> None:
        self.ep = ep
        self.rng = rng
        room = ep._room
        self.room = room
        self.x = room.goal_object
        self.y = room.goal_target
        n = len(room.rnames)
        self.seen: dict[int, list[int]] = {}
        self.last: tuple[int, int] | None = None
        prior = [t for t in PRIORS[self.x] if t != self.y]
        self.x_order = self._order(prior)
        self.n_prior_x = sum(room.rtypes.count(t) for t in prior)
        self.lamp_order = self._order(PRIORS[LAMP])
        self.n_prior_lamp = sum(room.rtypes.count(t) for t in PRIORS[LAMP])
        self.y1 = next((i for i in range(n) if room.rtypes[i] == self.y), -1)
        app = room.transform[1] if room.transform else ""
        self.app = next((i for i in range(n) if room.rtypes[i] == app), -1)
        self.placed = 0
        self.last_put = -1

    def _order(self, prior_types: Sequence[str]) -> list[int]:
        room = self.room
        first = [i for t in prior_types for i, rt in enumerate(room.rtypes) if rt == t]
        # Fallback only: the rest of the room, target-type receptacles last (the generator
        # never starts the goal object there).
        rest = [i for i, rt in enumerate(room.rtypes) if i not in first and rt != self.y]
        last = [i for i, rt in enumerate(room.rtypes) if i not in first and rt == self.y]
        return first + rest + last

    def _pick(self, options: Sequence[str], **kw: str) -> str:
        return options[self.rng.randrange(len(options))].format(**kw)

    # ---- what the agent knows ------------------------------------------------------------
    def _observe(self) -> bool:
        """Record the current receptacle's contents if visible; True if newly seen."""
        ep = self.ep
        loc = ep._loc
        if loc >= 0 and not ep._closed[loc]:
            new = loc not in self.seen
            self.seen[loc] = list(ep._contents[loc])
            return new
        return False

    def _known(self, want: str) -> tuple[int, int] | None:
        """(receptacle, object) of a seen ``want`` object that still needs to be used."""
        room = self.room
        for r, objs in self.seen.items():
            if want != LAMP and room.is_target[r]:
                continue
            for o in objs:
                if room.otypes[o] == want:
                    return r, o
        return None

    def _next_unseen(self, order: Sequence[int]) -> int:
        for r in order:
            if r not in self.seen:
                return r
        raise RuntimeError(f"expert: nowhere left to search in task {self.ep.task.task_id}")

    # ---- one decision --------------------------------------------------------------------
    def act(self) -> tuple[str, str]:
        """(thought, command) for the current state."""
        ep, room = self.ep, self.room
        newly_seen = self._observe()
        loc, held = ep._loc, ep._holding
        say: list[str] = []
        x = self.x
        gt = room.goal_type
        last = self.last

        # Reflection on what the last action showed.
        if last is None:
            say.append(self._pick(_PLAN, steps=self._steps()))
        elif last[0] in (_GO, _OPEN) and loc >= 0:
            rname = room.rnames[loc]
            if ep._closed[loc]:
                if self._searching(held):
                    say.append(self._pick(_CLOSED, r=rname))
            elif newly_seen and self._searching(held):
                want = x if not (held >= 0 and room.is_goal_obj[held]) else LAMP
                lamp_here = gt == "LOOK" and any(room.is_lamp[o] for o in ep._contents[loc])
                if not any(room.otypes[o] == want for o in ep._contents[loc]):
                    opts = _EMPTY_HERE if not ep._contents[loc] else _NOTHING_HERE
                    if lamp_here:  # the lamp is useful, so not "nothing useful"
                        opts = _NOTHING_HERE[1:]
                    say.append(self._pick(opts, r=rname, x=want, a_x=_a(want),
                                          prep=_prep(room.rtypes[loc])))
                if lamp_here and want == x:
                    lamp = next(o for o in ep._contents[loc] if room.is_lamp[o])
                    say.append(self._pick(_ALSO_LAMP, lamp=room.onames[lamp]))
        elif last[0] == _TAKE:
            say.append(self._pick(_HAVE, x=room.onames[held], rest=self._rest()))
        elif last[0] in (_CLEAN, _HEAT, _COOL):
            verb, _, adj = room.transform  # type: ignore[misc]
            say.append(self._pick(_TRANSFORMED, x=room.onames[held], adj=adj, verb=verb))
        elif last[0] == _PUT:
            o = self.last_put
            say.append(self._pick(_PUT_DONE, x=room.onames[o], prep=_prep(self.y),
                                  y1=room.rnames[self.y1], kind=x))

        cmd = self._decide(say)
        thought = " ".join(say)
        return thought, cmd

    def _searching(self, held: int) -> bool:
        room = self.room
        if held < 0:
            return True
        return room.goal_type == "LOOK" and self._known(LAMP) is None

    def _steps(self) -> str:
        room, x = self.room, self.x
        prep, y = _prep(self.y), self.y
        gt = room.goal_type
        if gt == "LOOK":
            return f"find and take {_a(x)}, then find and use a desklamp"
        if gt == "PICK2":
            return (f"find and take the first {x}, then put it {prep} {y}, then find and take "
                    f"the second {x}, then put it {prep} {y}")
        if room.transform:
            verb, app, _ = room.transform
            return f"find and take {_a(x)}, then {verb} it with {app}, then put it {prep} {y}"
        return f"find and take {_a(x)}, then put it {prep} {y}"

    def _rest(self) -> str:
        """What is left of the plan once an X is in hand."""
        room, prep, y = self.room, _prep(self.y), self.y
        if room.goal_type == "LOOK":
            return "find and use a desklamp"
        if room.transform:
            verb, app, _ = room.transform
            return f"{verb} it with {app}, then put it {prep} {y}"
        return f"put it {prep} {y}"

    def _go(self, r: int) -> str:
        self.last = (_GO, r)
        return self.room.go_cmds[r]

    def _decide(self, say: list[str]) -> str:
        ep, room = self.ep, self.room
        loc, held = ep._loc, ep._holding
        holding_x = held >= 0 and room.is_goal_obj[held]

        if not holding_x:
            return self._fetch(say)
        if room.goal_type == "LOOK":
            known = self._known(LAMP)
            if known is not None:
                r, lamp = known
                if loc == r:
                    say.append(self._pick(_USE_LAMP, lamp=room.onames[lamp], x=room.onames[held]))
                    self.last = (_USE, lamp)
                    return f"use {room.onames[lamp]}"
                if self.last is not None and self.last[0] == _TAKE:
                    say.append(self._pick(_LAMP_KNOWN, lamp=room.onames[lamp],
                                          r=room.rnames[r]))
                else:
                    say.append(self._pick(_NEXT_CHECK, r=room.rnames[r], a_x=_a(LAMP)))
                return self._go(r)
            if loc >= 0 and ep._closed[loc] and loc not in self.seen:
                say.append(self._pick(_OPEN_IT, a_x=_a(LAMP)))
                self.last = (_OPEN, loc)
                return f"open {room.rnames[loc]}"
            r = self._next_unseen(self.lamp_order)
            if self.last is not None and self.last[0] == _TAKE:
                say.append(self._pick(_LAMP_SEARCH, r=room.rnames[r],
                                      left=self._left(self.lamp_order, self.n_prior_lamp)))
            else:
                say.append(self._pick(self._check_opts(r, self.lamp_order, self.n_prior_lamp),
                                      r=room.rnames[r], a_x=_a(LAMP),
                                      left=self._left(self.lamp_order, self.n_prior_lamp)))
            return self._go(r)

        hname = room.onames[held]
        if room.transform and not ep._props[held][room.prop_index]:
            verb, _, _ = room.transform
            app = room.rnames[self.app]
            if loc == self.app:
                say.append(self._pick(_DO_TRANSFORM, app=app, verb=verb, x=hname))
                self.last = ({"clean": _CLEAN, "heat": _HEAT, "cool": _COOL}[verb], loc)
                return f"{verb} {hname} with {app}"
            say.append(self._pick(_GO_APPLIANCE, app=app, verb=verb))
            return self._go(self.app)
        y1 = room.rnames[self.y1]
        prep = _prep(self.y)
        if loc != self.y1:
            say.append(self._pick(_GO_TARGET, prep=prep, y=self.y, y1=y1))
            return self._go(self.y1)
        if ep._closed[loc]:
            say.append(self._pick(_OPEN_TARGET, y1=y1))
            self.last = (_OPEN, loc)
            return f"open {y1}"
        say.append(self._pick(_PUT_IT, x=hname, prep=prep, y1=y1))
        self.last = (_PUT, loc)
        self.last_put = held
        self.placed += 1
        return f"put {hname} in/on {y1}"

    def _left(self, order: Sequence[int], n_prior: int) -> str:
        """The likely places (the first ``n_prior`` of ``order``) not yet seen, in order."""
        return ", ".join(self.room.rnames[r] for r in order[:n_prior] if r not in self.seen)

    def _check_opts(self, r: int, order: Sequence[int], n_prior: int) -> tuple[str, ...]:
        return _NEXT_CHECK if order.index(r) < n_prior else _FALLBACK_CHECK

    def _fetch(self, say: list[str]) -> str:
        """Hands empty: get to an X (a remembered one, else the next place to search), take it."""
        ep, room = self.ep, self.room
        loc = ep._loc
        x = self.x
        known = self._known(x)
        after_put = self.last is not None and self.last[0] == _PUT
        if known is not None:
            r, o = known
            if loc == r:
                say.append(self._pick(_SEE_IT, x=room.onames[o], a_kind=_a(x)))
                others = [p for p in ep._contents[loc] if room.otypes[p] == x and p != o]
                if room.goal_type == "PICK2" and self.placed == 0 and others:
                    say.append(self._pick(_ALSO_X, x2=room.onames[others[0]]))
                say.append(self._pick(_TAKE_IT))
                self.last = (_TAKE, o)
                return f"take {room.onames[o]} from {room.rnames[r]}"
            if after_put:
                say.append(self._pick(_SECOND_KNOWN, kind=x, x2=room.onames[o],
                                      r=room.rnames[r]))
            else:
                say.append(self._pick(_GO_BACK, r=room.rnames[r], x=room.onames[o]))
            return self._go(r)
        if loc >= 0 and ep._closed[loc] and loc not in self.seen:
            say.append(self._pick(_OPEN_IT, a_x=_a(x)))
            self.last = (_OPEN, loc)
            return f"open {room.rnames[loc]}"
        r = self._next_unseen(self.x_order)
        left = self._left(self.x_order, self.n_prior_x)
        if self.last is None:
            say.append(self._pick(_FIRST_SEARCH, a_x=_a(x), r=room.rnames[r], left=left))
        elif after_put:
            say.append(self._pick(_SECOND_SEARCH if left else _FALLBACK_CHECK, kind=x,
                                  r=room.rnames[r], a_x=_a(x), left=left))
        else:
            say.append(self._pick(self._check_opts(r, self.x_order, self.n_prior_x),
                                  r=room.rnames[r], a_x=_a(x), left=left))
        return self._go(r)


def _slip_command(ep: HouseholdEpisode, rng: random.Random) -> str | None:
    """A plausible command that does nothing here: taking an object that is not there (often
    one that looks like the goal), opening what is open, going where the agent already is, or
    putting something not held. ``None`` if no such command is found."""
    room = ep._room
    loc = ep._loc
    if loc < 0:
        return None
    here = room.rnames[loc]
    similar = [t for t in PRIORS if PRIORS[t][:2] == PRIORS[room.goal_object][:2]]
    obj = f"{rng.choice(similar or [room.goal_object])} {rng.randint(1, 3)}"
    candidates = [f"take {obj} from {here}", f"open {here}", f"go to {here}",
                  f"put {obj} in/on {here}"]
    admissible = set(ep.admissible_commands())
    options = [c for c in candidates if c not in admissible]
    return rng.choice(options) if options else None


def play_expert(ep: HouseholdEpisode, slip_rate: float = 0.0) -> ExpertEpisode:
    """Reset ``ep`` and play it to the end with the expert.

    With ``slip_rate > 0`` the expert sometimes issues a plausible inadmissible command, sees
    ``Nothing happens.`` and recovers on the next turn (:class:`Slips`).
    """
    slips = Slips(slip_rate, random.Random(ep.task.seed ^ 0x511B_5EED))
    obs = ep.reset()
    # Thought wording only; salted so it is independent of the generator's draws.
    expert = _Expert(ep, random.Random(ep.task.seed ^ 0x5EED_7A0C))
    turns: list[Turn] = []
    while not ep.done:
        if slips.due(len(turns)):
            cmd = _slip_command(ep, slips.rng)
            if cmd is not None:
                res = ep.step(cmd)
                turns.append(slips.turn(obs, cmd, res.admissible))
                obs = res.observation
                continue
        thought, cmd = expert.act()
        thought = slips.thought(thought)
        res = ep.step(cmd)
        turns.append(Turn(observation=obs, response=format_response(thought, cmd), action=cmd,
                          admissible=res.admissible))
        obs = res.observation
    return ExpertEpisode(task=ep.task, turns=tuple(turns), won=ep.won, score=ep.score,
                         final_observation=obs)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------

_OBJECT_MENTION = re.compile(r"\b(" + "|".join(sorted(PRIORS, key=len, reverse=True)) +
                             r") (\d+)\b")


def object_mentions(text: str) -> list[str]:
    """Object instances (``apple 2``) named in ``text``."""
    return [f"{m.group(1)} {m.group(2)}" for m in _OBJECT_MENTION.finditer(text)]


@register
class HouseholdEnv(Environment):
    """The built-in ALFWorld-style household (see the module docstring).

    Options:
        show_admissible: append ``"\\nAdmissible actions: a, b, c"`` to every observation
            (including ``Nothing happens.``). Default False.
    """

    name = "household"
    task_types = TASK_TYPES
    splits = SPLITS
    state_changing_verbs = ("take", "put", "open", "close", "clean", "heat", "cool", "use")
    command_grammar = (
        "go to {recep}",
        "open {recep}",
        "close {recep}",
        "take {obj} from {recep}",
        "put {obj} in/on {recep}",
        "clean {obj} with {recep}",
        "heat {obj} with {recep}",
        "cool {obj} with {recep}",
        "use {obj}",
        "examine {obj_or_recep}",
        "look",
        "inventory",
    )

    def _make_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        order = _type_order(seed, split)
        tasks = []
        for i in range(n):
            tt = order[i % len(order)]
            ts = task_seed(seed, split, i)
            spec = generate_spec(split, tt, ts)
            tasks.append(Task(
                task_id=f"household/{split}/{i:05d}", env=self.name, split=split,
                task_type=tt, instruction=spec["instruction"], seed=ts, spec=dump_spec(spec),
            ))
        return tasks

    def _start(self, task: Task) -> HouseholdEpisode:
        return HouseholdEpisode(task, self.max_turns, self.show_admissible)

    def expert_play(self, task: Task, slip_rate: float = 0.0) -> ExpertEpisode:
        return play_expert(self.start(task), slip_rate)
