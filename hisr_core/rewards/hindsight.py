"""Stage 5: the hindsight model's examples (docs/method.md, stage 5).

``pi_hind`` sees the task, the whole trajectory except response ``a_k`` (past *and* future
turns) and the outcome, and must write ``a_k``. One example per turn. **Decision:** the
hindsight information (the turns after k, the outcome and the final observation) is a block
inserted into the system text, and the rest is the policy's own sequence for turn k: the past
turns, ``o_k``, and the assistant turn where ``a_k`` was. ``pi_hind`` is ``pi_ref`` reading the
block through gated attention (:mod:`hisr_core.rewards.gated_attention`): every token outside the block
keeps the position it has without it, the block reads itself as plain text at the positions
``Window.block_at`` picks, and a learned gate per layer and head is added to the attention
logits from the other tokens to the block's; block readers (low-rank residuals on the block
tokens' hidden states) let the block learn what to show, and a copy head
(:class:`~hisr_core.rewards.gated_attention.BlockPointer`) boosts the block's words a response
position points at. With the gates closed and the copy head at its start ``pi_hind`` *is*
``pi_ref`` on the target (same tokens, same positions); training opens them as far as the
future and the outcome help.
(Inserted as plain text instead, the block shifts every later position: ``pi_ref``'s mean token
NLL of held-out household targets started at 0.45 instead of 0.22, 1.16 with the block right
before ``a_k``, and after full fine-tuning, or LoRA, stayed above ``pi_ref``'s from the prefix:
0.219 against 0.169.) The example is an ordinary chat episode plus the block's span
(:attr:`~hisr_core.agent.prompts.Encoded.block`), so the policy's prompt builder encodes it and the
SFT loss trains it:

    system:    the task's system text
               + "Hindsight ... Later turns: [Observation] o_k+1 [Response] a_k+1 ...
                  Outcome: success (R = 1.00). Final observation: ..."     (the block)
    turns:     o_f, a_f, ..., o_k-1, a_k-1    (the past the policy's prompt kept, exactly)
    user:      o_k
    assistant: a_k                                           (the only tokens with loss)

Scoring reads ``log pi_hind(a_k^j | hindsight context)`` off the same sequence; a model folder
of ``pi_hind`` is loaded with :func:`~hisr_core.rewards.gated_attention.load_gated`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from hisr_core.agent.prompts import Encoded, PromptBuilder
from hisr_core.config import HindsightParams
from hisr_core.rewards.credit import bootstrap_ci
from hisr_core.rewards.gated_attention import (
    POINTER,
    block_span,
    clear_pointer_stash,
    gates_closed,
)
from hisr_core.train.engine import lm_parts, unwrap_hf
from hisr_core.train.scoring import (
    episode_of,
    length_batches,
    masked_logprobs,
    right_pad,
    target_logprobs,
)

#: Episodes :func:`hindsight_logprobs` scores at a time on the closed-gate route (it holds their
#: final hidden states: about 64 × 1,000 tokens × the hidden size in floats).
CLOSED_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Window:
    """Turns kept around the masked turn k: ``past`` before it and ``future`` after it
    (``None``: all, as far as ``max_tokens`` allows); ``block_at``: the positions the block
    reads at (``system``: where it sits; ``turn``: just before turn k's observation)."""

    past: int | None = None
    future: int | None = None
    block_at: Literal["system", "turn"] = "system"

    @classmethod
    def of(cls, cfg: HindsightParams) -> Window:
        """The window of the ``hindsight`` params section."""
        return cls(cfg.past, cfg.future, cfg.block_at)

    def bounds(self, k: int, m: int) -> tuple[int, int]:
        """First and last turn kept (inclusive) for turn k of m."""
        return (0 if self.past is None else max(0, k - self.past),
                m - 1 if self.future is None else min(m - 1, k + self.future))


def hindsight_block(later: Sequence[tuple[str, str]], outcome: float, won: bool,
                    final_observation: str) -> str:
    """The hindsight text for the system message: the turns after k, the outcome and the final
    observation."""
    lines = ["Hindsight: how this episode went after the turn you are writing."]
    if later:
        lines.append("Later turns:")
        for obs, resp in later:
            lines += [f"[Observation] {obs}", f"[Response] {resp}"]
    lines.append(f"Outcome: {'success' if won else 'failure'} (R = {outcome:.2f}). "
                 f"Final observation: {final_observation}")
    return "\n".join(lines)


def hindsight_example(builder: PromptBuilder, system: str, turns: Sequence[tuple[str, str]], k: int,
                      outcome: float, won: bool, final_observation: str,
                      window: Window = Window()) -> Encoded:
    """The example for turn ``k``: the system text with the hindsight block (the turns
    ``window`` keeps after k), the turns before k the policy had in its prompt (fewer if
    ``window.past`` says so), ``o_k``, and ``a_k`` (masked in).

    Without the block the example is the policy's own sequence for turn k, so closed gates
    score ``a_k`` exactly as :func:`hisr_core.train.scoring.turn_logprobs` does. The block has a
    budget of its own, half of ``builder.max_tokens``: while over it, its latest turn goes."""
    m = len(turns)
    if not 0 <= k < m:
        raise ValueError(f"turn {k} is outside a trajectory of {m} turns")
    first, last = window.bounds(k, m)
    first = max(first, builder.prompt(system, turns[:k], turns[k][0]).turns[0])
    plain = builder.encode(system, turns[:k + 1], first, train_from=k)
    budget = builder.max_tokens // 2
    while True:
        block = hindsight_block(turns[k + 1:last + 1], outcome, won, final_observation)
        enc = builder.encode(f"{system}\n\n{block}", turns[:k + 1], first, train_from=k)
        start, end = block_span(plain.input_ids, enc.input_ids)
        if end - start <= budget:
            break
        if last == k:
            raise ValueError(f"the hindsight block of turn {k} without later turns needs "
                             f"{end - start} tokens > max_tokens/2={budget}")
        last -= 1
    # "system": where it is; "turn": just before turn k, like the context it reads most.
    at = start if window.block_at == "system" else max(0, plain.turn_ids.index(k) - (end - start))
    return dataclasses.replace(enc, block=(start, end, at))


def trajectory_examples(builder: PromptBuilder, row: Mapping[str, Any], grammar: Sequence[str],
                        window: Window = Window()) -> list[Encoded]:
    """One example per turn of a ``D_ct`` / ``D_st`` row, in turn order."""
    system, turns = episode_of(builder, row, grammar)
    return [hindsight_example(builder, system, turns, k, float(row["outcome"]), bool(row["won"]),
                              row["final_observation"], window) for k in range(len(turns))]


def hindsight_logprobs(model: PreTrainedModel, builder: PromptBuilder,
                       rows: Sequence[Mapping[str, Any]], grammar: Sequence[str],
                       window: Window = Window(), max_batch_tokens: int = 8192,
                       progress: str | None = None, route: Literal["auto", "full"] = "auto"
                       ) -> list[list[torch.Tensor]]:
    """Per row, per turn k, ``log pi_hind(a_k^j | hindsight context)`` of response k's tokens
    (end-of-turn marker included, as :func:`hisr_core.train.scoring.turn_logprobs` scores them).
    Shape: row → m tensors of shape (L_k,).

    ``route``: ``full`` scores every turn's whole example; ``auto`` does so only while some
    gate is open (or the model changes its logits after the LM head), and otherwise takes
    :func:`closed_gate_logprobs` (the same numbers)."""
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    if route == "auto" and gates_closed(model) and lm_parts(model, hooked=True) is not None:
        out: list[list[torch.Tensor]] = []
        # Chunks of episodes: their hidden states are held until the copy head has read them.
        for lo in tqdm(range(0, len(rows), CLOSED_CHUNK), desc=progress, unit="chunk",
                       disable=progress is None, mininterval=2):
            out += closed_gate_logprobs(model, [trajectory_examples(builder, row, grammar, window)
                                                for row in rows[lo:lo + CLOSED_CHUNK]],
                                        pad, max_batch_tokens)
        return out
    examples = [trajectory_examples(builder, row, grammar, window) for row in rows]
    flat = [e for ex in examples for e in ex]
    scores = iter(masked_logprobs(model, flat, pad, max_batch_tokens, progress))
    return [[next(scores) for _ in ex] for ex in examples]


@torch.inference_mode()
def closed_gate_logprobs(model: PreTrainedModel, examples: Sequence[Sequence[Encoded]],
                         pad_id: int, max_batch_tokens: int = 8192) -> list[list[torch.Tensor]]:
    """:func:`hindsight_logprobs` of a model whose gates are closed, without re-encoding each
    turn's past. Closed gates keep every token outside the block at its hidden state without
    the block, so:

    * the targets' hidden states and logits come from the examples without their blocks, and
      consecutive turns whose plain sequences extend one another share one pass (a whole
      episode usually is one sequence, as in :func:`~hisr_core.train.scoring.turn_logprobs`);
    * each block's final hidden states come from a pass over the block after a cached pass
      over the tokens before it (the block reads only what precedes it, and its readers act
      as in the full example);
    * the copy head then adds its boost to the targets' logits.

    Shape: per row, per turn k, an example with block ``(start, end, at)`` → (M_k,) float32,
    M_k its masked-in tokens."""
    parts = lm_parts(model, hooked=True)
    if parts is None:
        raise ValueError(f"{type(model).__name__} changes its logits after the LM head: "
                         "score it with route='full'")
    backbone, head = parts
    pointer = getattr(unwrap_hf(model), POINTER, None)
    device = next(model.parameters()).device
    seqs: list[list[int]] = []
    # Per row, per turn: (its plain sequence, the positions of its targets there).
    where: list[list[tuple[int, list[int]]]] = []
    for ex in examples:
        placed: list[tuple[int, list[int]]] = [(-1, [])] * len(ex)
        for k in reversed(range(len(ex))):
            start, end, _ = ex[k].block or (0, 0, 0)
            plain = ex[k].input_ids[:start] + ex[k].input_ids[end:]
            mask = ex[k].response_mask[:start] + ex[k].response_mask[end:]
            if not seqs or k == len(ex) - 1 or seqs[-1][:len(plain)] != plain:
                seqs.append(plain)
            placed[k] = (len(seqs) - 1, [t for t, on in enumerate(mask) if on])
        where.append(placed)
    flat = [(e, k) for e, ex in enumerate(examples) for k in range(len(ex))]
    hidden: list[torch.Tensor | None] = [None] * len(seqs)
    for batch in length_batches([len(s) for s in seqs], max_batch_tokens):
        ids, _ = right_pad([seqs[i] for i in batch], pad_id)
        out = backbone(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for j, i in enumerate(batch):
            hidden[i] = out[j, :len(seqs[i])]
    blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    if pointer is not None:
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); accept either.
        cache_arg = ("cache" if "cache" in inspect.signature(backbone.forward).parameters
                     else "past_key_values")
        # Turns whose blocks follow the same tokens read that prefix from one cached pass.
        after: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for e, k in flat:
            after.setdefault(tuple(examples[e][k].input_ids[:examples[e][k].block[0]]), []
                             ).append((e, k))
        for prefix, turns in after.items():
            cache = DynamicCache()
            backbone(input_ids=torch.tensor([prefix], device=device), use_cache=True,
                     **{cache_arg: cache})
            spans = [examples[e][k].block for e, k in turns]
            for batch in length_batches([end - start for start, end, _ in spans],
                                        max_batch_tokens):
                ids, _ = right_pad([examples[turns[i][0]][turns[i][1]].input_ids[
                    spans[i][0]:spans[i][1]] for i in batch], pad_id)
                width = ids.shape[1]
                # Block token i at position at + i, after the prefix in the cache; every row
                # is block (its readers act, no gate is read; padding comes last).
                positions = torch.stack([spans[i][2] + torch.arange(width) for i in batch])
                rows = copy.deepcopy(cache)
                rows.batch_repeat_interleave(len(batch))
                out = backbone(input_ids=ids.to(device), position_ids=positions.to(device),
                               use_cache=True, **{cache_arg: rows},
                               attention_mask=torch.ones((len(batch), len(prefix) + width),
                                                         dtype=torch.long, device=device),
                               hind_block=torch.ones_like(ids, dtype=torch.bool, device=device)
                               ).last_hidden_state
                clear_pointer_stash(model)
                for j, i in enumerate(batch):
                    n = spans[i][1] - spans[i][0]
                    blocks[turns[i]] = out[j, :n], ids[j, :n].to(device)
    result: list[list[torch.Tensor]] = []
    for e, placed in enumerate(where):
        row = []
        for k, (i, targets) in enumerate(placed):
            at = torch.tensor(targets, dtype=torch.long, device=device)
            h = hidden[i][at - 1]                                              # [M_k, d]
            logits = head(h).float()
            if (e, k) in blocks:
                keys, key_ids = blocks[(e, k)]
                allowed = torch.ones((1, len(targets), len(key_ids)), dtype=torch.bool,
                                     device=device)
                logits = pointer.point(logits[None], h[None], keys[None], key_ids[None],
                                       allowed)[0].float()
            row.append(target_logprobs(logits, torch.tensor(seqs[i], device=device)[at]).cpu())
        result.append(row)
    return result


# -- where the future tells the answer ------------------------------------------------------------
#: An object or a place as household and ALFWorld name them: a word and its number.
_NAMED = re.compile(r"\b[a-z]+ \d+\b")


def told_by_future(action: str, next_observation: str) -> bool:
    """Whether the observation after a turn names every object and place its action names
    (``take bowl 1 from cabinet 1`` → ``You pick up the bowl 1 from the cabinet 1.``): the
    hindsight block shows ``pi_hind`` that turn's answer. False for an action naming none."""
    named = set(_NAMED.findall(action.lower()))
    seen = next_observation.lower()
    return bool(named) and all(re.search(rf"\b{re.escape(n)}\b", seen) for n in named)


def told_turns(row: Mapping[str, Any]) -> list[bool]:
    """:func:`told_by_future` of every turn of a trajectory row (the last turn's next
    observation is the final one)."""
    turns = row["turns"]
    after = [t["observation"] for t in turns[1:]] + [row["final_observation"]]
    return [told_by_future(t["action"], o) for t, o in zip(turns, after, strict=True)]


def told_nll(told: Sequence[Sequence[bool]], hind: Sequence[Sequence[torch.Tensor]],
             ref: Sequence[Sequence[torch.Tensor]], n_boot: int = 1000, seed: int = 0
             ) -> dict[str, float]:
    """Mean token NLL of the responses under ``pi_hind`` and under the reference, over the
    turns the future tells (``told/…``) and over the others (``untold/…``), with ``delta`` =
    hindsight − reference and its 95% bootstrap CI over trajectories (``delta_low``,
    ``delta_high``; negative: ``pi_hind`` predicts those responses better).

    Shape: per trajectory, per turn, a flag and two log-prob tensors of the same length
    (L_k,)."""
    out: dict[str, float] = {}
    for name, want in (("told", True), ("untold", False)):
        # Per trajectory: (hindsight NLL sum, reference NLL sum, tokens) over the chosen turns.
        sums = np.array([[sum(-float(h.double().sum()) for h, f in zip(hs, fl, strict=True)
                              if f == want),
                          sum(-float(r.double().sum()) for r, f in zip(rs, fl, strict=True)
                              if f == want),
                          sum(len(h) for h, f in zip(hs, fl, strict=True) if f == want)]
                         for fl, hs, rs in zip(told, hind, ref, strict=True)]).reshape(-1, 3)
        tokens = float(sums[:, 2].sum())
        turns = sum(f == want for fl in told for f in fl)

        def delta(items: np.ndarray) -> float:
            n = items[:, 2].sum()
            return float((items[:, 0].sum() - items[:, 1].sum()) / n) if n else math.nan

        point, low, high = bootstrap_ci(delta, sums, n_boot, seed)
        out |= {f"{name}/turns": float(turns), f"{name}/tokens": tokens,
                f"{name}/nll_hind": float(sums[:, 0].sum() / tokens) if tokens else math.nan,
                f"{name}/nll_ref": float(sums[:, 1].sum() / tokens) if tokens else math.nan,
                f"{name}/delta": point, f"{name}/delta_low": low, f"{name}/delta_high": high}
    return out
