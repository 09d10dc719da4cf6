"""The optimisation loop shared by every stage that fits a model on examples: behaviour
cloning (stage 1), the SPRM (stage 4) and the hindsight model (stage 5).

A stage supplies a loss module (returns the *summed* loss of a micro-batch), the examples'
lengths (for length-bucketed batching) and a function that collates a micro-batch. The loop
normalises by the number of loss terms ("units": response tokens for an NLL, trajectories for
the SPRM) in the whole global batch, so the gradient is::

    g = grad( sum_{units u in the global batch} loss_u ) / N_global

whatever the split into processes and micro-batches: 2 processes with micro-batch b and one
process with micro-batch 2b take the same steps.

With a :class:`Checkpoint` the loop writes one every ``checkpoint_every_s`` seconds and when a
SIGTERM or SIGINT stops it (after the optimizer step under way); the same call after a kill
resumes from it and ends with the same weights, data order and losses as a run never stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from hisr_core.config import FitParams, LoraParams
from hisr_core.train import checkpoint as ckpt
from hisr_core.train import preempt
from hisr_core.train.engine import (
    Backend,
    DistInfo,
    Engine,
    OptimSpec,
    all_reduce_sum,
    apply_lora,
    build_engine,
    init_deepspeed_distributed,
    init_distributed,
    resolve_backend,
    resolve_dtype,
)

#: Examples are sorted by length within buckets of this many global micro-batches: padding
#: stays small while the data order stays random at the scale of an epoch.
BUCKET_BATCHES = 50

LogFn = Callable[[int, dict[str, float]], None]


class MicroBatch(Protocol):
    """A collated micro-batch, as the loop needs it."""

    @property
    def n_units(self) -> int:
        """Loss terms in it (the loss module returns their sum)."""

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens, for the throughput figure."""

    def to(self, device: torch.device) -> MicroBatch: ...

    def inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments of the loss module's forward."""


# -- batching --------------------------------------------------------------------------------------
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
                 info: DistInfo, total_steps: int, skip: int = 0) -> Iterator[list[list[int]]]:
    """This rank's micro-batches of each optimizer step: ``grad_accum`` of them (fewer at the end
    of an epoch), epoch after epoch (new order each), for ``total_steps`` steps; the first
    ``skip`` steps' are left out (a resumed run: the order depends on the seed only)."""
    global_batch = micro_batch_size * info.world_size
    done, epoch = 0, 0
    while done < total_steps:
        batches = epoch_batches(lengths, global_batch, seed, epoch, min_size=info.world_size)
        for start in range(0, len(batches), grad_accum):
            if done >= skip:
                yield [rank_slice(b, info) for b in batches[start:start + grad_accum]]
            done += 1
            if done == total_steps:
                return
        epoch += 1


# -- checkpoints -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where a fit keeps its checkpoint (outside any stage output) and what it belongs to.

    ``fingerprint``: of the caller's params and inputs (:func:`hisr_core.train.checkpoint.
    fingerprint`); the fit adds its own (the fit params, the examples' lengths, processes,
    backend). ``meta``: more for the checkpoint's ``meta.json`` (the MLflow run it logs to).
    """

    folder: Path
    fingerprint: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


#: Fit params that change neither the result nor the logged curve: a checkpoint written under
#: another value is resumed.
NOT_FINGERPRINTED = {"checkpoint_every_s"}


def _fit_fingerprint(checkpoint: Checkpoint, params: FitParams, lengths: Sequence[int],
                     name: str, info: DistInfo, backend: Backend, dtype: torch.dtype) -> str:
    blob = json.dumps([checkpoint.fingerprint, name,
                       params.model_dump(mode="json", exclude=NOT_FINGERPRINTED),
                       hashlib.sha256(json.dumps(list(lengths)).encode()).hexdigest(),
                       info.world_size, backend, str(dtype)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _stop(signum: int | None, step: int, total_steps: int, name: str,
          folder: Path | None) -> preempt.Preempted:
    signum = signum or signal.SIGTERM  # a rank stopped by another's signal
    where = (f"checkpoint in {folder}" if folder is not None
             else "no checkpoint (none configured)")
    return preempt.stopped(signum, f"{name}: stopped by {signal.Signals(signum).name} after "
                                   f"step {step} of {total_steps}; {where}")


# -- the loop: one function per step ----------------------------------------------------------------
@dataclasses.dataclass
class _Meter:
    """Running totals for logs and the summary (all global, i.e. summed over ranks)."""

    start: float
    tokens: int = 0
    units: int = 0
    last_log_time: float = 0.0
    last_log_tokens: int = 0
    loss: float = float("nan")
    checkpoints: int = 0
    checkpoint_s: float = 0.0


def setup(model: nn.Module, fit: FitParams, lora: LoraParams | None
          ) -> tuple[nn.Module, DistInfo, Backend]:
    """1. Backend, process group, seeds, adapters (``model`` wrapped with LoRA if enabled)."""
    backend = resolve_backend(fit.backend)
    info = init_deepspeed_distributed() if backend == "deepspeed" else init_distributed()
    # The same seed on every rank: LoRA initialisation agrees, dropout masks follow the seed.
    torch.manual_seed(fit.seed)
    return apply_lora(model, lora), info, backend


def _optim_spec(fit: FitParams, total_steps: int) -> OptimSpec:
    return OptimSpec(lr=fit.lr, weight_decay=fit.weight_decay, warmup_ratio=fit.warmup_ratio,
                     min_lr_ratio=fit.min_lr_ratio, max_grad_norm=fit.max_grad_norm,
                     grad_accum=fit.grad_accum, micro_batch_size=fit.micro_batch_size,
                     total_steps=total_steps, zero_stage=fit.zero_stage)


def _global_counts(batches: Sequence[MicroBatch], device: torch.device) -> tuple[int, int]:
    """2. (loss units, real tokens) of the whole global batch, summed over ranks."""
    local = torch.tensor([sum(b.n_units for b in batches), sum(b.n_tokens for b in batches)],
                         dtype=torch.float64, device=device)
    n_units, n_tokens = all_reduce_sum(local).tolist()
    return int(n_units), int(n_tokens)


def _accumulate(engine: Engine, batches: Sequence[MicroBatch], n_units: int) -> torch.Tensor:
    """3. Forward and backward of every micro-batch; returns this rank's summed loss.

    Each micro-batch contributes ``loss_sum * world_size / N_global``: the backends average
    gradients over ranks (dividing by ``world_size``) and accumulate over micro-batches, so
    the update follows ``sum of all unit losses / N_global``.
    """
    scale = engine.info.world_size / max(1, n_units)
    total = torch.zeros((), dtype=torch.float64, device=engine.device)
    for i, batch in enumerate(batches):
        with engine.micro_step(last=i == len(batches) - 1):
            loss = engine.module(**batch.inputs())
            engine.backward(loss * scale)
        total += loss.detach().double()
    return total


def _report(step: int, total_steps: int, meter: _Meter, optim: dict[str, float], name: str,
            log_every: int, on_log: LogFn | None, bar: tqdm) -> None:
    """4. Progress bar every step; ``on_log`` every ``log_every`` steps and at the last."""
    now = time.perf_counter()
    elapsed = max(now - meter.start, 1e-9)
    bar.update(1)
    bar.set_postfix(loss=f"{meter.loss:.4f}", tok_s=f"{meter.tokens / elapsed:,.0f}")
    if on_log is None or not (step % log_every == 0 or step == total_steps):
        return
    window = max(now - meter.last_log_time, 1e-9)
    on_log(step, {
        f"losses/{name}": meter.loss,
        "perf/tokens_per_s": (meter.tokens - meter.last_log_tokens) / window,
        "optim/lr": optim["lr"],
        "optim/grad_norm": optim["grad_norm"],
    })
    meter.last_log_time, meter.last_log_tokens = now, meter.tokens


def fit(module: nn.Module, model: nn.Module, lengths: Sequence[int],
        load: Callable[[list[int]], MicroBatch], params: FitParams, info: DistInfo,
        backend: Backend, dtype: str | torch.dtype = "auto", *, name: str,
        on_log: LogFn | None = None, progress: bool = True,
        checkpoint: Checkpoint | None = None) -> tuple[Engine, dict[str, Any]]:
    """Train ``module`` (a loss module holding ``model``, already set up by :func:`setup`) on
    examples ``0..len(lengths)-1``; ``load(indices)`` collates a micro-batch of them.

    ``on_log(step, metrics)`` is called on rank 0 only, with ``losses/<name>`` (the global mean
    loss per unit of the step), ``perf/tokens_per_s`` (real tokens, all ranks, since the last
    log), ``optim/lr`` and ``optim/grad_norm``. Returns the engine (to save from) and the
    summary: ``steps``, ``loss`` (last step), ``tokens``, ``units``, ``seconds``,
    ``tokens_per_s``, ``backend``, ``world_size``, ``resumed_from`` (steps done before this
    call), ``checkpoints`` and ``checkpoint_s`` (written by this call, seconds spent).

    With ``checkpoint``: resumes from the checkpoint in its folder when it belongs to this very
    fit (another is discarded), writes one every ``params.checkpoint_every_s`` seconds, and on
    SIGTERM or SIGINT ends the step under way, writes one and raises
    :class:`~hisr_core.train.preempt.Preempted`. The caller removes it once its outputs are
    written (:func:`hisr_core.train.checkpoint.remove`).
    """
    dtype = resolve_dtype(dtype)
    total_steps = count_steps(len(lengths), params.micro_batch_size * info.world_size,
                              info.world_size, params.grad_accum, params.epochs, params.max_steps)
    engine = build_engine(module, _optim_spec(params, total_steps), backend, dtype, info,
                          model=model)
    engines = {"engine": engine}
    meta, folder, fp = None, None, ""
    if checkpoint is not None:
        folder = Path(checkpoint.folder)
        fp = _fit_fingerprint(checkpoint, params, lengths, name, info, backend, dtype)
        if ckpt.keep_if_matching(folder, fp, info) is not None:
            meta = ckpt.load(folder, engines, info, backend)
    done = meta["step"] if meta else 0
    if done and info.is_main:
        print(f"{name}: resuming from its checkpoint after step {done} of {total_steps}")
    windows = step_windows(lengths, params.micro_batch_size, params.grad_accum, params.seed, info,
                           total_steps, skip=done)
    bar = tqdm(total=total_steps, initial=done, desc=name,
               disable=not (progress and info.is_main), dynamic_ncols=True)
    now = time.perf_counter()
    meter = _Meter(start=now - (meta["seconds"] if meta else 0.0))
    if meta:
        meter.tokens, meter.units, meter.loss = meta["tokens"], meta["units"], meta["loss"]
    meter.last_log_time, meter.last_log_tokens = now, meter.tokens
    last_save = now
    engine.module.train()
    with preempt.deferred():
        for step, window in enumerate(windows, start=done + 1):
            batches = [load(mb).to(engine.device) for mb in window]
            n_units, n_tokens = _global_counts(batches, engine.device)
            local = _accumulate(engine, batches, n_units)
            optim = engine.step()
            # One reduction carries the loss and the decisions every rank must share: a stop
            # (any rank's signal) and a timed checkpoint (rank 0's clock).
            due = (checkpoint is not None and info.is_main
                   and time.perf_counter() - last_save >= params.checkpoint_every_s)
            flags = torch.tensor([float(local), float(preempt.requested() is not None),
                                  float(due)], dtype=torch.float64, device=engine.device)
            loss_sum, stop, due = all_reduce_sum(flags).tolist()
            meter.loss = loss_sum / max(1, n_units)
            meter.tokens += n_tokens
            meter.units += n_units
            _report(step, total_steps, meter, optim, name, params.log_every,
                    on_log if info.is_main else None, bar)
            if folder is not None and (stop or (due and step < total_steps)):
                meter.checkpoints += 1
                meter.checkpoint_s += ckpt.save(folder, engines, info, backend, {
                    **(checkpoint.meta if checkpoint else {}), "fingerprint": fp, "name": name,
                    "step": step, "total_steps": total_steps, "tokens": meter.tokens,
                    "units": meter.units, "loss": meter.loss,
                    "seconds": time.perf_counter() - meter.start})
                last_save = time.perf_counter()
            if stop:
                bar.close()
                raise _stop(preempt.requested(), step, total_steps, name, folder)
    bar.close()
    seconds = time.perf_counter() - meter.start
    return engine, {"steps": total_steps, "loss": meter.loss, "tokens": meter.tokens,
                    "units": meter.units, "seconds": seconds,
                    "tokens_per_s": meter.tokens / max(seconds, 1e-9), "backend": backend,
                    "world_size": info.world_size, "resumed_from": done,
                    "checkpoints": meter.checkpoints, "checkpoint_s": meter.checkpoint_s}


def split_by_task(task_ids: Sequence[str], holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) row indices: a seeded ``holdout`` share of the distinct tasks is held
    out with all its samples, so no held-out task was seen in training. At least one task is
    held out when ``holdout > 0`` and there are two or more tasks."""
    tasks = sorted(set(task_ids))
    random.Random(seed).shuffle(tasks)
    n = min(len(tasks) - 1, math.ceil(holdout * len(tasks))) if holdout > 0 else 0
    held = set(tasks[:max(n, 0)])
    train = [i for i, t in enumerate(task_ids) if t not in held]
    return train, [i for i, t in enumerate(task_ids) if t in held]
