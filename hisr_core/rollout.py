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
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hisr_core.envs import Environment, Task
from hisr_core.prompts import PromptBuilder, system_text
from hisr_core.react import parse_action


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
    """A backend that continues a batch of token-id prompts."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:
        ...


class HFGenerator:
    """In-process transformers generation: left padding, KV cache, per-row stop.

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

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any) -> tuple[torch.Tensor, Any]:
        """Shape: ids (B, T) → last-position logits (B, V) float32, and the updated cache."""
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

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Generation]:
        if not prompts:
            return []
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, positions, None)
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
            mask = torch.cat([mask, (~done).long().unsqueeze(-1)], dim=-1)
            next_pos = next_pos + 1
            logits, cache = self._forward(choice.unsqueeze(-1), mask, next_pos.unsqueeze(-1), cache)
        grid = torch.stack(tokens, dim=1).cpu() if tokens else torch.empty((b, 0), dtype=torch.long)
        results = []
        for i in range(b):
            row = [int(t) for t in grid[i] if t >= 0]
            n = max(float(n_tokens[i]), 1.0)
            results.append(Generation(row, self.tokenizer.decode(row, skip_special_tokens=True),
                                      float(entropy_sum[i]) / n if row else 0.0))
        return results


@dataclasses.dataclass
class _Slot:
    task: Task
    sample: int
    episode: Any
    system: str
    observation: str
    turns: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)


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
) -> list[dict[str, Any]]:
    """Play every task ``samples_per_task`` times, ``batch_size`` episodes in lockstep.

    Returns one row per episode (contract ``episodes``), in task order then sample order.
    ``on_episode`` is called as each episode ends (progress bars).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    queue = [(t, s) for t in tasks for s in range(samples_per_task)]
    queue.reverse()
    active: list[_Slot] = []
    finished: dict[tuple[str, int], dict[str, Any]] = {}

    def refill() -> None:
        while queue and len(active) < batch_size:
            task, sample = queue.pop()
            episode = env.start(task)
            obs = episode.reset()
            active.append(_Slot(task, sample, episode,
                                system_text(task.instruction, env.command_grammar), obs))

    refill()
    while active:
        prompts = [builder.prompt(s.system, s.turns, s.observation) for s in active]
        gens = generator.generate([p.input_ids for p in prompts], sampling)
        still: list[_Slot] = []
        for slot, prompt, gen in zip(active, prompts, gens, strict=True):
            action = parse_action(gen.text)
            result = slot.episode.step(action if action is not None else gen.text.strip())
            slot.records.append({
                "observation": slot.observation, "response": gen.text,
                "action": action or "", "admissible": result.admissible,
                "parsed": action is not None, "prompt_tokens": len(prompt.input_ids),
                "response_tokens": len(gen.token_ids),
                "entropy": gen.entropy if math.isfinite(gen.entropy) else 0.0,
            })
            slot.turns.append((slot.observation, gen.text))
            slot.observation = result.observation
            if result.done:
                row = _episode_row(slot, result.won, result.score, policy)
                finished[(slot.task.task_id, slot.sample)] = row
                if on_episode is not None:
                    on_episode(row)
            else:
                still.append(slot)
        active = still
        refill()
    return [finished[(t.task_id, s)] for t in tasks for s in range(samples_per_task)]


def _episode_row(slot: _Slot, won: bool, score: float, policy: str) -> dict[str, Any]:
    t = slot.task
    return {
        "task_id": t.task_id, "env": t.env, "split": t.split, "task_type": t.task_type,
        "instruction": t.instruction, "sample": slot.sample, "policy": policy,
        "turns": slot.records, "n_turns": len(slot.records), "won": bool(won),
        "score": float(score), "final_observation": slot.observation,
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
