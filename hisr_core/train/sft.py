"""Stage 1: behaviour cloning on expert trajectories ``D_bc`` (docs/method.md, stage 1).

The loss is the negative log-likelihood of response tokens only (each response's end-of-turn
token included, so the policy learns to stop); system prompt, observations and padding carry
none. :func:`hisr_core.train.fit.fit` normalises it by the number of response tokens in the whole
global batch. The hindsight model (stage 5) trains with the same loss on other sequences.

Usage (the ``sft`` task)::

    sequences = encode_trajectories(rows, PromptBuilder(tokenizer, history, max_tokens), grammar)
    stats = train_sft(model, tokenizer, sequences, params.sft, params.model.dtype,
                      on_log=log_to_mlflow, progress=True, lora=params.model.lora, out_dir=path)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedTokenizerBase

from hisr_core.agent.prompts import Encoded, PromptBuilder
from hisr_core.config import FitParams, LoraParams
from hisr_core.rewards.gated_attention import forward_kwargs
from hisr_core.train.engine import lm_parts
from hisr_core.train.fit import Checkpoint, LogFn, fit, setup
from hisr_core.train.scoring import right_pad

IGNORE = -100


# -- data ------------------------------------------------------------------------------------------
def encode_trajectories(rows: Iterable[Mapping[str, Any]], builder: PromptBuilder,
                        grammar: Sequence[str], every_response: bool = False) -> list[Encoded]:
    """Training sequences of ``D_bc`` rows (``instruction`` + ``turns`` of observation/response).

    Each episode becomes the sequences :meth:`PromptBuilder.training_sequences` makes, which
    cover every response once with the context it has at inference. ``every_response``: each
    sequence also trains the context responses it holds (``sft.every_response``). Inadmissible
    turns (an expert's recovery demonstrations slip first) stay in context but carry no loss:
    the policy learns to recover, not to slip.
    """
    out: list[Encoded] = []
    for row in rows:
        system = builder.system(row["instruction"], grammar)
        turns = [(t["observation"], t["response"]) for t in row["turns"]]
        learn = [bool(t.get("admissible", True)) for t in row["turns"]]
        seqs = builder.training_sequences(system, turns, learn)
        if every_response:
            seqs = [builder.encode(system, turns[:s.turns[-1] + 1], s.turns[0], learn=learn)
                    for s in seqs]
        out.extend(seqs)
    return out


@dataclasses.dataclass(frozen=True)
class Batch:
    """A right-padded micro-batch.

    Shape: each tensor [B, T], T the longest sequence of the micro-batch.
        input_ids: token ids, ``pad_id`` after the end of a sequence.
        attention_mask: 1 on real tokens, 0 on padding.
        labels: the token id where it is a response token, else -100 (prompt, observation, pad).
    ``blocks``: per row, the span of a block read through gated attention, or ``None``
    (empty: no row has one).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    blocks: tuple[tuple[int, int, int] | None, ...] = ()

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    @property
    def n_units(self) -> int:
        """Tokens that carry loss (a label at position 0 has no prefix to predict it from)."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def to(self, device: torch.device) -> Batch:
        return dataclasses.replace(self, **{
            f: getattr(self, f).to(device, non_blocking=True)
            for f in ("input_ids", "attention_mask", "labels")})

    def inputs(self) -> dict[str, torch.Tensor]:
        extra = (forward_kwargs(self.blocks, self.input_ids.shape[1], self.input_ids.device)
                 if self.blocks else {})
        return {"input_ids": self.input_ids, "labels": self.labels, **extra}


def collate(sequences: Sequence[Encoded], pad_id: int) -> Batch:
    """Right-pad ``sequences`` to the longest; labels keep response tokens only.

    Shape: B sequences of lengths T_b → tensors [B, max_b T_b].
    """
    ids, attn = right_pad([s.input_ids for s in sequences], pad_id)
    labels = torch.full_like(ids, IGNORE)
    for b, seq in enumerate(sequences):
        n = len(seq.input_ids)
        mask = torch.tensor(seq.response_mask, dtype=torch.bool)
        labels[b, :n] = torch.where(mask, ids[b, :n], torch.full_like(ids[b, :n], IGNORE))
    blocks = tuple(s.block for s in sequences)
    return Batch(ids, attn, labels, blocks if any(b is not None for b in blocks) else ())


# -- loss ------------------------------------------------------------------------------------------
class ResponseNLL(nn.Module):
    """Summed NLL of the labelled (response) tokens of a batch; the module the engine wraps."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                **extra: torch.Tensor) -> torch.Tensor:
        """``sum_t -log p(labels_t | input_ids_<t)`` over labelled positions ``t >= 1``.
        ``extra``: more forward arguments (a gated block's, see :attr:`Batch.blocks`).

        Shape: input_ids, labels [B, T] → scalar.

        No attention mask is passed: with right padding and causal attention a real token never
        sees a pad (pads come after it), and the outputs at pad positions are never scored; so
        the result equals the masked one and attention takes its fast causal path.
        """
        targets = labels[:, 1:]
        keep = targets != IGNORE
        parts = lm_parts(self.model)
        if parts is None:
            logits = self.model(input_ids=input_ids, use_cache=False, **extra).logits[:, :-1][keep]
        else:
            # Project only the scored positions through the LM head (often a third of all).
            backbone, head = parts
            hidden = backbone(input_ids=input_ids, use_cache=False, **extra).last_hidden_state
            logits = head(hidden[:, :-1][keep])
        return F.cross_entropy(logits.float(), targets[keep], reduction="sum")


def train_sft(model: nn.Module, tokenizer: PreTrainedTokenizerBase, sequences: Sequence[Encoded],
              sft: FitParams, dtype: str | torch.dtype = "auto", on_log: LogFn | None = None,
              progress: bool = True, *, lora: LoraParams | None = None,
              out_dir: str | Path | None = None, name: str = "sft",
              extra: Callable[[Path], None] | None = None,
              checkpoint: Checkpoint | None = None) -> dict[str, Any]:
    """Train ``model`` on the masked-in (response) tokens of ``sequences``; optionally save it.

    Collective when launched on several processes (``torchrun``, ``deepspeed``): every rank
    calls it with the same sequences. ``on_log(step, metrics)`` is called on rank 0 only, with
    ``losses/<name>`` (global mean token NLL of the step), ``perf/tokens_per_s``, ``optim/lr``
    and ``optim/grad_norm``. ``model`` is trained in place (wrapped with LoRA first when
    ``lora.enabled``); with ``out_dir`` the result is written there as a plain Hugging Face
    folder (adapters merged) with ``tokenizer``, and ``extra(folder)`` adds its own files
    before the folder appears. ``checkpoint``: resumable checkpoints (see
    :func:`hisr_core.train.fit.fit`).

    Returns the summary: ``steps``, ``loss`` (last step), ``tokens``, ``response_tokens``,
    ``seconds``, ``tokens_per_s``, ``backend``, ``world_size``.
    """
    model, info, backend = setup(model, sft, lora)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine, stats = fit(ResponseNLL(model), model, [len(s.input_ids) for s in sequences],
                        lambda idx: collate([sequences[i] for i in idx], pad_id), sft, info,
                        backend, dtype, name=name, on_log=on_log, progress=progress,
                        checkpoint=checkpoint)
    if out_dir is not None:
        engine.save(out_dir, tokenizer, extra)
    stats["response_tokens"] = stats.pop("units")
    return stats
