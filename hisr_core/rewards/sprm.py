"""Stage 4: the segment-level process reward model (docs/method.md, stage 4).

A backbone initialised from ``pi_ref`` reads a segmented trajectory; the head
``r_i = W2 · SiLU(W1 · h_i)`` maps the last hidden state ``h_i`` at the last response token of
segment i's last turn (its end-of-turn marker) to the segment's reward. Loss per trajectory:
``(R - sum_i r_i)^2``, or the mean of it over the trajectory's prefixes (``sprm.target``,
:func:`sprm_loss`).

A trajectory is read through the same sequences the policy is scored with
(:func:`hisr_core.train.scoring.scoring_sequences`: each turn with the context the policy had), so a
trajectory longer than the context window spans a few sequences and its sum still covers every
segment. Because ``r_i`` depends only on the turn that ends segment i, one pass gives the reward
a segment ending at each turn would get: any segmentation (``turn`` included) is a selection.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import Encoded, PromptBuilder
from hisr_core.config import SprmParams
from hisr_core.segment.segmenter import Segment
from hisr_core.train.engine import barrier, save_model_folder, unwrap_hf
from hisr_core.train.fit import Checkpoint, LogFn, fit, setup
from hisr_core.train.scoring import length_batches, right_pad, scoring_sequences

HEAD_FILE = "sprm_head.safetensors"
CONFIG_FILE = "sprm.json"


class SegmentRewardModel(nn.Module):
    """A causal LM's backbone and the head ``r = W2 · SiLU(W1 · h)`` (no biases, as written).

    ``lm`` is the whole causal LM (possibly wrapped with LoRA) so the folder it is saved to
    loads like any Hugging Face model; its LM head is unused.
    """

    def __init__(self, lm: nn.Module, head_dim: int | None = None,
                 target: Literal["sum", "prefix_sums"] = "sum") -> None:
        super().__init__()
        self.lm, self.target = lm, target
        hidden = unwrap_hf(lm).config.get_text_config().hidden_size
        self.head_dim = head_dim or hidden
        self.w1 = nn.Linear(hidden, self.head_dim, bias=False)
        self.w2 = nn.Linear(self.head_dim, 1, bias=False)
        # Small initial rewards: the first sums start near 0 instead of at a random offset.
        nn.init.normal_(self.w2.weight, std=0.1 / self.head_dim ** 0.5)

    def rewards_at(self, input_ids: torch.Tensor, rows: torch.Tensor,
                   cols: torch.Tensor) -> torch.Tensor:
        """``r`` read at token positions. Shape: input_ids [S, T] (right-padded; causal
        attention keeps pads out of real positions), rows, cols [P] → [P] float32."""
        backbone = unwrap_hf(self.lm).base_model
        hidden = backbone(input_ids=input_ids, use_cache=False).last_hidden_state[rows, cols]
        return self.w2(F.silu(self.w1(hidden.float()))).squeeze(-1).float()

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                owner: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``target: sum``: ``sum_b (R_b - sum_{i in b} r_i)^2``; ``prefix_sums``:
        ``sum_b mean_{j in b} (R_b - sum_{i in b, i <= j} r_i)^2``. Shape: owner [P] (the
        trajectory of each segment end, trajectories in order and their segments in order),
        targets [B] → scalar."""
        r = self.rewards_at(input_ids, rows, cols)
        return sprm_loss(r, owner, targets.to(r.dtype), self.target)


def sprm_loss(r: torch.Tensor, owner: torch.Tensor, targets: torch.Tensor,
              target: Literal["sum", "prefix_sums"] = "sum") -> torch.Tensor:
    """The SPRM's loss (``sprm.target``) from the segment rewards ``r`` of a batch.

    ``sum`` (the paper): each trajectory's rewards sum to its outcome. ``prefix_sums``: each
    prefix of a trajectory (its first j segments, j = 1..n) is regressed on the outcome too.
    By least squares ``sum_{i<=j} r_i`` then estimates the expected outcome after segment j,
    and ``r_i`` the change segment i brings in it: a trajectory's later length, which
    ``sum`` can read off a long failure, is no longer what the rewards fit. Each trajectory's
    prefixes are averaged, so it weighs what it weighs under ``sum``.

    Shape: r, owner [P] (segments grouped by trajectory, in order), targets [B] → scalar."""
    if target == "sum":
        sums = torch.zeros_like(targets).index_add(0, owner, r)
        return ((targets - sums) ** 2).sum()
    counts = torch.bincount(owner, minlength=targets.numel())
    first = torch.cumsum(counts, 0) - counts                       # [B] each one's first segment
    running = torch.cumsum(r, 0)
    prefix = running - (running - r)[first][owner]                 # [P] sum of r up to each end
    return (((targets[owner] - prefix) ** 2) / counts[owner]).sum()


# -- data ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A trajectory as the SPRM reads it.

    sequences: token ids of its scoring sequences.
    turn_ends: per turn k, (sequence index, position) of turn k's last response token.
    seg_ends: the last turn of each segment.
    outcome: R.
    """

    sequences: list[list[int]]
    turn_ends: list[tuple[int, int]]
    seg_ends: list[int]
    outcome: float

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def encode_trajectory(builder: PromptBuilder, system: str, turns: Sequence[tuple[str, str]],
                      segments: Sequence[Segment], outcome: float) -> Trajectory:
    """The scoring sequences of a trajectory and where each turn's response ends in them."""
    return trajectory_of(scoring_sequences(builder, system, turns), len(turns), segments, outcome)


def trajectory_of(seqs: Sequence[Encoded], n_turns: int, segments: Sequence[Segment],
                  outcome: float) -> Trajectory:
    """:func:`encode_trajectory` from a trajectory's scoring sequences, already built."""
    ends: dict[int, tuple[int, int]] = {}
    for s, enc in enumerate(seqs):
        for t, (on, k) in enumerate(zip(enc.response_mask, enc.turn_ids, strict=True)):
            if on:
                ends[k] = (s, t)  # later tokens of the same turn overwrite: the last one stays
    missing = [k for k in range(n_turns) if k not in ends]
    if missing:
        raise ValueError(f"turns {missing} have no response token in the scoring sequences")
    return Trajectory([e.input_ids for e in seqs], [ends[k] for k in range(n_turns)],
                      [s.last for s in segments], float(outcome))


@dataclasses.dataclass(frozen=True)
class SprmBatch:
    """Trajectories of a micro-batch.

    Shape: input_ids [S, T] (every sequence of every trajectory, right-padded); rows, cols,
    owner [P] (a segment end's sequence row, position, and trajectory); targets [B] (R).
    """

    input_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    owner: torch.Tensor
    targets: torch.Tensor
    n_tokens: int

    @property
    def n_units(self) -> int:
        return int(self.targets.numel())

    def to(self, device: torch.device) -> SprmBatch:
        return SprmBatch(*(t.to(device) for t in dataclasses.astuple(self)[:5]), self.n_tokens)

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "rows": self.rows, "cols": self.cols,
                "owner": self.owner, "targets": self.targets}


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> SprmBatch:
    """Right-pad every sequence of ``trajectories``; index the segment ends."""
    seqs = [s for t in trajectories for s in t.sequences]
    ids, _ = right_pad(seqs, pad_id)
    rows, cols, owner, base = [], [], [], 0
    for b, t in enumerate(trajectories):
        for k in t.seg_ends:
            s, pos = t.turn_ends[k]
            rows.append(base + s)
            cols.append(pos)
            owner.append(b)
        base += len(t.sequences)
    as_long = lambda x: torch.tensor(x, dtype=torch.long)
    return SprmBatch(ids, as_long(rows), as_long(cols), as_long(owner),
                     torch.tensor([t.outcome for t in trajectories], dtype=torch.float32),
                     sum(len(s) for s in seqs))


# -- training, inference, saving -------------------------------------------------------------------
def train_sprm(lm: nn.Module, tokenizer: PreTrainedTokenizerBase,
               trajectories: Sequence[Trajectory], params: SprmParams,
               dtype: str | torch.dtype = "auto", on_log: LogFn | None = None,
               progress: bool = True, out_dir: str | Path | None = None, name: str = "sprm",
               checkpoint: Checkpoint | None = None
               ) -> tuple[SegmentRewardModel, dict[str, Any]]:
    """Fit the SPRM (backbone ``lm``, fully or with LoRA, and a new head) on ``trajectories``;
    optionally save it. ``on_log`` gets ``losses/<name>`` (squared error per trajectory);
    ``checkpoint``: resumable checkpoints (see :func:`hisr_core.train.fit.fit`)."""
    lm, info, backend = setup(lm, params, params.lora)
    # After setup: the head follows the seed.
    model = SegmentRewardModel(lm, params.head_dim, params.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    engine, stats = fit(model, model, [t.n_tokens for t in trajectories],
                        lambda idx: collate([trajectories[i] for i in idx], pad_id), params, info,
                        backend, dtype, name=name, on_log=on_log, progress=progress,
                        checkpoint=checkpoint)
    if out_dir is not None:
        with engine.full_weights():
            if info.is_main:
                save_sprm(model, out_dir, tokenizer)
        barrier()
    stats["trajectories"] = stats.pop("units")
    return model, stats


@torch.inference_mode()
def turn_rewards(model: SegmentRewardModel, trajectories: Sequence[Trajectory], pad_id: int,
                 max_batch_tokens: int = 8192) -> list[torch.Tensor]:
    """Per trajectory, the reward ``r`` a segment ending at each turn gets. Shape: trajectory
    of m turns → (m,) float32; ``R_hat`` of a segmentation is ``r[[s.last for s in segs]]``."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # Every scoring sequence of every trajectory, with the turns that end in it.
    flat = [(traj.sequences[s], [(t, k, pos) for k, (sk, pos) in enumerate(traj.turn_ends)
                                 if sk == s])
            for t, traj in enumerate(trajectories) for s in range(len(traj.sequences))]
    out = [torch.zeros(len(t.turn_ends)) for t in trajectories]
    for batch in length_batches([len(seq) for seq, _ in flat], max_batch_tokens):
        ids, _ = right_pad([flat[i][0] for i in batch], pad_id)
        where = [(r, t, k, pos) for r, i in enumerate(batch) for t, k, pos in flat[i][1]]
        rows = torch.tensor([w[0] for w in where], dtype=torch.long, device=device)
        cols = torch.tensor([w[3] for w in where], dtype=torch.long, device=device)
        values = model.rewards_at(ids.to(device), rows, cols).cpu().tolist()
        for (_, t, k, _), value in zip(where, values, strict=True):
            out[t][k] = value
    model.train(was_training)
    return out


def save_sprm(model: SegmentRewardModel, out_dir: str | Path,
              tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """A Hugging Face folder of the backbone's causal LM (LoRA merged), the head's weights and
    its config, written atomically."""
    head = {"w1": model.w1.weight.detach().float().cpu().contiguous(),
            "w2": model.w2.weight.detach().float().cpu().contiguous()}

    def write_head(folder: Path) -> None:
        save_file(head, str(folder / HEAD_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps({"head_dim": model.head_dim}) + "\n")

    return save_model_folder(model.lm, out_dir, tokenizer, extra=write_head)


def load_sprm(path: str | Path, dtype: torch.dtype | None = None
              ) -> tuple[SegmentRewardModel, PreTrainedTokenizerBase]:
    """The SPRM saved by :func:`save_sprm`, in eval mode, and its tokenizer."""
    path = Path(path)
    if not (path / HEAD_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an SPRM folder (no {HEAD_FILE} / {CONFIG_FILE}); "
                                "run the sprm stage first (dvc repro sprm)")
    config = json.loads((path / CONFIG_FILE).read_text())
    model = SegmentRewardModel(load_model(path, dtype=dtype), config["head_dim"])
    head = load_file(str(path / HEAD_FILE))
    model.w1.weight.data.copy_(head["w1"])
    model.w2.weight.data.copy_(head["w2"])
    return model.eval(), load_tokenizer(path)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of two equal-length samples; NaN when either is constant."""
    a = torch.tensor(list(x), dtype=torch.float64)
    b = torch.tensor(list(y), dtype=torch.float64)
    if a.numel() != b.numel() or a.numel() < 2:
        raise ValueError(f"pearson needs two samples of the same size >= 2, got {a.numel()}, "
                         f"{b.numel()}")
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    return float((a * b).sum()) / denom if denom > 0 else float("nan")


def evaluate(model: SegmentRewardModel, trajectories: Sequence[Trajectory], pad_id: int,
             max_batch_tokens: int = 8192) -> dict[str, float]:
    """``mse`` of the predicted sum against R and their ``pearson`` r, over ``trajectories``."""
    r = turn_rewards(model, trajectories, pad_id, max_batch_tokens)
    sums = [float(x[t.seg_ends].sum()) for x, t in zip(r, trajectories, strict=True)]
    target = [t.outcome for t in trajectories]
    mse = sum((s - y) ** 2 for s, y in zip(sums, target, strict=True)) / len(sums)
    return {"mse": mse, "pearson": pearson(sums, target), "trajectories": len(sums)}
