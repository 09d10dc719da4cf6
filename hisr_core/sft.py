"""Stage 1: behaviour cloning on expert trajectories ``D_bc`` (METHOD.md, stage 1).

The loss is the negative log-likelihood of response tokens only (each response's end-of-turn
token included, so the policy learns to stop); system prompt, observations and padding carry
none. Per optimizer step it is normalised by the number of response tokens in the whole global
batch (every micro-batch of the accumulation window on every rank), so the gradient is::

    g = grad( sum_{response tokens t in the global batch} -log p(x_t | x_<t) ) / N_global

whatever the split into processes and micro-batches: 2 processes with micro-batch b and one
process with micro-batch 2b take the same steps.

Usage (the ``sft`` task)::

    sequences = encode_trajectories(rows, PromptBuilder(tokenizer, history, max_tokens), grammar)
    stats = train_sft(model, tokenizer, sequences, params.sft, params.model.dtype,
                      on_log=log_to_mlflow, progress=True, lora=params.model.lora, out_dir=path)
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from hisr_core.config import LoraParams, SftParams
from hisr_core.prompts import Encoded, PromptBuilder, system_text
from hisr_core.training import (
    Backend,
    DistInfo,
    Engine,
    OptimSpec,
    all_reduce_sum,
    apply_lora,
    build_engine,
    init_deepspeed_distributed,
    init_distributed,
    lm_parts,
    resolve_backend,
    resolve_dtype,
)

IGNORE = -100
#: Sequences are sorted by length within buckets of this many global micro-batches: padding
#: stays small while the data order stays random at the scale of an epoch.
BUCKET_BATCHES = 50

LogFn = Callable[[int, dict[str, float]], None]


# -- data ------------------------------------------------------------------------------------------
def encode_trajectories(rows: Iterable[Mapping[str, Any]], builder: PromptBuilder,
                        grammar: Sequence[str]) -> list[Encoded]:
    """Training sequences of ``D_bc`` rows (``instruction`` + ``turns`` of observation/response).

    Each episode becomes the sequences :meth:`PromptBuilder.training_sequences` makes, which
    cover every response once with the context it has at inference. Inadmissible turns (an
    expert's recovery demonstrations slip first) stay in context but carry no loss: the policy
    learns to recover, not to slip.
    """
    out: list[Encoded] = []
    for row in rows:
        system = system_text(row["instruction"], grammar)
        turns = [(t["observation"], t["response"]) for t in row["turns"]]
        learn = [bool(t.get("admissible", True)) for t in row["turns"]]
        out.extend(builder.training_sequences(system, turns, learn))
    return out


@dataclasses.dataclass(frozen=True)
class Batch:
    """A right-padded micro-batch.

    Shape: each tensor [B, T], T the longest sequence of the micro-batch.
        input_ids: token ids, ``pad_id`` after the end of a sequence.
        attention_mask: 1 on real tokens, 0 on padding.
        labels: the token id where it is a response token, else -100 (prompt, observation, pad).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    @property
    def n_response(self) -> int:
        """Tokens that carry loss (a label at position 0 has no prefix to predict it from)."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in dataclasses.astuple(self)))


def collate(sequences: Sequence[Encoded], pad_id: int) -> Batch:
    """Right-pad ``sequences`` to the longest; labels keep response tokens only.

    Shape: B sequences of lengths T_b → tensors [B, max_b T_b].
    """
    width = max(len(s.input_ids) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(sequences), width), dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    for b, seq in enumerate(sequences):
        n = len(seq.input_ids)
        row = torch.tensor(seq.input_ids, dtype=torch.long)
        mask = torch.tensor(seq.response_mask, dtype=torch.bool)
        ids[b, :n] = row
        attn[b, :n] = 1
        labels[b, :n] = torch.where(mask, row, torch.full_like(row, IGNORE))
    return Batch(ids, attn, labels)


def epoch_batches(lengths: Sequence[int], global_batch: int, seed: int, epoch: int,
                  min_size: int = 1) -> list[list[int]]:
    """Sequence indices of each global micro-batch of one epoch.

    Seeded shuffle, then sorting by length within buckets of ``BUCKET_BATCHES`` batches (less
    padding), then a shuffle of the batches. Depends on ``global_batch`` = micro-batch x ranks,
    never on the number of ranks, so every process count sees the same global batches. Only the
    last batch can be short; it is dropped if it has fewer than ``min_size`` sequences.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    bucket = BUCKET_BATCHES * global_batch
    batches: list[list[int]] = []
    for start in range(0, len(order), bucket):
        chunk = sorted(order[start:start + bucket], key=lambda i: -lengths[i])
        batches += [chunk[j:j + global_batch] for j in range(0, len(chunk), global_batch)]
    batches = [b for b in batches if len(b) >= min_size]
    rng.shuffle(batches)
    return batches


def rank_slice(batch: Sequence[int], info: DistInfo) -> list[int]:
    """This rank's share of a global micro-batch: every ``world_size``-th sequence of the
    length-sorted batch, so ranks get similar lengths."""
    return list(batch[info.rank::info.world_size])


def count_steps(n_sequences: int, global_batch: int, world_size: int, grad_accum: int,
                epochs: float, max_steps: int | None) -> int:
    """Optimizer steps of a run: ``ceil(epochs x windows per epoch)``, at most ``max_steps``."""
    full, rest = divmod(n_sequences, global_batch)
    per_epoch = full + int(rest >= max(1, world_size))
    if per_epoch == 0:
        raise ValueError(f"{n_sequences} training sequences cannot fill a micro-batch on each of "
                         f"{world_size} processes")
    steps = max(1, math.ceil(epochs * math.ceil(per_epoch / grad_accum)))
    return min(steps, max_steps) if max_steps is not None else steps


def step_windows(lengths: Sequence[int], micro_batch_size: int, grad_accum: int, seed: int,
                 info: DistInfo, total_steps: int) -> Iterator[list[list[int]]]:
    """This rank's micro-batches of each optimizer step: ``grad_accum`` of them (fewer at the end
    of an epoch), epoch after epoch (new order each), for ``total_steps`` steps."""
    global_batch = micro_batch_size * info.world_size
    done, epoch = 0, 0
    while True:
        batches = epoch_batches(lengths, global_batch, seed, epoch, min_size=info.world_size)
        for start in range(0, len(batches), grad_accum):
            yield [rank_slice(b, info) for b in batches[start:start + grad_accum]]
            done += 1
            if done == total_steps:
                return
        epoch += 1


# -- loss ------------------------------------------------------------------------------------------
class ResponseNLL(nn.Module):
    """Summed NLL of the labelled (response) tokens of a batch; the module the engine wraps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``sum_t -log p(labels_t | input_ids_<t)`` over labelled positions ``t >= 1``.

        Shape: input_ids, labels [B, T] → scalar.

        No attention mask is passed: with right padding and causal attention a real token never
        sees a pad (pads come after it), and the outputs at pad positions are never scored; so
        the result equals the masked one and attention takes its fast causal path.
        """
        targets = labels[:, 1:]
        keep = targets != IGNORE
        parts = lm_parts(self.model)
        if parts is None:
            logits = self.model(input_ids=input_ids, use_cache=False).logits[:, :-1][keep]
        else:
            # Project only the scored positions through the LM head (often a third of all).
            backbone, head = parts
            hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state
            logits = head(hidden[:, :-1][keep])
        return F.cross_entropy(logits.float(), targets[keep], reduction="sum")


# -- the loop: one function per step ----------------------------------------------------------------
@dataclasses.dataclass
class _Meter:
    """Running totals for logs and the summary (all global, i.e. summed over ranks)."""

    start: float
    tokens: int = 0
    response_tokens: int = 0
    last_log_time: float = 0.0
    last_log_tokens: int = 0
    loss: float = float("nan")


def _setup(model: nn.Module, sft: SftParams, lora: LoraParams | None
           ) -> tuple[nn.Module, DistInfo, Backend]:
    """1. Backend, process group, seeds, adapters."""
    backend = resolve_backend(sft.backend)
    info = init_deepspeed_distributed() if backend == "deepspeed" else init_distributed()
    # The same seed on every rank: LoRA initialisation agrees, dropout masks follow the seed.
    torch.manual_seed(sft.seed)
    return apply_lora(model, lora), info, backend


def _optim_spec(sft: SftParams, total_steps: int) -> OptimSpec:
    return OptimSpec(lr=sft.lr, weight_decay=sft.weight_decay, warmup_ratio=sft.warmup_ratio,
                     min_lr_ratio=sft.min_lr_ratio, max_grad_norm=sft.max_grad_norm,
                     grad_accum=sft.grad_accum, micro_batch_size=sft.micro_batch_size,
                     total_steps=total_steps, zero_stage=sft.zero_stage)


def _load_window(sequences: Sequence[Encoded], window: list[list[int]], pad_id: int,
                 device: torch.device) -> list[Batch]:
    """2. This rank's micro-batches of the step, collated and on the device."""
    return [collate([sequences[i] for i in mb], pad_id).to(device) for mb in window]


def _global_counts(batches: Sequence[Batch], device: torch.device) -> tuple[int, int]:
    """3. (response tokens, real tokens) of the whole global batch, summed over ranks."""
    local = torch.tensor([sum(b.n_response for b in batches), sum(b.n_tokens for b in batches)],
                         dtype=torch.float64, device=device)
    n_response, n_tokens = all_reduce_sum(local).tolist()
    return int(n_response), int(n_tokens)


def _accumulate(engine: Engine, batches: Sequence[Batch], n_response: int) -> torch.Tensor:
    """4. Forward and backward of every micro-batch; returns this rank's summed NLL.

    Each micro-batch contributes ``nll_sum * world_size / N_global``: the backends average
    gradients over ranks (dividing by ``world_size``) and accumulate over micro-batches, so
    the update follows ``sum of all token NLLs / N_global`` (METHOD.md stage 1, normalised
    per global batch).
    """
    scale = engine.info.world_size / max(1, n_response)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i, batch in enumerate(batches):
        with engine.micro_step(last=i == len(batches) - 1):
            nll = engine.module(input_ids=batch.input_ids, labels=batch.labels)
            engine.backward(nll * scale)
        total += nll.detach().double()
    return total


def _global_loss(local_nll: torch.Tensor, n_response: int) -> float:
    """5. Mean token NLL of the step over the global batch (the logged loss)."""
    return float(all_reduce_sum(local_nll)) / max(1, n_response)


def _report(step: int, total_steps: int, meter: _Meter, optim: dict[str, float],
            log_every: int, on_log: LogFn | None, bar: tqdm) -> None:
    """6. Progress bar every step; ``on_log`` every ``log_every`` steps and at the last."""
    now = time.perf_counter()
    elapsed = max(now - meter.start, 1e-9)
    bar.update(1)
    bar.set_postfix(loss=f"{meter.loss:.4f}", tok_s=f"{meter.tokens / elapsed:,.0f}")
    if on_log is None or not (step % log_every == 0 or step == total_steps):
        return
    window = max(now - meter.last_log_time, 1e-9)
    on_log(step, {
        "losses/sft": meter.loss,
        "perf/tokens_per_s": (meter.tokens - meter.last_log_tokens) / window,
        "optim/lr": optim["lr"],
        "optim/grad_norm": optim["grad_norm"],
    })
    meter.last_log_time, meter.last_log_tokens = now, meter.tokens


def train_sft(model: nn.Module, tokenizer: PreTrainedTokenizerBase, sequences: Sequence[Encoded],
              sft: SftParams, dtype: str | torch.dtype = "auto", on_log: LogFn | None = None,
              progress: bool = True, *, lora: LoraParams | None = None,
              out_dir: str | Path | None = None) -> dict[str, Any]:
    """Behaviour-clone ``model`` on ``sequences`` (METHOD.md stage 1); optionally save it.

    Collective when launched on several processes (``torchrun``, ``deepspeed``): every rank
    calls it with the same sequences. ``on_log(step, metrics)`` is called on rank 0 only, with
    ``losses/sft`` (global mean token NLL of the step), ``perf/tokens_per_s`` (real tokens, all
    ranks, since the last log), ``optim/lr`` and ``optim/grad_norm``. ``model`` is trained in
    place (wrapped with LoRA first when ``lora.enabled``); with ``out_dir`` the result is written
    there as a plain Hugging Face folder (adapters merged) with ``tokenizer``.

    Returns the summary: ``steps``, ``loss`` (last step), ``tokens``, ``response_tokens``,
    ``seconds``, ``tokens_per_s``, ``backend``, ``world_size``.
    """
    model, info, backend = _setup(model, sft, lora)
    lengths = [len(s.input_ids) for s in sequences]
    total_steps = count_steps(len(sequences), sft.micro_batch_size * info.world_size,
                              info.world_size, sft.grad_accum, sft.epochs, sft.max_steps)
    engine = build_engine(ResponseNLL(model), _optim_spec(sft, total_steps), backend,
                          resolve_dtype(dtype), info, model=model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    windows = step_windows(lengths, sft.micro_batch_size, sft.grad_accum, sft.seed, info,
                           total_steps)
    bar = tqdm(total=total_steps, desc="sft", disable=not (progress and info.is_main),
               dynamic_ncols=True)
    meter = _Meter(start=time.perf_counter())
    meter.last_log_time = meter.start
    engine.module.train()
    for step, window in enumerate(windows, start=1):
        batches = _load_window(sequences, window, pad_id, engine.device)
        n_response, n_tokens = _global_counts(batches, engine.device)
        local_nll = _accumulate(engine, batches, n_response)
        optim = engine.step()
        meter.loss = _global_loss(local_nll, n_response)
        meter.tokens += n_tokens
        meter.response_tokens += n_response
        _report(step, total_steps, meter, optim, sft.log_every,
                on_log if info.is_main else None, bar)
    bar.close()
    seconds = time.perf_counter() - meter.start
    if out_dir is not None:
        engine.save(out_dir, tokenizer)
    return {"steps": total_steps, "loss": meter.loss, "tokens": meter.tokens,
            "response_tokens": meter.response_tokens, "seconds": seconds,
            "tokens_per_s": meter.tokens / max(seconds, 1e-9), "backend": backend,
            "world_size": info.world_size}
