"""The environment protocol every benchmark implements, and the registry that finds them.

An environment is two things:

* an :class:`Environment` (one per benchmark and configuration) that lists the tasks of a
  split, and starts an episode for a task;
* an :class:`Episode` (one per play of a task) that is reset once and stepped with text
  actions until it is done.

Tasks are plain data (:class:`Task`) so they can be stored in Parquet and sent to worker
processes; an episode can always be rebuilt from its task and the environment's options.
Adding a benchmark means one module with an ``Environment`` subclass decorated with
:func:`register`, and an import line in ``hisr_core/envs/__init__.py``.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from hisr_core.agent.react import format_response

NOTHING_HAPPENS = "Nothing happens."
#: Starts the admissible list ``show_admissible`` appends to an observation (the prompt builder
#: finds it there to drop the list from past observations: ``model.past_admissible``).
ADMISSIBLE_MARKER = "\nAdmissible actions: "
#: The oracle distance of an episode whose environment cannot tell it (see
#: :meth:`Episode.distance_to_goal`).
UNKNOWN_DISTANCE = -1


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One task of a benchmark split.

    Attributes:
        task_id: unique across every split of the environment, e.g. ``household/train/00017``.
        env: registry name of the environment that plays it.
        split: ``train``, ``valid_seen``, ``valid_unseen`` (or the benchmark's own names).
        task_type: one of the environment's ``task_types`` (ALFWorld's PICK, CLEAN, ...).
        instruction: the goal in words, e.g. ``put a clean apple in fridge``.
        seed: the seed the task was generated or sampled with.
        spec: environment-specific JSON text that is enough to rebuild the episode
            (a generated room for household, a game file for ALFWorld).
    """

    task_id: str
    env: str
    split: str
    task_type: str
    instruction: str
    seed: int
    spec: str

    def to_row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Task:
        return cls(**{f.name: row[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``Episode.step`` returns.

    Attributes:
        observation: the environment's answer (``Nothing happens.`` for an inadmissible action).
        admissible: whether the action was in the admissible list when it was issued.
        done: the episode is over (won, or the turn limit is reached).
        won: the goal holds.
        score: the outcome in [0, 1] (1.0 when won; partial credit where the benchmark has it).
        distance: :meth:`Episode.distance_to_goal` after the step, so that whoever steps the
            episode (in another process, too) measures progress without the episode itself.
    """

    observation: str
    admissible: bool
    done: bool
    won: bool
    score: float
    distance: int


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """One turn k: the observation ``o_k`` the agent saw, its response ``a_k`` and the action.

    ``o_1`` is what ``reset`` returned; ``o_k`` (k > 1) is what step k - 1 returned.
    """

    observation: str
    response: str
    action: str
    admissible: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertEpisode:
    """An expert's play of one task: its turns, the outcome and the last observation."""

    task: Task
    turns: tuple[Turn, ...]
    won: bool
    score: float
    final_observation: str


class Episode(abc.ABC):
    """One play of one task. Not thread-safe; one episode per worker at a time.

    Besides what the agent sees, an episode knows its oracle progress,
    :meth:`distance_to_goal`: the number of steps an agent that knew the whole state would
    still need. It is ground truth for credit assignment (docs/method.md): the true credit of
    a turn is the drop in distance it caused, and a move that undoes progress raises it.
    """

    task: Task
    max_turns: int
    show_admissible: bool = False
    _turns: int = 0
    _won: bool = False
    _ready: bool = False

    @abc.abstractmethod
    def reset(self) -> str:
        """Start (or restart) the episode; returns the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one text action. Raises ``RuntimeError`` if called after the episode is done."""

    @abc.abstractmethod
    def admissible_commands(self) -> list[str]:
        """The commands that would do something now, in a stable order."""

    @abc.abstractmethod
    def distance_to_goal(self) -> int:
        """The oracle distance from the current state to the goal: the length of the shortest
        plan of an agent that knows where everything is (or the benchmark's closest measure,
        documented by each environment): 0 when won, positive otherwise, and
        :data:`UNKNOWN_DISTANCE` where the environment cannot tell. It reads the state only;
        the agent never sees it."""

    @property
    def turns(self) -> int:
        """Steps taken since reset (``reset`` sets ``_turns = 0``, ``step`` counts)."""
        return self._turns

    @property
    def won(self) -> bool:
        return self._won

    @property
    @abc.abstractmethod
    def score(self) -> float: ...

    @property
    def done(self) -> bool:
        return self.won or self.turns >= self.max_turns

    def _start_turn(self) -> None:
        """The guards of ``step`` (after ``reset``, before the end), then the turn counted."""
        if not self._ready:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("the episode is done; call reset() to play again")
        self._turns += 1

    def _decorate(self, obs: str) -> str:
        """``obs`` with the admissible commands appended under ``show_admissible``."""
        if self.show_admissible:
            return obs + ADMISSIBLE_MARKER + ", ".join(self.admissible_commands())
        return obs


class GoalEpisode(Episode):
    """An episode won when all its goal conditions hold, scored by the fraction that hold.

    What every such environment does alike lives here: ``step`` (:class:`Episode`'s guards
    and turn count, then ``_act``, its observation with the admissible commands appended
    under the ``show_admissible`` option) and the score. A subclass sets ``task``,
    ``max_turns``, ``show_admissible``, ``_turns = 0``, ``_won`` and ``_ready = True`` in
    ``reset``, and implements ``conditions`` and ``_act``.
    """

    @abc.abstractmethod
    def conditions(self) -> list[bool]:
        """Which goal conditions hold now (a stable order)."""

    @abc.abstractmethod
    def _act(self, action: str) -> str | None:
        """Carry out ``action``: its observation, or ``None`` when it is not admissible (and
        nothing changed). Sets ``_won`` when the goal is reached."""

    @property
    def score(self) -> float:
        if self._won:
            return 1.0
        if not self._ready:
            return 0.0
        met = self.conditions()
        return sum(met) / len(met)

    def step(self, action: str) -> StepResult:
        self._start_turn()
        obs = self._act(action)
        return StepResult(observation=self._decorate(NOTHING_HAPPENS if obs is None else obs),
                          admissible=obs is not None, done=self.done, won=self._won,
                          score=self.score, distance=self.distance_to_goal())


#: Thoughts of a slipped turn, and the opening of the turn after it.
SLIP_THOUGHTS = ("I will try {cmd}.", "Maybe {cmd} works.", "Let me {cmd}.")
RECOVER_THOUGHTS = ("That did not work.", "Nothing happened, so that was wrong.",
                    "That command did nothing; let me look at what I actually have.")
#: At most this many slips per episode, so the expert still wins well within the turn limit.
MAX_SLIPS = 2


class Slips:
    """An expert's slips: now and then a plausible command that does nothing (answered
    ``Nothing happens.``), then a recovery on the next turn. Recovery demonstrations for
    behaviour cloning, as in DART; the slipped turns are flagged inadmissible so SFT leaves them
    out of the loss. At most :data:`MAX_SLIPS` an episode, never on the first turn, never two in
    a row. ``rng`` draws only slip decisions and wording, so the expert's own choices do not
    depend on ``rate``."""

    def __init__(self, rate: float, rng: random.Random) -> None:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"slip_rate must be in [0, 1), got {rate}")
        self.rate = rate
        self.rng = rng
        self.count = 0
        self.recovering = False

    def due(self, turns: int) -> bool:
        """Whether to slip before the expert's next command (``turns``: turns played so far)."""
        return bool(self.rate and turns and not self.recovering and self.count < MAX_SLIPS
                    and self.rng.random() < self.rate)

    def turn(self, observation: str, command: str, admissible: bool) -> Turn:
        """Record a slip: ``command`` was issued after ``observation``."""
        self.count += 1
        self.recovering = True
        thought = self.rng.choice(SLIP_THOUGHTS).format(cmd=command)
        return Turn(observation=observation, response=format_response(thought, command),
                    action=command, admissible=admissible)

    def thought(self, thought: str) -> str:
        """The expert's own ``thought``, opened by a recovery after a slip."""
        if not self.recovering:
            return thought
        self.recovering = False
        return f"{self.rng.choice(RECOVER_THOUGHTS)} {thought}".strip()


class Environment(abc.ABC):
    """A benchmark: its task types, its splits, its command grammar, and episodes.

    Class attributes every implementation sets:
        name: registry key (``household``, ``alfworld``, ...).
        task_types: the task types in report order.
        splits: the split names it knows.
        state_changing_verbs: first words of commands that change the world; the ``rule``
            segmenter puts a segment boundary after a turn whose action starts with one.
        command_grammar: the command templates shown to the agent in its system prompt.
    """

    name: ClassVar[str]
    task_types: ClassVar[tuple[str, ...]]
    splits: ClassVar[tuple[str, ...]]
    state_changing_verbs: ClassVar[tuple[str, ...]]
    command_grammar: ClassVar[tuple[str, ...]]

    #: The ``env.options`` an implementation knows; every one knows ``show_admissible``.
    _OPTIONS: ClassVar[tuple[str, ...]] = ("show_admissible",)

    def __init__(self, max_turns: int, **options: Any) -> None:
        unknown = sorted(set(options) - set(self._OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) for environment {self.name!r}: {unknown}; "
                             f"known: {list(self._OPTIONS)}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        show = options.get("show_admissible", False)
        if not isinstance(show, bool):
            raise TypeError(f"show_admissible must be a bool, got {show!r}")
        self.max_turns = max_turns
        self.options = options
        self.show_admissible: bool = show

    def make_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """``n`` tasks of ``split``, deterministic given ``seed`` (fewer if the split is finite)."""
        self.check_split(split)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._make_tasks(split, n, seed)

    def start(self, task: Task) -> Episode:
        """A fresh episode for ``task`` (call ``reset`` on it before stepping)."""
        if task.env != self.name:
            raise ValueError(f"task {task.task_id!r} belongs to environment {task.env!r}")
        return self._start(task)

    @abc.abstractmethod
    def _make_tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """:meth:`make_tasks` once ``split`` and ``n`` are checked."""

    @abc.abstractmethod
    def _start(self, task: Task) -> Episode:
        """:meth:`start` once the task is known to be this environment's."""

    def expert_play(self, task: Task, slip_rate: float = 0.0) -> ExpertEpisode:
        """Play ``task`` with the benchmark's expert; raises if the benchmark has none.

        ``slip_rate``: the chance per turn that the expert first issues a plausible wrong
        command and then recovers (recovery demonstrations; the slipped turns are flagged
        inadmissible). Experts that cannot recover accept only 0.
        """
        raise NotImplementedError(f"environment {self.name!r} has no expert")

    @staticmethod
    def require(load: Callable[[], object]) -> None:
        """Run ``load`` (the import of an optional package) now, so that a missing package fails
        at construction with its install hint rather than at the first episode; as a
        ValueError, which a stage's params check reports like any bad setting (exit status 2)."""
        try:
            load()
        except ImportError as err:
            raise ValueError(str(err)) from None

    def check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(
                f"environment {self.name!r} has no split {split!r}; known: {list(self.splits)}"
            )


_REGISTRY: dict[str, type[Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator adding an environment to the registry under ``cls.name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"environment name {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> list[str]:
    return sorted(_REGISTRY)


def environment_class(name: str) -> type[Environment]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; registered: {registered()}") from None


def make_environment(name: str, max_turns: int, **options: Any) -> Environment:
    return environment_class(name)(max_turns=max_turns, **options)

