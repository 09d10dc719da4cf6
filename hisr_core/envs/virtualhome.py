"""The ``virtualhome`` environment: VirtualHome activities as text, on the evolving-graph simulator.

VirtualHome (Puig et al., 2018) describes a home as a scene graph (nodes: rooms and objects
with properties and states; edges: ``INSIDE``, ``ON``, ``CLOSE``, ``FACING``, ``HOLDS_RH`` ...)
and household activities as *programs*: lines like ``[PUTBACK] <cup> (1.1000) <table> (1.231)``
in a fixed script vocabulary. Its symbolic simulator (the "evolving graph", no Unity) executes
script lines against the graph and refuses those whose preconditions fail. PyPI's
``virtualhome-eval`` (the Embodied Agent Interface release, MIT) bundles that simulator and 518
executable programs of one scene, each with its initial and final scene graph; this module plays
them as text episodes behind :mod:`hisr_core.envs.base`'s protocol. Install it with the
``virtualhome`` extra (``EXTRAS=virtualhome make install``).

A task is one program: its activity (``Watch TV``) and the program's own description form the
instruction; the goal is every object state and relation the final graph has and the initial
graph lacks (:func:`goal_conditions`); the score is the fraction of them that hold, and the
episode is won when all do. Commands are text in the simulator's vocabulary (``walk to
kitchen counter 1``, ``grab cup 1``, ``put cup 1 on table 1``, ``switch on television 1``,
:data:`COMMANDS`); each is translated to one script line and executed by the simulator, so
whatever it refuses answers ``Nothing happens.`` and is flagged inadmissible. The expert replays
the program's own lines with generated thoughts.

Decisions (where the benchmark leaves room):

* Objects are named ``<class words> <k>``: the class name with ``_`` as spaces and ``k`` the
  rank of the node id among the nodes of that class in the task's initial graph (``cup 2``);
  a room is named by its class alone when the scene has one of its kind. Walls, floors,
  ceilings, doors and windows (no program uses them) get no name and no command.
* Goal relations leave out ``CLOSE`` (proximity: every walk rewrites it, and the simulator's
  closeness is transitive one step, so it says where the agent stood, not what it did) and
  ``BETWEEN`` (door geometry); ``HOLDS_RH`` and ``HOLDS_LH`` count as one ``HOLDS``, since
  which hand is free depends only on the order of grabs. Programs whose goal is then empty
  (the program changes nothing but proximity) are not tasks.
* Observations say what the last command did and what the agent now sees: on entering a room,
  its furniture (visible nodes in the room that are on or in no other object); at an object or
  after opening it, what is on or in it (unless closed); after a grab, put or drop, what it
  holds. Nothing is listed that the agent could not see: contents of closed containers stay
  hidden, as in the simulator's own partial observation (``utils.get_visible_nodes``).
* Oracle distance: the number of goal conditions not met
  (:meth:`VirtualHomeEpisode.distance_to_goal`), a measure of progress, not a plan length.
* Splits: ``valid_unseen`` holds every program of the activities in :data:`UNSEEN_ACTIVITIES`
  (activity types never seen in training); the other programs go to ``valid_seen`` when the
  CRC-32 of their program id is divisible by 7, and to ``train`` otherwise. The task seed
  only orders a split.

Spec JSON (``Task.spec``, compact, sorted keys)::

    {"activity": "Watch TV", "goal": [["state", 171, "ON", -1], ["edge", 65, "FACING", 171]],
     "program": "1057_1", "scene": "TrimmedTestScene1_graph", "v": 1}
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import random
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hisr_core.agent.react import format_response
from hisr_core.envs.base import (
    Environment,
    ExpertEpisode,
    GoalEpisode,
    Task,
    Turn,
    register,
)

SPEC_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")
#: Activities held out for ``valid_unseen`` (80 programs): each has kin in train (watching TV,
#: browsing the internet, brushing teeth, cooking, relaxing, washing hands) but its own steps.
UNSEEN_ACTIVITIES: tuple[str, ...] = (
    "Change TV channel", "Write an email", "Wash teeth", "Make coffee", "Go to sleep",
    "Take shower",
)
#: The 26 activities of the bundled programs, in report order (train ones first).
ACTIVITIES: tuple[str, ...] = (
    "Browse internet", "Brush teeth", "Cook some food", "Drink", "Get some water",
    "Go to toilet", "Listen to music", "Pet cat", "Pick up phone", "Put groceries in Fridge",
    "Read book", "Relax on sofa", "Set up table", "Turn on light", "Wash clothes",
    "Wash dishes by hand", "Wash dishes with dishwasher", "Wash hands", "Watch TV", "Work",
    *UNSEEN_ACTIVITIES,
)
#: Graph categories that are scenery, not objects: no name, no command.
SCENERY: frozenset[str] = frozenset(
    {"Walls", "Ceiling", "Floor", "Floors", "Doors", "Windows", "Characters"})
#: Relations a goal may ask for (HOLDS stands for HOLDS_RH or HOLDS_LH); see the module notes.
GOAL_RELATIONS: frozenset[str] = frozenset({"ON", "INSIDE", "FACING", "SITTING", "HOLDS"})
_HANDS = ("HOLDS_RH", "HOLDS_LH")

_DATASET = "dataset/programs_processed_precond_nograb_morepreconds"
_INTENTIONS = "results_intentions_march-13-18"
SCENE = "TrimmedTestScene1_graph"
_MISSING = ("environment 'virtualhome' needs the virtualhome-eval package: install the project "
            "with the virtualhome extra (EXTRAS=virtualhome make install, or "
            "pip install -e '.[virtualhome]')")


def task_type_of(activity: str) -> str:
    """The task type code of an activity: ``Watch TV`` -> ``WATCH_TV``."""
    return re.sub(r"[^A-Z0-9]+", "_", activity.upper()).strip("_")


TASK_TYPES: tuple[str, ...] = tuple(task_type_of(a) for a in ACTIVITIES)


# --------------------------------------------------------------------------------------------
# Commands: text templates <-> script actions
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    """One command template: its text (``{x}``, ``{y}``: object names) and the script action."""

    template: str
    action: str

    @property
    def arity(self) -> int:
        return self.template.count("{")


#: The text vocabulary: every script action the bundled programs use, one template each.
COMMANDS: tuple[Command, ...] = tuple(Command(t, a) for t, a in (
    ("walk to {x}", "WALK"), ("run to {x}", "RUN"), ("find {x}", "FIND"),
    ("turn to {x}", "TURNTO"), ("look at {x}", "LOOKAT"), ("point at {x}", "POINTAT"),
    ("grab {x}", "GRAB"), ("put {x} on {y}", "PUTBACK"), ("put {x} in {y}", "PUTIN"),
    ("put back {x}", "PUTOBJBACK"), ("drop {x}", "DROP"), ("pour {x} into {y}", "POUR"),
    ("open {x}", "OPEN"), ("close {x}", "CLOSE"), ("switch on {x}", "SWITCHON"),
    ("switch off {x}", "SWITCHOFF"), ("plug in {x}", "PLUGIN"), ("plug out {x}", "PLUGOUT"),
    ("sit on {x}", "SIT"), ("lie on {x}", "LIE"), ("stand up", "STANDUP"), ("sleep", "SLEEP"),
    ("wake up", "WAKEUP"), ("touch {x}", "TOUCH"), ("type on {x}", "TYPE"),
    ("push {x}", "PUSH"), ("pull {x}", "PULL"), ("wipe {x}", "WIPE"), ("wash {x}", "WASH"),
    ("rinse {x}", "RINSE"), ("scrub {x}", "SCRUB"), ("squeeze {x}", "SQUEEZE"),
    ("read {x}", "READ"), ("watch {x}", "WATCH"), ("drink {x}", "DRINK"),
    ("put on {x}", "PUTON"), ("take off {x}", "PUTOFF"),
))
_BY_ACTION: dict[str, Command] = {c.action: c for c in COMMANDS}
_PATTERNS: tuple[tuple[re.Pattern[str], Command], ...] = tuple(
    (re.compile("^" + re.escape(c.template).replace(r"\{x\}", "(?P<x>.+)")
                .replace(r"\{y\}", "(?P<y>.+)") + "$"), c)
    for c in COMMANDS
)
#: Script actions whose first object must be in the agent's hands (the text rule: you put,
#: drop or pour only what you hold; the admissible list is built under the same rule).
HELD_FIRST: frozenset[str] = frozenset({"PUTBACK", "PUTIN", "POUR", "DROP"})

_LINE = re.compile(r"^\[(\w+)\]((?:\s*<[^>]+>\s*\([^)]+\))*)\s*$")
_ARG = re.compile(r"<([^>]+)>\s*\(([^)]+)\)")


def parse_program_line(line: str) -> tuple[str, tuple[int, ...]]:
    """``[PUTBACK] <cup> (1.1000) <table> (1.231)`` -> ``("PUTBACK", (1000, 231))``: the
    action and the node ids (the part after the dot of each ``(scene.id)``)."""
    m = _LINE.match(line.strip())
    if m is None:
        raise ValueError(f"not a program line: {line!r}")
    ids = tuple(int(inst.rsplit(".", 1)[-1]) for _, inst in _ARG.findall(m.group(2)))
    return m.group(1).upper(), ids


# --------------------------------------------------------------------------------------------
# Goals: what the final graph has that the initial graph lacks
# --------------------------------------------------------------------------------------------

Condition = tuple[str, int, str, int]
"""``("state", node, STATE, -1)`` or ``("edge", from, RELATION, to)``."""


def _relation(name: str) -> str:
    return "HOLDS" if name in _HANDS else name


def goal_conditions(init: Mapping[str, Any], final: Mapping[str, Any]) -> list[Condition]:
    """The goal of a program: every node state and every relation in :data:`GOAL_RELATIONS`
    that ``final`` has and ``init`` lacks (graphs as ``{"nodes": [...], "edges": [...]}``).

    States come first (by node id, then name), then relations (by from, relation, to); hands
    are merged, so a ``HOLDS_LH`` cup in ``final`` is met by a ``HOLDS_RH`` one in ``init``.
    """
    before = {n["id"]: set(n["states"]) for n in init["nodes"]}
    states = sorted(
        {(n["id"], s) for n in final["nodes"] for s in n["states"]
         if s not in before.get(n["id"], ())}
    )
    edges_before = {(e["from_id"], _relation(e["relation_type"]), e["to_id"])
                    for e in init["edges"]}
    edges = sorted(
        {(e["from_id"], r, e["to_id"]) for e in final["edges"]
         if (r := _relation(e["relation_type"])) in GOAL_RELATIONS}
        - edges_before
    )
    return ([("state", i, s, -1) for i, s in states]
            + [("edge", a, r, b) for a, r, b in edges])


def conditions_met(goal: Sequence[Condition], states: Callable[[int], set[str]],
                   has_edge: Callable[[int, str, int], bool]) -> list[bool]:
    """Which goal conditions hold, given the node states and the edges of a graph
    (``has_edge(a, "HOLDS", b)`` must accept either hand)."""
    return [s in states(a) if kind == "state" else has_edge(a, s, b) for kind, a, s, b in goal]


# --------------------------------------------------------------------------------------------
# The bundled programs
# --------------------------------------------------------------------------------------------


def _package() -> Any:
    try:
        return importlib.import_module("virtualhome_eval")
    except ImportError:
        raise ImportError(_MISSING) from None


@functools.cache
def dataset_root() -> Path:
    """The programs and graphs bundled with ``virtualhome-eval``."""
    return Path(_package().__file__).parent / _DATASET


def program_path(scene: str, program: str) -> Path:
    return dataset_root() / "executable_programs" / scene / _INTENTIONS / f"file{program}.txt"


def graph_path(scene: str, program: str) -> Path:
    return dataset_root() / "init_and_final_graphs" / scene / _INTENTIONS / f"file{program}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class Program:
    """One program file: activity, description and script lines."""

    program: str
    activity: str
    description: str
    lines: tuple[str, ...]

    @property
    def instruction(self) -> str:
        desc = " ".join(self.description.split())
        return f"{self.activity}. {desc}".rstrip(". ") + "." if desc else f"{self.activity}."


def read_program(scene: str, program: str) -> Program:
    """A program file: activity on line 1, description on line 2, then ``[ACTION]`` lines."""
    text = program_path(scene, program).read_text(encoding="utf-8").splitlines()
    if len(text) < 2:
        raise ValueError(f"program {program!r} of {scene!r} has no activity/description")
    lines = tuple(line.strip() for line in text[2:] if line.strip().startswith("["))
    return Program(program, text[0].strip(), text[1].strip(), lines)


def load_graphs(scene: str, program: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(initial graph, final graph) of a program as dicts (read each time: the 518 files
    take 370 MB, too much to keep)."""
    data = json.loads(graph_path(scene, program).read_text(encoding="utf-8"))
    return data["init_graph"], data["final_graph"]


@functools.cache
def program_index(scene: str = SCENE) -> tuple[tuple[Program, tuple[Condition, ...]], ...]:
    """Every program of ``scene`` whose goal is not empty, with its goal, sorted by id
    (reads every graph once per process: ~3 s)."""
    folder = dataset_root() / "executable_programs" / scene / _INTENTIONS
    ids = sorted(p.stem.removeprefix("file") for p in folder.glob("file*.txt"))
    if not ids:
        raise FileNotFoundError(f"no programs under {folder}")
    out = []
    for pid in ids:
        prog = read_program(scene, pid)
        if prog.activity not in ACTIVITIES:
            raise ValueError(f"program {pid!r}: unknown activity {prog.activity!r}")
        goal = goal_conditions(*load_graphs(scene, pid))
        if goal:
            out.append((prog, tuple(goal)))
    return tuple(out)


def split_of(program: str, activity: str) -> str:
    """The split a program belongs to (module notes: unseen activities, then CRC-32 mod 7)."""
    if activity in UNSEEN_ACTIVITIES:
        return "valid_unseen"
    return "valid_seen" if zlib.crc32(program.encode()) % 7 == 0 else "train"


# --------------------------------------------------------------------------------------------
# Episode
# --------------------------------------------------------------------------------------------


def _words(class_name: str) -> str:
    return class_name.replace("_", " ")


def node_names(nodes: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """Text names of the nameable nodes (module notes): ``cup 2``; a unique room: ``bedroom``."""
    by_class: dict[str, list[int]] = {}
    rooms: set[str] = set()
    for n in nodes:
        if n["category"] in SCENERY:
            continue
        by_class.setdefault(n["class_name"], []).append(n["id"])
        if n["category"] == "Rooms":
            rooms.add(n["class_name"])
    names = {}
    for cls, ids in by_class.items():
        ids.sort()
        for k, i in enumerate(ids, 1):
            unique_room = cls in rooms and len(ids) == 1
            names[i] = _words(cls) if unique_room else f"{_words(cls)} {k}"
    return names


def _see(names: Sequence[str]) -> str:
    return ", ".join(names) if names else "nothing"


class VirtualHomeEpisode(GoalEpisode):
    """One play of a program's activity on the evolving-graph simulator (module notes)."""

    def __init__(self, task: Task, max_turns: int, show_admissible: bool = False) -> None:
        spec = json.loads(task.spec)
        if spec.get("v") != SPEC_VERSION:
            raise ValueError(f"task {task.task_id!r}: spec version {spec.get('v')!r}, "
                             f"expected {SPEC_VERSION}")
        self.task = task
        self.max_turns = max_turns
        self.show_admissible = show_admissible
        self.scene: str = spec["scene"]
        self.program: str = spec["program"]
        self.goal: tuple[Condition, ...] = tuple(tuple(c) for c in spec["goal"])  # type: ignore[misc]
        if not self.goal:
            raise ValueError(f"task {task.task_id!r} has an empty goal")
        self._sim = _simulator()
        init, _ = load_graphs(self.scene, self.program)
        self._init = init
        self.names = node_names(init["nodes"])
        self._ids = {name: i for i, name in self.names.items()}
        self._ready = False
        self._turns = 0
        self._won = False

    # ---- state -------------------------------------------------------------------------
    def reset(self) -> str:
        sim = self._sim
        graph = sim.EnvironmentGraph(self._init)
        self._state = sim.EnvironmentState(graph, sim.name_equivalence(), instance_selection=True)
        self._executor = sim.ScriptExecutor(graph, sim.name_equivalence())
        self._char = next(n.id for n in graph.get_nodes() if n.class_name == "character")
        self._rooms = {n.id for n in graph.get_nodes() if n.category == "Rooms"}
        self._supports = {n.id for n in graph.get_nodes()
                          if n.category not in SCENERY | {"Rooms", "Decor"}}
        missing = {i for c in self.goal for i in (c[1], c[3]) if i >= 0} - set(
            graph.get_node_ids())
        if missing:
            raise ValueError(f"task {self.task.task_id!r}: goal names nodes {sorted(missing)} "
                             "that the graph lacks")
        self._turns = 0
        self._won = False
        self._adm: list[str] | None = None
        self._ready = True
        self._check_won()
        room = self._room()
        intro = (f"You are in the {self.names[room]}. You see {_see(self._furniture(room))}."
                 f"\n\nYour task is to: {self.task.instruction}")
        return self._decorate(intro)

    def conditions(self) -> list[bool]:
        """Which goal conditions hold now (in the spec's order)."""
        return conditions_met(self.goal, self._states, self._has_edge)

    def distance_to_goal(self) -> int:
        """The number of goal conditions not met (0 when won). Not a plan length: one command
        can meet several conditions and one condition can take several commands (walk, open,
        then put in); but meeting a condition lowers it and undoing one raises it, which is
        what credit needs, and planning on the simulator would copy the scene graph for
        every command tried."""
        if not self._ready:
            raise RuntimeError("call reset() before distance_to_goal()")
        return len(self.goal) - sum(self.conditions())

    def _states(self, node: int) -> set[str]:
        return {s.name for s in self._state.get_node(node).states}

    def _has_edge(self, a: int, relation: str, b: int) -> bool:
        rel = self._sim.Relation
        names = _HANDS if relation == "HOLDS" else (relation,)
        na, nb = self._state.get_node(a), self._state.get_node(b)
        return any(self._state.has_edge(na, rel[r], nb) for r in names)

    def _check_won(self) -> None:
        self._won = all(self.conditions())

    def _related(self, node: int, relations: Sequence[str]) -> list[int]:
        rel = self._sim.Relation
        out: set[int] = set()
        for r in relations:
            out.update(self._state.get_node_ids_from(node, rel[r]))
        return sorted(out)

    def _room(self) -> int:
        return next(i for i in self._related(self._char, ("INSIDE",)) if i in self._rooms)

    def _held(self) -> list[int]:
        return self._related(self._char, _HANDS)

    def _hidden(self, node: int) -> bool:
        """Inside a closed container (not a room)."""
        return any(i not in self._rooms and "CLOSED" in self._states(i)
                   for i in self._related(node, ("INSIDE",)))

    def _furniture(self, room: int) -> list[str]:
        """What one sees on entering ``room``: visible named nodes in it that are on or in no
        other object (scenery and decor aside)."""
        rel = self._sim.Relation
        held = set(self._held())
        out = []
        for n in self._state.get_nodes():
            if n.id not in self.names or n.id in self._rooms or n.id in held:
                continue
            inside = self._state.get_node_ids_from(n.id, rel.INSIDE)
            if room not in inside or self._hidden(n.id):
                continue
            # Scenery and decor (a floor, a mat under the bed) are not places things are on.
            if any(i in self._supports for i in self._related(n.id, ("ON", "INSIDE"))):
                continue
            out.append(n.id)
        return [self.names[i] for i in sorted(out)]

    def _contents(self, node: int) -> str:
        """``On it you see ...`` / ``In it you see ...`` for an object (empty if nothing)."""
        if node in self._rooms:
            return f" You see {_see(self._furniture(node))}."
        if "CLOSED" in self._states(node):
            return " It is closed."
        rel = self._sim.Relation
        held = set(self._held())
        parts = []
        for r, word in ((rel.ON, "On"), (rel.INSIDE, "In")):
            objs = sorted(n.id for n in self._state.get_nodes()
                          if n.id in self.names and n.id not in held
                          and node in self._state.get_node_ids_from(n.id, r))
            if objs:
                parts.append(f" {word} it you see {_see([self.names[i] for i in objs])}.")
        return "".join(parts)

    def _holding(self) -> str:
        held = [self.names[i] for i in self._held() if i in self.names]
        return f" You hold {_see(held)}." if held else " Your hands are empty."

    # ---- commands ----------------------------------------------------------------------
    def parse(self, action: str) -> tuple[Command, tuple[int, ...]] | None:
        """The template and node ids of a command, or None if it names no known command or
        object."""
        key = " ".join(action.lower().split())
        for pattern, cmd in _PATTERNS:
            m = pattern.match(key)
            if m is None:
                continue
            ids = tuple(self._ids.get(m.group(g)) for g in ("x", "y")[: cmd.arity])
            if all(i is not None for i in ids):
                return cmd, ids  # type: ignore[return-value]
        return None

    def command_text(self, action: str, ids: Sequence[int]) -> str:
        """The text command of a script action on node ids (the expert's translation)."""
        cmd = _BY_ACTION.get(action)
        if cmd is None:
            raise ValueError(f"script action {action!r} has no text command")
        if len(ids) != cmd.arity:
            raise ValueError(f"{action} takes {cmd.arity} objects, got {len(ids)}")
        try:
            args = {k: self.names[i] for k, i in zip(("x", "y"), ids)}
        except KeyError as err:
            raise ValueError(f"node {err.args[0]} of task {self.task.task_id!r} has no name "
                             "(scenery)") from None
        return cmd.template.format(**args)

    def _line(self, cmd: Command, ids: Sequence[int]) -> Any:
        text = f"[{cmd.action}]" + "".join(f" <{self._state.get_node(i).class_name}> ({i})"
                                           for i in ids)
        return self._sim.Script([self._sim.parse_script_line(text, 0)])

    def _execute(self, cmd: Command, ids: Sequence[int]) -> Any | None:
        """The state after the command, or None if it is refused: by the text rule for held
        objects, or by the simulator. Executed on a copy; a dry run (``modify=False``) is not
        used because some executors answer it wrongly (``PUTOBJBACK`` yields nothing exactly
        when the put-back is possible)."""
        if cmd.action in HELD_FIRST and ids[0] not in self._held():
            return None
        try:
            ok, state = self._executor.execute_one_step(self._line(cmd, ids), self._state)
        except Exception:  # noqa: BLE001  (the simulator raises on unsupported combinations)
            return None
        return state if ok else None

    def admissible_commands(self) -> list[str]:
        if not self._ready:
            raise RuntimeError("call reset() before admissible_commands()")
        if self._adm is None:
            named = sorted(self.names)
            held = [i for i in self._held() if i in self.names]
            adm = []
            for cmd in COMMANDS:
                if cmd.arity == 0:
                    combos: list[tuple[int, ...]] = [()]
                elif cmd.arity == 1:
                    combos = [(i,) for i in (held if cmd.action in HELD_FIRST else named)]
                else:
                    combos = [(h, j) for h in held for j in named if j != h]
                for ids in combos:
                    if self._execute(cmd, ids) is not None:
                        adm.append(cmd.template.format(
                            **{k: self.names[i] for k, i in zip(("x", "y"), ids)}))
            self._adm = adm
        return list(self._adm)

    def _act(self, action: str) -> str | None:
        parsed = self.parse(action)
        state = self._execute(*parsed) if parsed is not None else None
        if state is None:
            return None
        self._state = state
        self._adm = None
        self._check_won()
        return self._describe(*parsed)

    def _describe(self, cmd: Command, ids: Sequence[int]) -> str:
        text = "You " + cmd.template.format(
            **{k: f"the {self.names[i]}" for k, i in zip(("x", "y"), ids)}) + "."
        if cmd.action in ("WALK", "RUN", "FIND", "OPEN"):
            text += self._contents(ids[0])
        elif cmd.action in ("GRAB", "DROP", "PUTBACK", "PUTIN", "PUTOBJBACK"):
            text += self._holding()
        return text


# --------------------------------------------------------------------------------------------
# The simulator (imported on first use, so the environment registers without the package)
# --------------------------------------------------------------------------------------------


class _Simulator:
    """The few simulator names this module uses, imported once."""

    def __init__(self) -> None:
        _package()
        env = importlib.import_module("virtualhome_eval.simulation.evolving_graph.environment")
        ex = importlib.import_module("virtualhome_eval.simulation.evolving_graph.execution")
        sc = importlib.import_module("virtualhome_eval.simulation.evolving_graph.scripts")
        self.EnvironmentGraph = env.EnvironmentGraph
        self.EnvironmentState = env.EnvironmentState
        self.Relation = env.Relation
        self.ScriptExecutor = ex.ScriptExecutor
        self.Script = sc.Script
        self.parse_script_line = sc.parse_script_line
        resources = Path(_package().__file__).parent / "resources"
        self._equivalence = json.loads(
            (resources / "class_name_equivalence.json").read_text(encoding="utf-8"))

    def name_equivalence(self) -> dict[str, list[str]]:
        return self._equivalence


@functools.cache
def _simulator() -> _Simulator:
    return _Simulator()


# --------------------------------------------------------------------------------------------
# Expert: the program's own lines, with generated thoughts
# --------------------------------------------------------------------------------------------

#: Thought phrasings per script action ({x}, {y}: object names); ``_ANY`` for the rest.
_THOUGHTS: dict[str, tuple[str, ...]] = {
    "WALK": ("I go to the {x}.", "Next I head to the {x}.", "I need to be at the {x}."),
    "RUN": ("I hurry to the {x}.", "I run to the {x}."),
    "FIND": ("I look for the {x}.", "Now I find the {x}.", "I need the {x}; let me find it."),
    "GRAB": ("I take the {x}.", "I pick up the {x}.", "Now I grab the {x}."),
    "PUTBACK": ("I put the {x} on the {y}.", "The {x} goes on the {y}."),
    "PUTIN": ("I put the {x} in the {y}.", "The {x} goes into the {y}."),
    "OPEN": ("I open the {x}.", "The {x} has to be open."),
    "CLOSE": ("I close the {x}.", "Now I shut the {x}."),
    "SWITCHON": ("I switch on the {x}.", "The {x} needs to be on."),
    "SWITCHOFF": ("I switch off the {x}.", "The {x} should be off now."),
    "SIT": ("I sit down on the {x}.", "Now I sit on the {x}."),
    "TURNTO": ("I turn to face the {x}.", "I face the {x}."),
    "LOOKAT": ("I look at the {x}.", "Let me look at the {x}."),
}
_ANY = ("Next: {cmd}.", "Now I {cmd}.", "I {cmd}.")
_OPENINGS = ("The task: {activity}.", "I want to {act}.", "My goal: {activity}.")


def _thought(rng: random.Random, action: str, names: Sequence[str], cmd: str) -> str:
    options = _THOUGHTS.get(action, _ANY)
    return rng.choice(options).format(**dict(zip(("x", "y"), names)), cmd=cmd)


def play_expert(ep: VirtualHomeEpisode) -> ExpertEpisode:
    """Reset ``ep`` and replay its program, one script line per turn, until it is done."""
    obs = ep.reset()
    prog = read_program(ep.scene, ep.program)
    digest = hashlib.sha256(f"virtualhome|thought|{ep.task.task_id}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    turns: list[Turn] = []
    for k, line in enumerate(prog.lines):
        if ep.done:
            break
        action, ids = parse_program_line(line)
        cmd = ep.command_text(action, ids)
        thought = _thought(rng, action, [ep.names[i] for i in ids], cmd)
        if k == 0:
            opening = rng.choice(_OPENINGS).format(activity=prog.activity.lower(),
                                                  act=prog.activity.lower())
            thought = f"{opening} {thought}"
        res = ep.step(cmd)
        turns.append(Turn(observation=obs, response=format_response(thought, cmd), action=cmd,
                          admissible=res.admissible))
        obs = res.observation
    return ExpertEpisode(task=ep.task, turns=tuple(turns), won=ep.won, score=ep.score,
                         final_observation=obs)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def dump_spec(spec: Mapping[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


@register
class VirtualHomeEnv(Environment):
    """VirtualHome activities on the evolving-graph simulator (see the module docstring).

    Options:
        show_admissible: append ``"\\nAdmissible actions: a, b, c"`` to every observation
            (slow: every command over every named object is checked by the simulator).
            Default False.
    """

    name = "virtualhome"
    task_types = TASK_TYPES
    splits = SPLITS
    state_changing_verbs = ("grab", "put", "drop", "pour", "open", "close", "switch", "plug",
                            "sit", "lie", "stand", "sleep", "wake", "push", "pull", "wipe",
                            "wash", "rinse", "scrub", "squeeze", "drink", "type", "take")
    command_grammar = tuple(
        c.template.replace("{x}", "{obj}").replace("{y}", "{obj}") for c in COMMANDS)
    def __init__(self, max_turns: int, **options: Any) -> None:
        super().__init__(max_turns, **options)
        self.require(_package)

    def _make_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        programs = [(p, g) for p, g in program_index(SCENE)
                    if split_of(p.program, p.activity) == split]
        digest = hashlib.sha256(f"virtualhome|order|{seed}|{split}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "big")).shuffle(programs)
        tasks = []
        for prog, goal in programs[:n]:
            spec = {"activity": prog.activity, "goal": [list(c) for c in goal],
                    "program": prog.program, "scene": SCENE, "v": SPEC_VERSION}
            tasks.append(Task(
                task_id=f"virtualhome/{split}/{prog.program}", env=self.name, split=split,
                task_type=task_type_of(prog.activity), instruction=prog.instruction,
                seed=seed, spec=dump_spec(spec),
            ))
        return tasks

    def _start(self, task: Task) -> VirtualHomeEpisode:
        return VirtualHomeEpisode(task, self.max_turns, self.show_admissible)

    def expert_play(self, task: Task, slip_rate: float = 0.0) -> ExpertEpisode:
        if slip_rate:
            raise ValueError("the virtualhome expert replays programs and cannot slip; "
                             "set expert.slip_rate: 0")
        return play_expert(self.start(task))
