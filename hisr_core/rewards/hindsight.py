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
from collections.abc import Callable, Mapping, Sequence
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
    READS,
    BlockPointer,
    block_span,
    clear_pointer_stash,
    gates_closed,
)
from hisr_core.train.engine import lm_parts, unwrap_hf, warmup_cosine
from hisr_core.train.scoring import (
    episode_of,
    length_batches,
    masked_logprobs,
    right_pad,
    scoring_sequences,
    target_logprobs,
)

#: Episodes :func:`hindsight_logprobs` scores at a time on the closed-gate route (it holds their
#: final hidden states: about 64 × 1,000 tokens × the hidden size in floats).
CLOSED_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Window:
    """Turns kept around the masked turn k: ``past`` before it and ``future`` after it
    (``None``: all, as far as ``max_tokens`` allows); ``block_at``: the positions the block
    reads at (``system``: where it sits; ``turn``: just before turn k's observation);
    ``reads``: where the copy head reads the future (``hindsight.reads``: a ``block`` in the
    example, or the ``episode``'s own pass, :func:`episode_features`)."""

    past: int | None = None
    future: int | None = None
    block_at: Literal["system", "turn"] = "system"
    reads: Literal["block", "episode"] = "block"

    @classmethod
    def of(cls, cfg: HindsightParams) -> Window:
        """The window of the ``hindsight`` params section."""
        return cls(cfg.past, cfg.future, cfg.block_at, cfg.reads)

    def bounds(self, k: int, m: int) -> tuple[int, int]:
        """First and last turn kept (inclusive) for turn k of m."""
        return (0 if self.past is None else max(0, k - self.past),
                m - 1 if self.future is None else min(m - 1, k + self.future))


def outcome_line(outcome: float, won: bool, final_observation: str) -> str:
    """The hindsight text's last line: the outcome and the final observation."""
    return (f"Outcome: {'success' if won else 'failure'} (R = {outcome:.2f}). "
            f"Final observation: {final_observation}")


def hindsight_block(later: Sequence[tuple[str, str]], outcome: float, won: bool,
                    final_observation: str) -> str:
    """The hindsight text for the system message: the turns after k, the outcome and the final
    observation."""
    lines = ["Hindsight: how this episode went after the turn you are writing."]
    if later:
        lines.append("Later turns:")
        for obs, resp in later:
            lines += [f"[Observation] {obs}", f"[Response] {resp}"]
    lines.append(outcome_line(outcome, won, final_observation))
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
    :func:`closed_gate_logprobs` (the same numbers). With ``window.reads: episode`` there is
    no block: :func:`episode_logprobs`."""
    trained_for = getattr(unwrap_hf(model), READS, window.reads)
    if trained_for != window.reads:
        raise ValueError(f"pi_hind was trained with hindsight.reads: {trained_for}, and the "
                         f"params say {window.reads}: rerun the hindsight stage")
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    if window.reads == "episode":
        return episode_logprobs(model, builder, rows, grammar, window.future, max_batch_tokens,
                                progress)
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


def _head_parts(model: torch.nn.Module, remedy: str
                ) -> tuple[torch.nn.Module, torch.nn.Module, BlockPointer | None]:
    """(backbone, LM head, copy head or ``None``) of ``pi_hind``; ``remedy`` ends the error
    for a model that changes its logits after the LM head."""
    parts = lm_parts(model, hooked=True)
    if parts is None:
        raise ValueError(f"{type(model).__name__} changes its logits after the LM head: {remedy}")
    return *parts, getattr(unwrap_hf(model), POINTER, None)


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
    backbone, head, pointer = _head_parts(model, "score it with route='full'")
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


# -- the copy head on the episode's own pass (hindsight.reads: episode) ----------------------------
@dataclasses.dataclass(frozen=True)
class EpisodeFeatures:
    """``pi_ref``'s reading of one episode: all that the copy head reads with ``hindsight.reads:
    episode``. The weights are ``pi_ref``'s, so one pass over the episode's scoring sequences
    (:func:`~hisr_core.train.scoring.scoring_sequences`, as the policy saw them) gives both
    the hidden states that predict each response and those of the later turns' tokens; the
    outcome line is read in a short pass of its own.

    Shape: queries [Q, d] (the final hidden states that predict each response token, turn by
    turn: turn k's rows ``query_at[k]:query_at[k+1]``), targets [Q] long (those tokens);
    tokens [N, d], token_ids [N] long (each turn's tokens as read in the sequence that scores
    its response: turn j's rows ``token_at[j]:token_at[j+1]``; then the outcome line's, from
    ``token_at[m]``); ``query_at`` and ``token_at`` have m + 1 entries."""

    queries: torch.Tensor
    targets: torch.Tensor
    query_at: tuple[int, ...]
    tokens: torch.Tensor
    token_ids: torch.Tensor
    token_at: tuple[int, ...]

    @property
    def turns(self) -> int:
        return len(self.query_at) - 1

    def turn(self, k: int, future: int | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Turn k's (queries, targets, keys, key ids): the keys are the tokens of the
        ``future`` turns after k (``None``: all of them), then the outcome line's.
        Shape: [M_k, d], [M_k], [S_k, d], [S_k]."""
        m = self.turns
        if not 0 <= k < m:
            raise ValueError(f"turn {k} is outside an episode of {m} turns")
        last = m - 1 if future is None else min(m - 1, k + future)
        lo, hi, tail = self.token_at[k + 1], self.token_at[last + 1], self.token_at[m]
        rows = slice(self.query_at[k], self.query_at[k + 1])
        return (self.queries[rows], self.targets[rows],
                torch.cat([self.tokens[lo:hi], self.tokens[tail:]]),
                torch.cat([self.token_ids[lo:hi], self.token_ids[tail:]]))


@torch.no_grad()  # not inference_mode: the copy head trains on these tensors
def episode_features(backbone: torch.nn.Module, builder: PromptBuilder,
                     rows: Sequence[Mapping[str, Any]], grammar: Sequence[str], pad_id: int,
                     max_batch_tokens: int = 8192) -> list[EpisodeFeatures]:
    """:class:`EpisodeFeatures` of ``D_ct`` / ``D_st`` rows: one backbone pass over their
    scoring sequences and their outcome lines (each cut to ``builder.max_tokens // 2``, the
    hindsight block's budget)."""
    device = next(backbone.parameters()).device
    seqs: list[list[int]] = []
    plan: list[tuple[int, list[Encoded]]] = []  # per row: its first sequence, its encodings
    for row in rows:
        system, turns = episode_of(builder, row, grammar)
        encs = scoring_sequences(builder, system, turns)
        plan.append((len(seqs), encs))
        seqs += [enc.input_ids for enc in encs]
        line = outcome_line(float(row["outcome"]), bool(row["won"]), row["final_observation"])
        seqs.append(list(builder._ids(line))[:builder.max_tokens // 2])
    hidden: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for batch in length_batches([len(s) for s in seqs], max_batch_tokens):
        ids, _ = right_pad([seqs[i] for i in batch], pad_id)
        out = backbone(input_ids=ids.to(device), use_cache=False).last_hidden_state
        for j, i in enumerate(batch):
            hidden[i] = out[j, :len(seqs[i])]
    features = []
    for first, encs in plan:
        m = 1 + max((k for enc in encs for k in enc.turn_ids), default=-1)
        # Per turn: the sequence that scores its response, its tokens' and targets' positions.
        home: dict[int, tuple[int, list[int], list[int]]] = {}
        for s, enc in enumerate(encs):
            spots: dict[int, tuple[list[int], list[int]]] = {}
            for t, (k, on) in enumerate(zip(enc.turn_ids, enc.response_mask, strict=True)):
                if k >= 0:
                    tokens, targets = spots.setdefault(k, ([], []))
                    tokens.append(t)
                    if on and t > 0:
                        targets.append(t)
            for k, (tokens, targets) in spots.items():
                if targets:
                    home[k] = (first + s, tokens, targets)
        queries, targets, tokens, token_ids = [], [], [], []
        query_at, token_at = [0], [0]
        for k in range(m):
            i, at, aim = home[k]
            ids = torch.tensor(seqs[i], device=device)
            aim_t = torch.tensor(aim, device=device)
            queries.append(hidden[i][aim_t - 1])
            targets.append(ids[aim_t])
            tokens.append(hidden[i][torch.tensor(at, device=device)])
            token_ids.append(ids[torch.tensor(at, device=device)])
            query_at.append(query_at[-1] + len(aim))
            token_at.append(token_at[-1] + len(at))
        line = first + len(encs)
        tokens.append(hidden[line])
        token_ids.append(torch.tensor(seqs[line], device=device))
        features.append(EpisodeFeatures(torch.cat(queries), torch.cat(targets), tuple(query_at),
                                        torch.cat(tokens), torch.cat(token_ids),
                                        tuple(token_at)))
    return features


#: Turns whose copy-head reading :func:`pointed_logprobs` pads into one batch.
POINTER_BATCH = 32


def pointed_logprobs(head: torch.nn.Module, pointer: BlockPointer | None,
                     turns: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]]) -> list[torch.Tensor]:
    """``log pi_hind`` of each turn's targets: the LM head's logits on its queries, plus the
    copy head's boost of its keys' tokens (none without a copy head), the turns padded into
    one batch. Each turn is :meth:`EpisodeFeatures.turn`'s (queries [M, d], targets [M], keys
    [S, d], key ids [S]). Shape: → per turn (M,) float32."""
    if not turns:
        return []
    device = turns[0][0].device
    width, span = max(len(t[1]) for t in turns), max(len(t[3]) for t in turns)
    queries = torch.zeros((len(turns), width, turns[0][0].shape[1]), device=device,
                          dtype=turns[0][0].dtype)
    keys = torch.zeros((len(turns), span, turns[0][0].shape[1]), device=device,
                       dtype=turns[0][0].dtype)
    targets = torch.zeros((len(turns), width), dtype=torch.long, device=device)
    key_ids = torch.zeros((len(turns), span), dtype=torch.long, device=device)
    on = torch.zeros((len(turns), width), dtype=torch.bool, device=device)
    seen = torch.zeros((len(turns), span), dtype=torch.bool, device=device)
    for j, (q, t, k, ids) in enumerate(turns):
        queries[j, :len(t)], targets[j, :len(t)], on[j, :len(t)] = q, t, True
        keys[j, :len(ids)], key_ids[j, :len(ids)], seen[j, :len(ids)] = k, ids, True
    logits = head(queries).float()                                             # [B, M, V]
    if pointer is not None:
        # A padded key is seen by no query; a padded query sees no key (the null slot alone).
        logits = pointer.point(logits, queries, keys, key_ids,
                               on[:, :, None] & seen[:, None, :]).float()
    logp = target_logprobs(logits[on], targets[on])
    return list(torch.split(logp, [len(t[1]) for t in turns]))


@torch.inference_mode()
def episode_logprobs(model: PreTrainedModel, builder: PromptBuilder,
                     rows: Sequence[Mapping[str, Any]], grammar: Sequence[str],
                     future: int | None, max_batch_tokens: int = 8192,
                     progress: str | None = None) -> list[list[torch.Tensor]]:
    """:func:`hindsight_logprobs` with ``hindsight.reads: episode``: per row, per turn k,
    ``log pi_hind(a_k^j)`` from ``pi_ref``'s hidden states plus the copy head over the
    ``future`` turns after k and the outcome line (:class:`EpisodeFeatures`).
    Shape: row → m tensors of shape (L_k,)."""
    backbone, head, pointer = _head_parts(model, "it cannot be read with hindsight.reads: episode")
    pad = builder.tokenizer.pad_token_id if builder.tokenizer.pad_token_id is not None else 0
    out: list[list[torch.Tensor]] = []
    for lo in tqdm(range(0, len(rows), CLOSED_CHUNK), desc=progress, unit="chunk",
                   disable=progress is None, mininterval=2):
        feats = episode_features(backbone, builder, rows[lo:lo + CLOSED_CHUNK], grammar, pad,
                                 max_batch_tokens)
        turns = [f.turn(k, future) for f in feats for k in range(f.turns)]
        scores = iter([x.cpu() for i in range(0, len(turns), POINTER_BATCH)
                       for x in pointed_logprobs(head, pointer, turns[i:i + POINTER_BATCH])])
        out += [[next(scores) for _ in range(f.turns)] for f in feats]
    return out


def fit_pointer(pointer: BlockPointer, head: torch.nn.Module,
                features: Sequence[EpisodeFeatures], cfg: HindsightParams,
                on_log: Callable[[int, dict[str, float]], None] | None = None
                ) -> dict[str, float]:
    """Train the copy head alone on :class:`EpisodeFeatures` (``pi_ref`` frozen): mean token
    NLL of the responses under :func:`pointed_logprobs`, AdamW at ``cfg.pointer_lr`` without
    weight decay (as the block route trains it), warm-up and cosine, batches of
    ``micro_batch_size × grad_accum`` turns drawn without replacement (seed ``cfg.seed``),
    ``cfg.epochs`` passes or ``cfg.max_steps`` steps. Returns steps, final loss, turns."""
    items = [(e, k) for e, f in enumerate(features) for k in range(f.turns)]
    if not items:
        raise ValueError("no turns to train the copy head on")
    batch = cfg.micro_batch_size * cfg.grad_accum
    total = max(1, math.ceil(cfg.epochs * len(items) / batch))
    total = min(total, cfg.max_steps) if cfg.max_steps else total
    warmup = math.ceil(cfg.warmup_ratio * total)
    params = list(pointer.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.pointer_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    loss = math.nan
    for step in range(total):
        while len(order) < batch:
            order += torch.randperm(len(items), generator=gen).tolist()
        chosen, order = order[:batch], order[batch:]
        logp = torch.cat(pointed_logprobs(head, pointer, [features[items[i][0]].turn(
            items[i][1], cfg.future) for i in chosen]))
        nll = -logp.mean()
        lr = cfg.pointer_lr * warmup_cosine(step, total, warmup, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        nll.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        loss = float(nll.detach())
        if on_log is not None and ((step + 1) % cfg.log_every == 0 or step + 1 == total):
            on_log(step + 1, {"losses/hindsight": loss, "lr/hindsight": lr})
    return {"steps": total, "loss": loss, "examples": len(items),
            "response_tokens": sum(len(f.targets) for f in features)}


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
