"""The episode engine: continuous batching of many episodes over one generation backend.

Every active episode has at most one request in flight. A backend takes requests one at a time
(:meth:`Generator.submit`) and hands back whichever responses are finished
(:meth:`Generator.poll`); as soon as an episode's response is back it is parsed into an
action, its environment steps and its next prompt goes in, while the other episodes keep
generating. No episode waits for the longest response of a turn, and a finished episode's
place is taken by the next queued task at once. The same loop serves evaluation (greedy),
collection (sampling) and, later, every PPO iteration.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import zlib
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from hisr_core.agent.prompts import PromptBuilder
from hisr_core.agent.react import parse_action, replace_action
from hisr_core.envs import Environment, StepResult, Task
from hisr_core.envs.base import ADMISSIBLE_MARKER

if TYPE_CHECKING:
    from hisr_core.envs.workers import EnvWorkers


ActionChoice = Literal["free", "snap", "constrained"]
ACTION_CHOICES: tuple[str, ...] = get_args(ActionChoice)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Decoding settings. ``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 96

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling settings: {self}")


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generated response.

    token_ids: the response tokens (without the stop token).
    text: their decoded text (special tokens dropped).
    entropy: mean over generated tokens of the entropy (nats) of the policy's next-token
        distribution at temperature 1 (the entropy segmenter reads it).
    """

    token_ids: list[int]
    text: str
    entropy: float


class Generator(Protocol):
    """A backend that continues token-id prompts, many at once.

    A request is named by a hashable ``key`` (in :func:`play`, the episode); a key has at most
    one request in flight. Successive requests of one key continue each other: a backend may
    keep the work done on the key's previous prompt and response (the ``hf`` backend keeps its
    KV cache) until :meth:`release` is called for it.
    """

    def submit(self, key: Hashable, prompt: Sequence[int], sampling: Sampling) -> None:
        ...

    def poll(self) -> list[tuple[Hashable, Generation]]:
        """Advance the work in flight; the requests finished since the last call (at least
        one when any request is in flight, unless the backend is making progress in steps)."""
        ...

    def release(self, key: Hashable) -> None:
        ...

    @property
    def stats(self) -> dict[str, int]:
        """Backend counters so far (logged as metrics)."""
        ...


class Streaming:
    """``generate``: the whole-batch call on top of :meth:`submit` / :meth:`poll`."""

    def generate(self: Any, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 sessions: Sequence[Hashable] | None = None) -> list[Generation]:
        """One response per prompt. ``sessions`` (one distinct key per prompt) keep their
        backend state for later calls; without, every prompt stands alone."""
        if sessions is None:
            first = getattr(self, "_one_shots", 0)
            self._one_shots = first + len(prompts)
        keys: list[Hashable] = (list(sessions) if sessions is not None
                                else [_OneShot(first + i) for i in range(len(prompts))])
        if len(keys) != len(prompts) or len(set(keys)) != len(keys):
            raise ValueError(f"need one distinct session per prompt: {len(prompts)} prompts, "
                             f"{len(set(keys))} distinct sessions")
        for key, prompt in zip(keys, prompts, strict=True):
            self.submit(key, prompt, sampling)
        got: dict[Hashable, Generation] = {}
        while len(got) < len(keys):
            got.update(self.poll())
        if sessions is None:
            for key in keys:
                self.release(key)
        return [got[k] for k in keys]


@dataclasses.dataclass(frozen=True)
class _OneShot:
    """The key of a request without a session: the n-th such request of a backend."""

    n: int



def key_seed(seed: int, key: Hashable) -> int:
    """A sampling seed for one key, the same in every process (``hash`` of a str is not)."""
    return (seed * 1_000_003 + zlib.crc32(repr(key).encode())) % 2**63


@dataclasses.dataclass
class _Slot:
    task: Task
    sample: int
    system: str
    observation: str = ""
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    #: The oracle distance to the goal in the state ``observation`` shows.
    distance: int = 0
    #: The response being stepped, and its parsed action.
    pending: tuple[Generation, str | None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.task.task_id, self.sample)


class _InProcess:
    """Episodes stepped in this process, the same interface as
    :class:`hisr_core.envs.workers.EnvWorkers` (for fast environments)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.episodes: dict[Hashable, Any] = {}

    def start(self, items: Sequence[tuple[Hashable, Task]]) -> list[tuple[str, int]]:
        out = []
        for key, task in items:
            self.episodes[key] = self.env.start(task)
            out.append((self.episodes[key].reset(), self.episodes[key].distance_to_goal()))
        return out

    def send_steps(self, items: Sequence[tuple[Hashable, str]]) -> dict[Hashable, StepResult]:
        results = {key: self.episodes[key].step(action) for key, action in items}
        for key, result in results.items():
            if result.done:
                del self.episodes[key]
        return results

    def ready(self, ticket: dict[Hashable, StepResult]) -> bool:
        return True

    def receive_steps(self, ticket: dict[Hashable, StepResult]) -> dict[Hashable, StepResult]:
        return ticket


def play(
    env: Environment,
    tasks: Sequence[Task],
    generator: Generator,
    builder: PromptBuilder,
    sampling: Sampling,
    batch_size: int,
    samples_per_task: int = 1,
    policy: str = "",
    on_episode: Callable[[dict[str, Any]], None] | None = None,
    workers: EnvWorkers | None = None,
    actions: ActionChoice = "free",
) -> list[dict[str, Any]]:
    """Play every task ``samples_per_task`` times, up to ``batch_size`` episodes at once.

    Each response is stepped as soon as the backend hands it back, and the episode's next
    prompt goes straight back in; a finished episode's place goes to the next queued one. With
    ``workers`` (slow environments) the steps run in worker processes while generation goes on.

    Returns one row per episode (contract ``episodes``), in task order then sample order.
    Each turn records the environment's oracle distance to the goal before and after it
    (``distance_before``, ``distance_after``; ``Episode.distance_to_goal``), so its true
    credit is the drop ``distance_before - distance_after``.
    ``on_episode`` is called as each episode ends (progress bars). ``actions`` (where the
    observation lists the admissible commands): ``free`` plays what the policy wrote;
    ``snap`` replaces an unlisted action by the closest listed command (:func:`snap_action`),
    in the stored response too, so a row holds what was played; ``constrained`` has a backend
    that can (``constrains_actions``, the ``hf`` one) decode the action only among the listed
    commands, and snaps what still misses (other backends).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if actions not in ACTION_CHOICES:
        raise ValueError(f"actions must be one of {ACTION_CHOICES}, got {actions!r}")
    constrain = actions == "constrained" and getattr(generator, "constrains_actions", False)
    stepper: Any = workers if workers is not None else _InProcess(env)
    queue = [(t, s) for t in tasks for s in range(samples_per_task)]
    queue.reverse()
    active: dict[Hashable, _Slot] = {}
    tickets: list[Any] = []
    generating = 0
    finished: dict[tuple[str, int], dict[str, Any]] = {}

    def ask(slot: _Slot) -> None:
        nonlocal generating
        prompt = builder.prompt(slot.system, slot.turns, slot.observation)
        slot.prompt_tokens = len(prompt.input_ids)
        choices = listed_commands(slot.observation) if constrain else []
        if choices:
            generator.submit(slot.key, prompt.input_ids, sampling, choices=choices)
        else:
            generator.submit(slot.key, prompt.input_ids, sampling)
        generating += 1

    def refill() -> None:
        new = []
        while queue and len(active) + len(new) < batch_size:
            task, sample = queue.pop()
            new.append(_Slot(task, sample, builder.system(task.instruction, env.command_grammar)))
        if new:
            for slot, (obs, distance) in zip(new, stepper.start([(s.key, s.task) for s in new]),
                                             strict=True):
                slot.observation = obs
                slot.distance = distance
                active[slot.key] = slot
                ask(slot)

    def apply(results: dict[Hashable, StepResult]) -> None:
        for key, result in results.items():
            slot = active[key]
            assert slot.pending is not None
            gen, action = slot.pending
            slot.records.append({
                "observation": slot.observation, "response": gen.text,
                "action": action or "", "admissible": result.admissible,
                "parsed": action is not None, "prompt_tokens": slot.prompt_tokens,
                "response_tokens": len(gen.token_ids),
                "entropy": gen.entropy if math.isfinite(gen.entropy) else 0.0,
                "distance_before": slot.distance, "distance_after": result.distance,
            })
            slot.turns.append((slot.observation, gen.text))
            slot.observation = result.observation
            slot.distance = result.distance
            slot.pending = None
            if result.done:
                generator.release(key)
                del active[key]
                truncated = not result.won and len(slot.records) >= env.max_turns
                row = _episode_row(slot, result.won, result.score, policy, truncated)
                finished[slot.key] = row
                if on_episode is not None:
                    on_episode(row)
            else:
                ask(slot)
        refill()

    refill()
    while active:
        for ticket in [t for t in tickets if stepper.ready(t)]:
            tickets.remove(ticket)
            apply(stepper.receive_steps(ticket))
        if not active:
            break
        if not generating:
            # Every active episode waits on its environment.
            apply(stepper.receive_steps(tickets.pop(0)))
            continue
        steps = []
        for key, gen in generator.poll():
            generating -= 1
            action = parse_action(gen.text)
            if actions != "free" and action is not None:
                snapped = snap_action(action, active[key].observation)
                if snapped != action:
                    gen = dataclasses.replace(gen, text=replace_action(gen.text, snapped))
                    action = snapped
            active[key].pending = (gen, action)
            steps.append((key, action if action is not None else gen.text.strip()))
        if steps:
            tickets.append(stepper.send_steps(steps))
    return [finished[(t.task_id, s)] for t in tasks for s in range(samples_per_task)]


def listed_commands(observation: str) -> list[str]:
    """The admissible commands an observation ends with (``show_admissible``), or []."""
    _, sep, listed = observation.rpartition(ADMISSIBLE_MARKER)
    return [c for c in (c.strip() for c in listed.split(",")) if c] if sep else []


def snap_action(action: str, observation: str) -> str:
    """The command of the admissible list ``observation`` ends with (``show_admissible``)
    closest to ``action`` (:class:`difflib.SequenceMatcher` ratio; the first of equals), or
    ``action`` itself when it is listed or nothing is listed. As Huang et al. (2022, "Language
    Models as Zero-Shot Planners") translate a free-form step into an admissible one."""
    commands = listed_commands(observation)
    if not commands or action in commands:
        return action
    matcher = difflib.SequenceMatcher(b=action, autojunk=False)  # b is the one it indexes
    best, best_ratio = action, -1.0
    for command in commands:
        matcher.set_seq1(command)
        ratio = matcher.ratio()
        if ratio > best_ratio:
            best, best_ratio = command, ratio
    return best


def _episode_row(slot: _Slot, won: bool, score: float, policy: str,
                 truncated: bool) -> dict[str, Any]:
    t = slot.task
    return {
        "task_id": t.task_id, "env": t.env, "split": t.split, "task_type": t.task_type,
        "instruction": t.instruction, "sample": slot.sample, "policy": policy,
        "turns": slot.records, "n_turns": len(slot.records), "won": bool(won),
        "score": float(score), "truncated": truncated, "final_observation": slot.observation,
    }


def success_table(rows: Sequence[dict[str, Any]], task_types: Sequence[str]) -> dict[str, Any]:
    """Success rate and mean score per task type and overall (``Avg``: over all episodes)."""
    out: dict[str, Any] = {"success": {}, "score": {}, "episodes": {}}
    for tt in [*task_types, "all"]:
        sel = [r for r in rows if tt == "all" or r["task_type"] == tt]
        key = tt if tt != "all" else "all"
        out["episodes"][key] = len(sel)
        out["success"][key] = sum(r["won"] for r in sel) / len(sel) if sel else 0.0
        out["score"][key] = sum(r["score"] for r in sel) / len(sel) if sel else 0.0
    return out
