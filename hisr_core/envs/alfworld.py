"""The ``alfworld`` environment: ALFWorld's text games (TextWorld on ALFRED scenes).

ALFWorld (Shridhar et al., 2020) turns ALFRED's household tasks into TextWorld games: one
folder per game with ``game.tw-pddl`` (the PDDL domain, problem and text grammar) and
``traj_data.json`` (task type and parameters); training games also carry ``gt_traj.json``, the
expert's recorded episode. This module plays those games behind :mod:`hisr_core.envs.base`'s
protocol with TextWorld's PDDL engine and ALFWorld's name demangler, the way ALFWorld's own
``AlfredTWEnv`` does, but one game per episode and without ALFWorld's config files: the only
setting is the data folder. Install the packages with the ``alfworld`` extra
(``EXTRAS=alfworld make install``) and unpack the game archives with
``python -m hisr_core.envs.alfworld_data`` (see that module).

Decisions (where the benchmark leaves room):

* Data layout: ``<data_dir>/json_2.1.1/<split>/<task folder>/<trial>/game.tw-pddl`` (as
  ``alfworld-download`` and :mod:`hisr_core.envs.alfworld_data` lay it out) and the PDDL
  domain and grammar under ``<data_dir>/logic``. ``Task.spec`` stores the game folder
  relative to ``data_dir``, so a task list stays valid when the data moves.
* Task type: from the task folder's name (``pick_clean_then_place_in_recep-...`` -> ``CLEAN``,
  :data:`FOLDER_TASK_TYPES`); the ``movable`` and ``Sliced`` variants are not among the games.
* Observations in the style of ETO's ALFWorld data (and of the ``household`` environment):
  the first drops TextWorld's welcome banner and keeps the room and the task line
  (``You are in the middle of a room. ...\\n\\nYour task is to: ...``); the others drop the
  ``You arrive at loc N.`` prefix the engine puts before what one sees at a place (the
  recorded expert episodes have no such prefix and the location number means nothing to the
  agent). The engine answers ``Nothing happens.`` to anything it cannot do; a command not in
  the admissible list is flagged inadmissible (``examine``, ``look`` and ``inventory`` are
  always admissible).
* Score: 1.0 when won, else 0.0 (the games give no partial credit).
* Splits: whatever folders exist under ``json_2.1.1`` among :data:`SPLITS`; the task seed
  only orders a split.
* Expert: the recorded ``gt_traj.json`` actions (``train`` games have them), with thoughts
  generated from the task's PDDL parameters and the observations (:func:`play_expert`). Games
  without one (the validation splits) follow the plan TextWorld's PDDL planner (Fast
  Downward) makes at reset: it knows where everything is, so it measures a ceiling and does
  not search; ``D_bc`` comes from ``train`` only, i.e. from the recorded, searching episodes.
* Oracle distance (option ``oracle``, off by default): the length of the plan the same
  planner makes from the current state, which it sees whole. ALFWorld's handcoded expert
  (``extra.expert_plan``) cannot serve: it names only its next command and searches. A plan
  takes 0.03 s near the goal but up to tens of seconds far from it in some games, 10 to 100
  times a step, so it is asked for only when wanted; plan lengths are kept per game and state
  in the process (:data:`PLAN_CACHE_SIZE`), since samples of a task revisit states. Off, the
  distance is :data:`~hisr_core.envs.base.UNKNOWN_DISTANCE` until the game is won.

Spec JSON (``Task.spec``, compact, sorted keys)::

    {"game": "json_2.1.1/train/pick_clean_then_place_in_recep-Apple-None-Fridge-1/trial_T1",
     "v": 1}
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hisr_core.agent.react import format_response
from hisr_core.envs.base import (
    NOTHING_HAPPENS,
    UNKNOWN_DISTANCE,
    Environment,
    Episode,
    ExpertEpisode,
    Slips,
    StepResult,
    Task,
    Turn,
    register,
)

SPEC_VERSION = 1
ROOT = "json_2.1.1"
SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen", "valid_train")
#: Task types in report order, as ALFWorld's papers list them.
TASK_TYPES: tuple[str, ...] = ("PICK", "CLEAN", "HEAT", "COOL", "LOOK", "PICK2")
#: The task folder's name prefix -> task type.
FOLDER_TASK_TYPES: dict[str, str] = {
    "pick_and_place_simple": "PICK",
    "pick_clean_then_place_in_recep": "CLEAN",
    "pick_heat_then_place_in_recep": "HEAT",
    "pick_cool_then_place_in_recep": "COOL",
    "look_at_obj_in_light": "LOOK",
    "pick_two_obj_and_place": "PICK2",
}
GAME_FILE = "game.tw-pddl"
EXPERT_FILE = "gt_traj.json"
_ARRIVE = re.compile(r"^You arrive at loc \d+\.\s*")
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_LINE = re.compile(r"Your task is to:[ \t]*([^\n]+)")
#: The goal sentence as the game file's text grammar spells it (the intro's ``#task#`` symbol).
_GRAMMAR_TASK = re.compile(
    r'"task"\s*:\s*\[\s*\{\s*"rhs"\s*:\s*"(Your task is to:[^"#\\]*)"\s*\}\s*\]')
_MISSING = ("environment 'alfworld' needs the alfworld package: install the project with the "
            "alfworld extra (EXTRAS=alfworld make install, or pip install -e '.[alfworld]')")
#: Oracle plan lengths kept per process, by (game file, state digest).
PLAN_CACHE_SIZE = 100_000
_PLAN_LENGTHS: collections.OrderedDict[tuple[str, bytes], int] = collections.OrderedDict()


def task_type_of(folder: str) -> str:
    """The task type of a task folder name (``pick_two_obj_and_place-Book-None-Sofa-201``)."""
    prefix = folder.split("-", 1)[0]
    try:
        return FOLDER_TASK_TYPES[prefix]
    except KeyError:
        raise ValueError(f"game folder {folder!r} is of no known ALFWorld task type; known "
                         f"prefixes: {sorted(FOLDER_TASK_TYPES)}") from None


def game_dirs(data_dir: Path, split: str) -> list[Path]:
    """Every game folder of ``split`` under ``data_dir``, sorted by path (stable order)."""
    root = data_dir / ROOT / split
    if not root.is_dir():
        raise ValueError(f"no ALFWorld games for split {split!r}: {root} does not exist; unpack "
                         "the archives with python -m hisr_core.envs.alfworld_data")
    return sorted(p.parent for p in root.glob(f"*/*/{GAME_FILE}"))


def read_expert_actions(game_dir: Path) -> tuple[str, list[str]]:
    """The first observation and the actions of a game's recorded expert episode."""
    path = game_dir / EXPERT_FILE
    if not path.is_file():
        raise ValueError(f"game {game_dir.name} has no recorded expert episode ({EXPERT_FILE}); "
                         "only train games have one")
    msgs = json.loads(path.read_text(encoding="utf-8"))
    if not msgs or msgs[0].get("from") != "human":
        raise ValueError(f"{path} does not start with the initial observation")
    return msgs[0]["value"], [m["value"].strip() for m in msgs[1:] if m.get("from") == "gpt"]


def instruction_of(first_observation: str) -> str:
    """The goal from an initial observation (``Your task is to: put ...`` -> ``put ...``)."""
    m = _TASK_LINE.search(first_observation)
    if m is None:
        raise ValueError("the initial observation has no 'Your task is to:' line")
    return m.group(1).strip().rstrip(".")


def grammar_instruction(game_dir: Path) -> str | None:
    """The goal of a game read from its file's text grammar (what the first observation's
    ``Your task is to:`` line prints, without starting the engine); None where the grammar
    spells it with template symbols."""
    grammar = json.loads((game_dir / GAME_FILE).read_text(encoding="utf-8")).get("grammar", "")
    m = _GRAMMAR_TASK.search(grammar)
    return instruction_of(m.group(1)) if m else None


def clean_observation(obs: str, first: bool = False) -> str:
    """An engine observation in the project's (ETO) style; see the module notes."""
    obs = obs.strip()
    if first:
        obs = obs.replace(_BANNER, "").strip()
    return _ARRIVE.sub("", obs)


# --------------------------------------------------------------------------------------------
# The engine (imported on first use, so the environment registers without the package)
# --------------------------------------------------------------------------------------------


@functools.cache
def _engine() -> tuple[Any, Any, Any]:
    """(textworld, textworld.gym, ALFWorld's demangler wrapper), imported once."""
    try:
        importlib.import_module("alfworld")
        tw = importlib.import_module("textworld")
        gym = importlib.import_module("textworld.gym")
        alfred = importlib.import_module("alfworld.agents.environment.alfred_tw_env")
    except ImportError:
        raise ImportError(_MISSING) from None
    return tw, gym, alfred.AlfredDemangler


def _pddl_env(gym_env: Any) -> Any:
    """TextWorld's PDDL environment under a one-game gym environment and its wrappers (the
    planner is reached there: the gym interface offers it only as an info recomputed after
    every step)."""
    return gym_env.batch_env.envs[0].unwrapped


def plan_length(gym_env: Any, game: str) -> int:
    """The length of the plan TextWorld's PDDL planner makes from the game's current state
    (:data:`UNKNOWN_DISTANCE` if it finds none), remembered per game and state."""
    pddl = _pddl_env(gym_env)
    state = pddl._pddl_state
    facts = "\n".join(sorted(map(str, state.facts)))
    key = (game, hashlib.blake2b(facts.encode(), digest_size=16).digest())
    length = _PLAN_LENGTHS.get(key)
    if length is not None:
        _PLAN_LENGTHS.move_to_end(key)
        return length
    plan = state.replan(pddl._entity_infos)
    length = len(plan) if plan else UNKNOWN_DISTANCE
    _PLAN_LENGTHS[key] = length
    if len(_PLAN_LENGTHS) > PLAN_CACHE_SIZE:
        _PLAN_LENGTHS.popitem(last=False)
    return length


class AlfWorldEpisode(Episode):
    """One play of one ALFWorld game on TextWorld's PDDL engine."""

    def __init__(self, task: Task, max_turns: int, data_dir: Path,
                 show_admissible: bool = False, planner: bool = False,
                 oracle: bool = False) -> None:
        """``planner``: also ask TextWorld's PDDL planner for a winning plan at reset
        (:attr:`plan`); only expert plays need it, and planning costs time. ``oracle``: plan
        from every state for :meth:`distance_to_goal` (module notes)."""
        self.task = task
        self.max_turns = max_turns
        self.show_admissible = show_admissible
        self.oracle = oracle
        spec = json.loads(task.spec)
        if spec.get("v") != SPEC_VERSION:
            raise ValueError(f"task {task.task_id!r} has spec version {spec.get('v')!r}; "
                             f"this code reads version {SPEC_VERSION}")
        self.game_dir = data_dir / spec["game"]
        game_file = self.game_dir / GAME_FILE
        if not game_file.is_file():
            raise ValueError(f"task {task.task_id!r}: game file {game_file} is missing")
        tw, gym, demangler = _engine()
        # The plan once, at reset (the "walkthrough" extra: these games store none, so TextWorld
        # plans); requesting policy_commands would replan after every step (seconds each).
        infos = tw.EnvInfos(won=True, admissible_commands=True,
                            extras=["walkthrough"] if planner else [])
        self.planner = planner
        self.plan: list[str] = []
        env_id = gym.register_game(str(game_file), infos, max_episode_steps=max_turns + 1,
                                   asynchronous=False,
                                   wrappers=[demangler])
        self._env = gym.make(env_id)
        self._ready = False
        self._turns = 0
        self._won = False
        self._adm: list[str] = []

    def reset(self) -> str:
        obs, infos = self._env.reset()
        self._turns = 0
        self._won = bool(infos["won"])
        self._adm = list(infos["admissible_commands"])
        if self.planner:
            self.plan = list(infos["extra.walkthrough"] or [])
        self._ready = True
        return self._decorate(clean_observation(obs, first=True))

    @property
    def score(self) -> float:
        return 1.0 if self._won else 0.0

    def admissible_commands(self) -> list[str]:
        if not self._ready:
            raise RuntimeError("call reset() before admissible_commands()")
        return list(self._adm)

    def distance_to_goal(self) -> int:
        """The planner's plan length from the current state with the ``oracle`` option, else
        :data:`UNKNOWN_DISTANCE` (0 once won either way)."""
        if not self._ready:
            raise RuntimeError("call reset() before distance_to_goal()")
        if self._won:
            return 0
        if not self.oracle:
            return UNKNOWN_DISTANCE
        return plan_length(self._env, str(self.game_dir))

    def step(self, action: str) -> StepResult:
        self._start_turn()
        command = " ".join(action.lower().split())
        ok = command in self._adm
        obs, _, _, infos = self._env.step(command)
        self._won = bool(infos["won"])
        self._adm = list(infos["admissible_commands"])
        text = clean_observation(obs) or NOTHING_HAPPENS
        return StepResult(observation=self._decorate(text), admissible=ok, done=self.done,
                          won=self._won, score=self.score, distance=self.distance_to_goal())

    def close(self) -> None:
        """Release the engine (its PDDL state); the episode cannot be played afterwards."""
        self._env.close()
        self._ready = False


# --------------------------------------------------------------------------------------------
# Expert: the recorded episode's actions, with generated thoughts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What the task asks for, in the game's names (``apple``, ``fridge``, ``desklamp``)."""

    task_type: str
    target: str
    receptacle: str
    toggle: str

    @classmethod
    def of(cls, game_dir: Path, task_type: str) -> Plan:
        data = json.loads((game_dir / "traj_data.json").read_text(encoding="utf-8"))
        p = data.get("pddl_params", {})
        return cls(task_type, str(p.get("object_target", "")).lower(),
                   str(p.get("parent_target", "")).lower(),
                   str(p.get("toggle_target", "")).lower())


#: The step each task type needs between taking the object and placing it (the appliance verb).
_TREAT = {"CLEAN": "clean", "HEAT": "heat", "COOL": "cool"}
_OPENINGS = ("The task is to {goal}.", "My goal: {goal}.", "I need to {goal}.")
_FIRST_SEARCH = "First I need to find {a_obj}. {A_obj} may be at {place}; I go there."
_SEARCH = ("I am looking for {a_obj}. Let me check {place}.",
           "No {obj} yet. Next I check {place}.",
           "{A_obj} may be at {place}; I go there.")
_MOVE = {"clean": "Now I take the {obj} to the {place} to clean it.",
         "heat": "Now I take the {obj} to the {place} to heat it.",
         "cool": "Now I take the {obj} to the {place} to cool it.",
         "place": "Now I bring the {obj} to the {place}.",
         "light": "Now I need the {lamp} to see the {obj} in its light; I go to the {place}."}


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _thought(rng: random.Random, plan: Plan, action: str, last_obs: str,
             holding: str | None, treated: bool, first: bool) -> str:
    """One thought for ``action``: why, given the plan, the state of the search and what was
    just seen."""
    words = action.split()
    verb = words[0] if words else ""
    if verb == "go" and action.startswith("go to "):
        place = action[len("go to "):]
        if holding is None:
            obj = plan.target or "target"
            pattern = _FIRST_SEARCH if first else rng.choice(_SEARCH)
            return pattern.format(obj=obj, a_obj=_a(obj), A_obj=_a(obj).capitalize(),
                                  place=place)
        treat = _TREAT.get(plan.task_type)
        if treat and not treated:
            return _MOVE[treat].format(obj=holding, place=place)
        if plan.task_type == "LOOK":
            return _MOVE["light"].format(obj=holding, place=place, lamp=plan.toggle or "lamp")
        return _MOVE["place"].format(obj=holding, place=place)
    if verb == "take":
        m = re.match(r"take (.+?) from (.+)$", action)
        if m:
            return f"I see the {m.group(1)} on the {m.group(2)}. I take it."
    if verb == "open":
        return f"The {action[5:]} is closed; I open it to look inside."
    if verb == "close":
        return f"Nothing I need in the {action[6:]}; I close it."
    if verb == "put":
        m = re.match(r"put (.+?) in/on (.+)$", action)
        if m:
            return f"I put the {m.group(1)} in/on the {m.group(2)}."
    if verb in _TREAT.values():
        m = re.match(rf"{verb} (.+?) with (.+)$", action)
        if m:
            return f"I {verb} the {m.group(1)} with the {m.group(2)}."
    if verb == "use":
        obj = holding or plan.target or "object"
        return f"I turn on the {action[4:]} to look at the {obj} in its light."
    if "Nothing happens" in last_obs:
        return f"That did nothing. I try: {action}."
    return f"Next: {action}."


def _slip_command(plan: Plan, here: str | None, admissible: Sequence[str],
                  rng: random.Random) -> str | None:
    """A plausible command that does nothing here: taking a numbered copy of the goal object
    from where the agent stands, or putting one there, while the game does not allow it.
    ``None`` before the agent has gone anywhere, or when both are allowed."""
    if here is None:
        return None
    obj = f"{plan.target or 'object'} {rng.randint(1, 3)}"
    options = [c for c in (f"take {obj} from {here}", f"put {obj} in/on {here}")
               if c not in admissible]
    return rng.choice(options) if options else None


def play_expert(ep: AlfWorldEpisode, slip_rate: float = 0.0) -> ExpertEpisode:
    """Reset ``ep`` and play the game's recorded expert actions (``gt_traj.json``) until it
    is done; a game without a recorded episode follows the PDDL planner's plan instead (``ep``
    must have been started with ``planner=True``).

    With ``slip_rate > 0`` the expert sometimes first issues a command the game refuses
    (``Nothing happens.``, nothing changes) and recovers on the next turn (:class:`Slips`);
    only while the actions left still fit in the turn limit, so slips never cost a win."""
    digest = hashlib.sha256(f"alfworld|thought|{ep.task.task_id}".encode()).digest()
    slips = Slips(slip_rate, random.Random(int.from_bytes(digest[8:16], "big")))
    recorded = (ep.game_dir / EXPERT_FILE).is_file()
    plan = Plan.of(ep.game_dir, ep.task.task_type)
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    obs = ep.reset()
    if recorded:
        actions = read_expert_actions(ep.game_dir)[1]
    elif ep.planner:
        actions = list(ep.plan)
    else:
        raise ValueError(f"game {ep.game_dir.name} has no recorded expert episode and the "
                         "episode was started without the planner")
    turns: list[Turn] = []
    holding: str | None = None
    here: str | None = None
    treated = False
    for k, action in enumerate(actions):
        if ep.done:
            break
        if ep.turns + 1 + len(actions) - k <= ep.max_turns and slips.due(ep.turns):
            slip = _slip_command(plan, here, ep.admissible_commands(), slips.rng)
            if slip is not None:
                res = ep.step(slip)
                turns.append(slips.turn(obs, slip, res.admissible))
                obs = res.observation
        thought = _thought(rng, plan, action, obs, holding, treated, first=k == 0)
        if k == 0:
            opening = rng.choice(_OPENINGS).format(goal=ep.task.instruction)
            thought = f"{opening} {thought}"
        thought = slips.thought(thought)
        res = ep.step(action)
        if res.admissible:
            m = re.match(r"take (.+?) from ", action)
            if m:
                holding = m.group(1)
            elif action.startswith("put "):
                holding = None
            elif action.startswith("go to "):
                here = action[len("go to "):]
            elif action.split()[0] in _TREAT.values():
                treated = True
        turns.append(Turn(observation=obs, response=format_response(thought, action),
                          action=action, admissible=res.admissible))
        obs = res.observation
    return ExpertEpisode(task=ep.task, turns=tuple(turns), won=ep.won, score=ep.score,
                         final_observation=obs)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def dump_spec(game: str) -> str:
    return json.dumps({"game": game, "v": SPEC_VERSION}, sort_keys=True, separators=(",", ":"))


@register
class AlfWorldEnv(Environment):
    """ALFWorld's text games on TextWorld (see the module docstring).

    Options:
        data_dir: the folder holding ``json_2.1.1/<split>/...`` and ``logic`` (required; a
            relative path is taken from the working directory, the repository root for
            flows).
        show_admissible: append ``"\\nAdmissible actions: a, b, c"`` to every observation.
            Default False.
        oracle: measure the oracle distance after every step with TextWorld's planner (slow;
            module notes). Default False.
    """

    name = "alfworld"
    task_types = TASK_TYPES
    splits = SPLITS
    state_changing_verbs = ("take", "put", "open", "close", "heat", "cool", "clean", "use",
                            "toggle", "slice")
    command_grammar = (
        "go to {recep}", "open {recep}", "close {recep}", "take {obj} from {recep}",
        "put {obj} in/on {recep}", "clean {obj} with {recep}", "heat {obj} with {recep}",
        "cool {obj} with {recep}", "use {lamp}", "examine {obj}", "examine {recep}", "look",
        "inventory",
    )
    _OPTIONS = ("data_dir", "show_admissible", "oracle")

    def __init__(self, max_turns: int, **options: Any) -> None:
        super().__init__(max_turns, **options)
        data_dir = options.get("data_dir")
        if not isinstance(data_dir, str) or not data_dir:
            raise ValueError("environment 'alfworld' needs env.options.data_dir: the folder "
                             "the game archives were unpacked into (e.g. data/alfworld/games)")
        self.data_dir = Path(data_dir)
        if not (self.data_dir / ROOT).is_dir():
            raise ValueError(f"alfworld data_dir {data_dir!r} has no {ROOT} folder; unpack the "
                             "game archives with python -m hisr_core.envs.alfworld_data")
        oracle = options.get("oracle", False)
        if not isinstance(oracle, bool):
            raise TypeError(f"oracle must be a bool, got {oracle!r}")
        self.oracle: bool = oracle
        self.require(_engine)

    def _make_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        if n == 0:  # a split one does not use need not be unpacked
            return []
        dirs = game_dirs(self.data_dir, split)
        digest = hashlib.sha256(f"alfworld|order|{seed}|{split}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "big")).shuffle(dirs)
        tasks = []
        for d in dirs[:n]:
            rel = d.relative_to(self.data_dir).as_posix()
            tasks.append(Task(
                task_id=f"alfworld/{split}/{d.parent.name}/{d.name}", env=self.name,
                split=split, task_type=task_type_of(d.parent.name),
                instruction=self._instruction(d, rel), seed=seed, spec=dump_spec(rel),
            ))
        return tasks

    def _instruction(self, game_dir: Path, rel: str) -> str:
        """The goal text: from the recorded episode or the game file's grammar (no engine
        needed), else from the game's first observation (seconds a game)."""
        if (game_dir / EXPERT_FILE).is_file():
            return instruction_of(read_expert_actions(game_dir)[0])
        goal = grammar_instruction(game_dir)
        if goal is not None:
            return goal
        probe = Task(task_id="probe", env=self.name, split="", task_type="", instruction="",
                     seed=0, spec=dump_spec(rel))
        ep = AlfWorldEpisode(probe, 1, self.data_dir)
        try:
            return instruction_of(clean_observation(ep._env.reset()[0], first=True))
        finally:
            ep.close()

    def _start(self, task: Task) -> AlfWorldEpisode:
        return AlfWorldEpisode(task, self.max_turns, self.data_dir, self.show_admissible,
                               oracle=self.oracle)

    def expert_play(self, task: Task, slip_rate: float = 0.0) -> ExpertEpisode:
        game_dir = self.data_dir / json.loads(task.spec)["game"]
        planner = not (game_dir / EXPERT_FILE).is_file()
        ep = AlfWorldEpisode(task, self.max_turns, self.data_dir, self.show_admissible, planner)
        try:
            return play_expert(ep, slip_rate)
        finally:
            ep.close()
