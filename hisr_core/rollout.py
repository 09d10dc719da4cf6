"""Batched multi-episode play: B episodes in lockstep, one batched generation call per turn.

At each turn every active episode's prompt (system, the window of past turns, the current
observation) is encoded by :class:`~hisr_core.prompts.PromptBuilder`, one generation call covers
them all (left padding, KV cache), each response is parsed into an action, every environment
steps, finished episodes leave the batch and queued tasks take their places. The same loop
serves evaluation (greedy), collection (sampling) and, later, every PPO iteration.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hisr_core.envs import Environment, StepResult, Task
from hisr_core.prompts import PromptBuilder, system_text
from hisr_core.react import parse_action

if TYPE_CHECKING:
    from hisr_core.env_workers import EnvWorkers


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
    """A backend that continues a batch of token-id prompts.

    ``sessions`` (optional, one hashable key per prompt) say which prompts continue earlier
    ones: a backend may keep the work done on a session's previous prompt and response (the
    ``hf`` backend keeps its KV cache) until :meth:`release` is called for it.
    """

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 sessions: Sequence[Hashable] | None = None) -> list[Generation]:
        ...

    def release(self, session: Hashable) -> None:
        ...

    @property
    def stats(self) -> dict[str, int]:
        """Backend counters so far (logged as metrics)."""
        ...


@dataclasses.dataclass
class _Cached:
    """A session's KV cache: ``ids`` (T tokens) and per layer keys and values [H_kv, T, D]."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class HFGenerator:
    """In-process transformers generation: left padding, KV cache, per-row stop.

    With ``sessions``, the KV cache of each session's last prompt and response is kept, and the
    next prompt of that session is computed only from where it stops sharing a prefix with
    them: a turn then costs its new observation, not the whole episode again. This needs a
    plain dynamic cache (every layer full attention); other caches are recomputed each call.

    Args:
        model: a causal LM (eval mode is set here).
        tokenizer: its tokenizer (decodes responses).
        stop_ids: token ids that end a response (the prompt builder's ``stop_ids``).
        seed: seed of the sampling RNG (greedy decoding ignores it).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 stop_ids: Sequence[int], seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.device = next(model.parameters()).device
        self.rng = torch.Generator(device="cpu").manual_seed(seed)
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept either.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._store: dict[Hashable, _Cached] = {}
        # A preallocated cache for models that support one (see _cache).
        self._static = bool(getattr(model, "_can_compile_fullgraph", False))
        #: Prompt tokens computed, and taken from a session's cache, so far.
        self.stats = {"prompt_tokens_computed": 0, "prompt_tokens_reused": 0}

    def release(self, session: Hashable) -> None:
        self._store.pop(session, None)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> tuple[torch.Tensor, Any]:
        """Shape: ids (B, T), mask (B, past + T) → last-position logits (B, V) float32, and
        the updated cache."""
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, **kwargs, **self._keep_arg)
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1].float(), new_cache

    def _choose(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """Shape: logits (B, V) float32 → (B,) token ids."""
        if sampling.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = sorted_p.cumsum(-1) - sorted_p >= sampling.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return torch.multinomial(probs.cpu(), 1, generator=self.rng).squeeze(-1).to(logits.device)

    def _reusable(self, prompts: Sequence[Sequence[int]],
                  sessions: Sequence[Hashable] | None) -> list[int]:
        """Per prompt, how many leading tokens the session's cache already holds (at least one
        token is always left to compute, for the next-token logits)."""
        if sessions is None:
            return [0] * len(prompts)
        if len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        out = []
        for prompt, session in zip(prompts, sessions, strict=True):
            entry = self._store.get(session)
            out.append(0 if entry is None else
                       min(_common_prefix(entry.ids, prompt), len(prompt) - 1))
        return out

    def _cache(self, sessions: Sequence[Hashable] | None, reuse: Sequence[int], past: int,
               total: int) -> Any:
        """The batch's KV cache, ``past`` slots filled: row i holds its session's first
        ``reuse[i]`` cached positions right-aligned, zeros (masked) before them.

        Models that support it get a static cache of ``total`` slots, written in place as
        tokens are generated (a dynamic cache concatenates every layer's keys and values at
        every step: its cost grows with batch x context x steps). Others get a dynamic cache.
        """
        from transformers import DynamicCache, StaticCache

        data = []
        if past:
            assert sessions is not None
            some = next(self._store[s] for s, r in zip(sessions, reuse, strict=True) if r)
            for layer, (k0, v0) in enumerate(some.layers):
                keys = k0.new_zeros((len(reuse), k0.shape[0], past, k0.shape[2]))
                values = v0.new_zeros((len(reuse), v0.shape[0], past, v0.shape[2]))
                for i, (session, r) in enumerate(zip(sessions, reuse, strict=True)):
                    if r:
                        k, v = self._store[session].layers[layer]
                        keys[i, :, past - r:] = k[:, :r]
                        values[i, :, past - r:] = v[:, :r]
                data.append((keys, values))
        if not self._static:
            return DynamicCache(ddp_cache_data=data) if data else None
        cache = StaticCache(config=self.model.config, max_cache_len=total)
        for layer, (keys, values) in zip(cache.layers, data, strict=False):
            layer.update(keys, values)
        return cache

    def _keep(self, sessions: Sequence[Hashable], ids: Sequence[list[int]], mask: torch.Tensor,
              cache: Any) -> None:
        """Store each row's valid cache slots (``mask`` == 1) as its session's cache."""
        layers = getattr(cache, "layers", None)
        kinds = {"DynamicLayer", "StaticLayer"}
        if not layers or any(type(layer).__name__ not in kinds for layer in layers):
            return  # not a plain full-attention cache: nothing is reused
        for i, session in enumerate(sessions):
            valid = mask[i].bool()
            if int(valid.sum()) != len(ids[i]) or layers[0].keys.shape[2] < mask.shape[1]:
                self._store.pop(session, None)
                continue
            width = mask.shape[1]
            self._store[session] = _Cached(ids[i], [
                (layer.keys[i][:, :width][:, valid].clone(),
                 layer.values[i][:, :width][:, valid].clone()) for layer in layers])

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling,
                 sessions: Sequence[Hashable] | None = None) -> list[Generation]:
        if not prompts:
            return []
        b = len(prompts)
        reuse = self._reusable(prompts, sessions)
        # Row layout: [pad, cached reuse_i | pad, new tokens], each part right-aligned.
        past = max(reuse)
        fresh = [list(p[r:]) for p, r in zip(prompts, reuse, strict=True)]
        width = max(len(f) for f in fresh)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, past + width), dtype=torch.long)
        positions = torch.zeros((b, width), dtype=torch.long)
        for i, (f, r) in enumerate(zip(fresh, reuse, strict=True)):
            ids[i, width - len(f):] = torch.tensor(f, dtype=torch.long)
            mask[i, past - r:past] = 1
            mask[i, past + width - len(f):] = 1
            positions[i, width - len(f):] = torch.arange(r, r + len(f))
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        total = past + width + sampling.max_new_tokens
        cache = self._cache(sessions, reuse, past, total)
        if self._static:
            # The mask spans every slot of the static cache; slot t opens when it is written.
            mask = torch.cat([mask, mask.new_zeros((b, total - mask.shape[1]))], dim=-1)
        filled = past + width
        self.stats["prompt_tokens_reused"] += sum(reuse)
        self.stats["prompt_tokens_computed"] += sum(len(f) for f in fresh)
        logits, cache = self._forward(ids, mask, positions, cache)
        stop = self.stop_ids.to(self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        tokens: list[torch.Tensor] = []
        entropy_sum = torch.zeros(b, device=self.device)
        n_tokens = torch.zeros(b, device=self.device)
        next_pos = positions[:, -1]
        for _ in range(sampling.max_new_tokens):
            logp = torch.log_softmax(logits, dim=-1)
            step_entropy = -(logp.exp() * logp).sum(-1)
            choice = self._choose(logits, sampling)
            choice = torch.where(done, torch.full_like(choice, self.pad_id), choice)
            is_stop = torch.isin(choice, stop) & ~done
            live = ~done & ~is_stop
            entropy_sum += torch.where(live, step_entropy, 0.0)
            n_tokens += live.float()
            tokens.append(torch.where(live, choice, torch.full_like(choice, -1)))
            done |= is_stop
            if bool(done.all()):
                break
            # Every live token is fed back, so the cache ends holding prompt + response.
            if self._static:
                mask[:, filled] = (~done).long()
            else:
                mask = torch.cat([mask, (~done).long().unsqueeze(-1)], dim=-1)
            filled += 1
            next_pos = next_pos + 1
            logits, cache = self._forward(choice.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache)
        grid = torch.stack(tokens, dim=1).cpu() if tokens else torch.empty((b, 0), dtype=torch.long)
        results = []
        for i in range(b):
            row = [int(t) for t in grid[i] if t >= 0]
            n = max(float(n_tokens[i]), 1.0)
            results.append(Generation(row, self.tokenizer.decode(row, skip_special_tokens=True),
                                      float(entropy_sum[i]) / n if row else 0.0))
        if sessions is not None:
            self._keep(sessions, [list(p) + g.token_ids for p, g in zip(prompts, results,
                                                                        strict=True)],
                       mask[:, :filled], cache)
        return results


@dataclasses.dataclass
class _Slot:
    task: Task
    sample: int
    system: str
    observation: str = ""
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The response of the turn being stepped: prompt length, generation, parsed action.
    pending: tuple[int, Generation, str | None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.task.task_id, self.sample)


class _InProcess:
    """Episodes stepped in this process, the same interface as
    :class:`hisr_core.env_workers.EnvWorkers` (for fast environments)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.episodes: dict[Hashable, Any] = {}

    def start(self, items: Sequence[tuple[Hashable, Task]]) -> list[str]:
        out = []
        for key, task in items:
            self.episodes[key] = self.env.start(task)
            out.append(self.episodes[key].reset())
        return out

    def send_steps(self, items: Sequence[tuple[Hashable, str]]) -> dict[Hashable, StepResult]:
        results = {key: self.episodes[key].step(action) for key, action in items}
        for key, result in results.items():
            if result.done:
                del self.episodes[key]
        return results

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
) -> list[dict[str, Any]]:
    """Play every task ``samples_per_task`` times, ``batch_size`` episodes in lockstep.

    With ``workers`` (slow environments) the episodes step in worker processes, and the batch
    is split in two halves that alternate: while the workers step one half, the other half's
    responses are generated. Without, episodes step in this process, one batch per turn.

    Returns one row per episode (contract ``episodes``), in task order then sample order.
    ``on_episode`` is called as each episode ends (progress bars).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stepper: Any = workers if workers is not None else _InProcess(env)
    n_groups = 2 if workers is not None and batch_size > 1 else 1
    caps = [batch_size // n_groups + (g < batch_size % n_groups) for g in range(n_groups)]
    queue = [(t, s) for t in tasks for s in range(samples_per_task)]
    queue.reverse()
    active: list[list[_Slot]] = [[] for _ in range(n_groups)]
    tickets: list[Any] = [None] * n_groups
    finished: dict[tuple[str, int], dict[str, Any]] = {}

    def refill(g: int) -> None:
        new = []
        while queue and len(active[g]) + len(new) < caps[g]:
            task, sample = queue.pop()
            new.append(_Slot(task, sample, system_text(task.instruction, env.command_grammar)))
        if new:
            for slot, obs in zip(new, stepper.start([(s.key, s.task) for s in new]),
                                 strict=True):
                slot.observation = obs
            active[g].extend(new)

    def apply(g: int, results: dict[Hashable, StepResult]) -> None:
        still: list[_Slot] = []
        for slot in active[g]:
            assert slot.pending is not None
            prompt_tokens, gen, action = slot.pending
            result = results[slot.key]
            slot.records.append({
                "observation": slot.observation, "response": gen.text,
                "action": action or "", "admissible": result.admissible,
                "parsed": action is not None, "prompt_tokens": prompt_tokens,
                "response_tokens": len(gen.token_ids),
                "entropy": gen.entropy if math.isfinite(gen.entropy) else 0.0,
            })
            slot.turns.append((slot.observation, gen.text))
            slot.observation = result.observation
            slot.pending = None
            if result.done:
                generator.release(slot.key)
                truncated = not result.won and len(slot.records) >= env.max_turns
                row = _episode_row(slot, result.won, result.score, policy, truncated)
                finished[slot.key] = row
                if on_episode is not None:
                    on_episode(row)
            else:
                still.append(slot)
        active[g] = still

    for g in range(n_groups):
        refill(g)
    while any(active):
        for g in range(n_groups):
            if tickets[g] is not None:
                apply(g, stepper.receive_steps(tickets[g]))
                tickets[g] = None
                refill(g)
            if not active[g]:
                continue
            prompts = [builder.prompt(s.system, s.turns, s.observation) for s in active[g]]
            gens = generator.generate([p.input_ids for p in prompts], sampling,
                                      [s.key for s in active[g]])
            steps = []
            for slot, prompt, gen in zip(active[g], prompts, gens, strict=True):
                action = parse_action(gen.text)
                slot.pending = (len(prompt.input_ids), gen, action)
                steps.append((slot.key, action if action is not None else gen.text.strip()))
            tickets[g] = stepper.send_steps(steps)
    return [finished[(t.task_id, s)] for t in tasks for s in range(samples_per_task)]


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
