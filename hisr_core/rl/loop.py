"""Stage 7: the multi-turn PPO loop (docs/method.md stage 7) as short, numbered step functions.

One iteration (:func:`run_iteration`):

1. **collect**: play this iteration's training tasks with the current policy (online), or take
   this iteration's trajectories of ``D_st`` with their precomputed rewards (offline).
2. **segment**: the configured segmenter (``turn`` for ``no_spr`` / ``no_both``).
3. **score**: one batched pass per model over the trajectories' scoring sequences: the current
   policy's log-probs (they are both PPO's ``old_logp`` and HISR's ``log pi`` of the log-ratio,
   computed once), ``pi_ref``'s (KL), the critic's values, ``pi_hind``'s, the SPRM's.
4. **fuse**: the variant's per-turn rewards (:func:`hisr_core.rewards.modulation.variant_rewards`) on
   each turn's last response token.
5. **advantages**: GAE over response tokens (GRPO: the group-normalised outcome on every
   response token), whitened with moments summed over every process.
6. **update**: ``ppo_epochs`` passes, each of ``minibatches`` optimizer steps of the policy and
   the critic (separate models and optimizers, the same step code as SFT's engine).
7. **log** and 8. **checkpoint** (:func:`save_checkpoint`, atomic; :func:`load_checkpoint`).

With several processes each plays and scores its share of the tasks (a task's group stays on
one process); the update samples are then gathered so every process takes its slice of the
same global micro-batches as one process would (:func:`hisr_core.train.fit.epoch_batches`).
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hisr_core.agent.prompts import Encoded, PromptBuilder
from hisr_core.config import PpoParams
from hisr_core.envs import UNKNOWN_DISTANCE, Environment, Task
from hisr_core.rewards.credit import (
    CreditRecord,
    first_error_top1,
    mean_kendall_tau,
    pooled_spearman,
    relative_margin,
    return_margin,
    segment_credit,
)
from hisr_core.rewards.hindsight import Window, hindsight_logprobs
from hisr_core.rewards.modulation import (
    MODULATED,
    PAPER,
    TURN_LEVEL,
    RewardOptions,
    log_ratio,
    variant_rewards,
)
from hisr_core.rewards.sprm import SegmentRewardModel, trajectory_of, turn_rewards
from hisr_core.rl.ppo import (
    entropy_from_logits,
    explained_variance,
    gae,
    group_advantages,
    kl_penalty,
    masked_moments,
    place_turn_rewards,
    policy_loss,
    value_loss,
    whiten,
)
from hisr_core.rollout.engine import Sampling, play
from hisr_core.rollout.hf import HFGenerator, resolve_kv_dtype
from hisr_core.segment.segmenter import Segment, by_turn, segment_offline, validate
from hisr_core.train import checkpoint as ckpt
from hisr_core.train import preempt
from hisr_core.train.engine import (
    Backend,
    DistInfo,
    Engine,
    OptimSpec,
    all_reduce_sum,
    apply_lora,
    barrier,
    build_engine,
    init_deepspeed_distributed,
    init_distributed,
    lm_parts,
    resolve_backend,
    save_model_folder,
    unwrap_hf,
)
from hisr_core.train.fit import epoch_batches, rank_slice
from hisr_core.train.scoring import (
    episode_of,
    length_batches,
    masked_logprobs,
    right_pad,
    scored_logits,
    scoring_sequences,
    target_logprobs,
)

#: Variants trained by this loop (``rft`` is supervised fine-tuning, see the ``ppo`` stage).
PPO_VARIANTS = ("hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo", "grpo")
VALUE_HEAD_FILE = "value_head.safetensors"


# -- models ----------------------------------------------------------------------------------------
class ValueModel(nn.Module):
    """The critic: a causal LM's backbone (initialised from ``pi_ref``) and a scalar head.

    ``lm`` is the whole causal LM so its folder loads like any Hugging Face model; its LM head
    is unused. The value of a response token is read at the position that predicts it (as its
    log-prob is), i.e. from the state before the token was generated.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        hidden = unwrap_hf(lm).config.get_text_config().hidden_size
        self.v_head = nn.Linear(hidden, 1)
        # Small initial values, but a non-zero head so the backbone learns from the first step.
        nn.init.normal_(self.v_head.weight, std=0.1 / hidden ** 0.5)
        nn.init.zeros_(self.v_head.bias)

    def values(self, input_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Shape: input_ids [B, T] right-padded, keep [B, T-1] → [N] float32 (kept positions,
        row-major)."""
        hidden = unwrap_hf(self.lm).base_model(input_ids=input_ids,
                                                 use_cache=False).last_hidden_state
        return self.v_head(hidden[:, :-1][keep].float()).squeeze(-1).float()


class PolicyLoss(nn.Module):
    """Summed per-token PPO policy loss of a micro-batch: clipped surrogate, plus
    ``kl_coef * KL(pi || pi_ref)``, minus ``entropy_coef * H``. Returns (loss, stats) with
    stats ``[surrogate, kl, entropy, clipped, ratio]`` summed over tokens (detached)."""

    def __init__(self, model: nn.Module, cfg: PpoParams) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, input_ids: torch.Tensor, keep: torch.Tensor, old_logp: torch.Tensor,
                advantages: torch.Tensor, ref_logp: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = scored_logits(self.model, input_ids, keep, lm_parts(self.model))
        logp = target_logprobs(logits, input_ids[:, 1:][keep])
        surrogate, clipped = policy_loss(logp, old_logp, advantages, self.cfg.clip)
        loss = surrogate
        kl = torch.zeros_like(logp)
        if self.cfg.kl_coef > 0:
            kl = kl_penalty(logp, ref_logp, self.cfg.kl_estimator)
            loss = loss + self.cfg.kl_coef * kl
        with torch.set_grad_enabled(self.cfg.entropy_coef > 0 and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
        if self.cfg.entropy_coef > 0:
            loss = loss - self.cfg.entropy_coef * entropy
        stats = torch.stack([surrogate.sum(), kl.sum(), entropy.sum(), clipped.sum(),
                             torch.exp(logp - old_logp).sum()]).detach().double()
        return loss.sum(), stats


class CriticLoss(nn.Module):
    """Summed ``vf_coef *`` clipped value loss of a micro-batch. Returns (loss, stats) with
    stats ``[value loss, clipped, value]`` summed over tokens (detached)."""

    def __init__(self, critic: ValueModel, cfg: PpoParams) -> None:
        super().__init__()
        self.critic, self.cfg = critic, cfg

    def forward(self, input_ids: torch.Tensor, keep: torch.Tensor, old_values: torch.Tensor,
                returns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = self.critic.values(input_ids, keep)
        loss, clipped = value_loss(values, old_values, returns, self.cfg.value_clip)
        stats = torch.stack([loss.sum(), clipped.sum(), values.sum()]).detach().double()
        return self.cfg.vf_coef * loss.sum(), stats


@dataclasses.dataclass
class Frozen:
    """Models that score but never train (``None`` where the variant does not need them).

    ref: ``pi_ref`` (the KL term); with a LoRA policy, the policy with adapters disabled.
    hind: ``pi_hind``. sprm / turn_sprm: the segment- and turn-level reward models.
    """

    ref: nn.Module | None = None
    hind: nn.Module | None = None
    sprm: SegmentRewardModel | None = None
    turn_sprm: SegmentRewardModel | None = None


@dataclasses.dataclass
class Learner:
    """The trainable side: policy and critic engines (no critic for ``grpo``)."""

    policy: Engine
    critic: Engine | None
    info: DistInfo
    backend: Backend
    variant: str
    cfg: PpoParams

    @property
    def policy_model(self) -> nn.Module:
        return self.policy.model

    @property
    def value_model(self) -> ValueModel | None:
        return None if self.critic is None else self.critic.model  # type: ignore[return-value]


def needs(variant: str, cfg: PpoParams, ratio_reference: str = "policy") -> dict[str, bool]:
    """Which frozen models a variant reads: ``ref`` (the KL term, or the hindsight log-ratio's
    reference under ``rewards.ratio_reference: pi_ref``), ``hind``, ``sprm``, ``turn_sprm``,
    and whether it trains a ``critic``."""
    online = cfg.mode == "online"
    return {"ref": cfg.kl_coef > 0 or (online and variant in MODULATED
                                       and ratio_reference == "pi_ref"),
            "hind": online and variant in MODULATED,
            "sprm": online and variant in {"hisr", "no_him", "no_agr"},
            "turn_sprm": online and variant in TURN_LEVEL,
            "critic": variant != "grpo"}


def setup(policy: PreTrainedModel, critic_lm: PreTrainedModel | None, cfg: PpoParams,
          variant: str, dtype: torch.dtype) -> Learner:
    """Backend, process group, seeds, LoRA, and the two engines (AdamW, warm-up + cosine over
    ``iterations x ppo_epochs x minibatches`` steps)."""
    if variant not in PPO_VARIANTS:
        raise ValueError(f"variant {variant!r} is not trained by PPO; expected one of "
                         f"{PPO_VARIANTS}")
    if (critic_lm is None) != (variant == "grpo"):
        raise ValueError("a critic is needed by every variant but grpo")
    backend = resolve_backend(cfg.backend)
    info = init_deepspeed_distributed() if backend == "deepspeed" else init_distributed()
    torch.manual_seed(cfg.seed)
    policy_model = apply_lora(policy, cfg.lora)
    spec: dict[str, Any] = {
        "weight_decay": cfg.weight_decay, "warmup_ratio": cfg.warmup_ratio,
        "min_lr_ratio": cfg.min_lr_ratio, "max_grad_norm": cfg.max_grad_norm, "grad_accum": 1,
        "micro_batch_size": cfg.micro_batch_size,
        "total_steps": cfg.iterations * cfg.ppo_epochs * cfg.minibatches,
        "zero_stage": cfg.zero_stage}
    policy_engine = build_engine(PolicyLoss(policy_model, cfg), OptimSpec(lr=cfg.lr, **spec),
                                 backend, dtype, info, model=policy_model)
    critic_engine = None
    if critic_lm is not None:
        critic = ValueModel(critic_lm)
        critic_engine = build_engine(CriticLoss(critic, cfg), OptimSpec(lr=cfg.critic_lr, **spec),
                                     backend, dtype, info, model=critic)
    return Learner(policy_engine, critic_engine, info, backend, variant, cfg)


# -- 1. collect ------------------------------------------------------------------------------------
def iteration_tasks(tasks: Sequence[Task], cfg: PpoParams, iteration: int) -> list[int]:
    """Indices of iteration ``iteration``'s tasks: consecutive slices of a seeded shuffle of
    ``tasks``, reshuffled on each pass; the same on every process and after a resume."""
    n, k = len(tasks), cfg.tasks_per_iter
    if n == 0:
        raise ValueError("no training tasks")
    out = []
    for position in range(iteration * k, iteration * k + k):
        epoch, index = divmod(position, n)
        order = list(range(n))
        random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[index])
    return out


def collect(policy: nn.Module, builder: PromptBuilder, env: Environment, tasks: Sequence[Task],
            cfg: PpoParams, max_new_tokens: int, batch_size: int, iteration: int,
            progress: bool = False, kv_dtype: str = "bfloat16"
            ) -> list[dict[str, Any]]:
    """Play ``tasks`` ``samples_per_task`` times each with the current policy (sampling seeded
    by iteration and episode, so a resumed run draws the same episodes)."""
    from tqdm.auto import tqdm

    model = unwrap_hf(policy)  # LoRA layers stay injected; plain HF forward signature
    generator = HFGenerator(model, builder.tokenizer, builder.stop_ids,
                            seed=cfg.seed * 1_000_003 + iteration, max_rows=batch_size,
                            kv_dtype=resolve_kv_dtype(kv_dtype, model))
    with tqdm(total=len(tasks) * cfg.samples_per_task, desc=f"iteration {iteration + 1} play",
              unit="ep", disable=not progress, leave=False, mininterval=2) as bar:
        rows = play(env, tasks, generator, builder,
                    Sampling(cfg.temperature, cfg.top_p, max_new_tokens), batch_size,
                    samples_per_task=cfg.samples_per_task, on_episode=lambda _: bar.update())
    for row in rows:
        row["outcome"] = row["score"]
    return rows


# -- 2. segment ------------------------------------------------------------------------------------
def segment(rows: Sequence[Mapping[str, Any]], variant: str, segmenter: str,
            verbs: Sequence[str], entropy_threshold: float = 0.5,
            entropy_min_turns: int = 2) -> list[list[Segment]]:
    """Each trajectory's segments: ``turn`` for the turn-level variants, else ``segmenter``
    (an offline one: ``rule``, ``entropy`` or ``turn``)."""
    name = "turn" if variant in TURN_LEVEL else segmenter
    out = []
    for row in rows:
        if variant in TURN_LEVEL:
            segments = by_turn([t["action"] for t in row["turns"]])
        else:
            segments = segment_offline(name, row["turns"], verbs, entropy_threshold,
                                       entropy_min_turns)
        validate(segments, len(row["turns"]))
        out.append(segments)
    return out


# -- 3. score --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Scored:
    """One trajectory after scoring. Per scoring sequence s with n_s response tokens:
    old_logp, ref_logp, values (n_s,); per turn k: hind_logp (L_k,); model_r: the reward
    models' per-turn rewards (m,) by name (``sprm``, ``turn_sprm``); ``None`` / absent where
    not computed. turn_rewards (m,): the variant's, set by :func:`fuse`."""

    row: dict[str, Any]
    segments: list[Segment]
    sequences: list[Encoded]
    old_logp: list[torch.Tensor]
    ref_logp: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    hind_logp: list[torch.Tensor] | None = None
    model_r: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    turn_rewards: torch.Tensor | None = None

    def turn_of_token(self) -> torch.Tensor:
        """The turn of each response token, in trajectory order. Shape: (N,) long."""
        return torch.tensor([k for enc in self.sequences
                             for k, on in zip(enc.turn_ids, enc.response_mask, strict=True) if on],
                            dtype=torch.long)

    def per_turn(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-sequence token values regrouped per turn. Shape: m tensors (L_k,)."""
        values = torch.cat(list(flat)) if flat else torch.zeros(0)
        owners = self.turn_of_token()
        return [values[owners == k] for k in range(len(self.row["turns"]))]


def _pad_id(builder: PromptBuilder) -> int:
    pad = builder.tokenizer.pad_token_id
    return pad if pad is not None else 0


@torch.inference_mode()
def critic_values(critic: ValueModel, encoded: Sequence[Encoded], pad_id: int,
                  max_batch_tokens: int) -> list[torch.Tensor]:
    """The critic's value of each response token of each sequence. Shape: (n_s,) float32."""
    device = next(critic.parameters()).device
    out: list[torch.Tensor | None] = [None] * len(encoded)
    for batch in length_batches([len(e.input_ids) for e in encoded], max_batch_tokens):
        ids, keep = _ids_and_keep([encoded[i] for i in batch], pad_id)
        values = critic.values(ids.to(device), keep.to(device)).cpu()
        for i, piece in zip(batch, torch.split(values, keep.sum(1).tolist()), strict=True):
            out[i] = piece.clone()
    return [x for x in out if x is not None]


def _ids_and_keep(encoded: Sequence[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and the positions predicting a response token [B, T-1]."""
    ids, _ = right_pad([e.input_ids for e in encoded], pad_id)
    keep = torch.zeros((len(encoded), ids.shape[1] - 1), dtype=torch.bool)
    for j, e in enumerate(encoded):
        keep[j, :len(e.input_ids) - 1] = torch.tensor(e.response_mask[1:], dtype=torch.bool)
    return ids, keep


def score(learner: Learner, frozen: Frozen, builder: PromptBuilder, grammar: Sequence[str],
          rows: Sequence[dict[str, Any]], segments: Sequence[list[Segment]],
          window: Window, max_batch_tokens: int, reference: bool, progress: bool = False
          ) -> list[Scored]:
    """Step 3 for this process's trajectories: every log-prob and value the update and the
    rewards need, each computed once. ``reference``: score ``pi_ref`` too (``needs``'s
    ``ref``). ``progress``: a bar per model scoring."""

    def bar(label: str) -> str | None:
        return f"score {label}" if progress else None

    pad = _pad_id(builder)
    sequences = [scoring_sequences(builder, *episode_of(builder, r, grammar)) for r in rows]
    flat = [enc for seqs in sequences for enc in seqs]
    counts = [len(seqs) for seqs in sequences]

    def regroup(values: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        it = iter(values)
        return [[next(it) for _ in range(c)] for c in counts]

    policy = learner.policy_model
    policy.eval()
    old = regroup(masked_logprobs(policy, flat, pad, max_batch_tokens, bar("policy")))
    ref = None
    if reference:
        if frozen.ref is None:  # a LoRA policy: pi_ref is the policy without its adapters
            with policy.disable_adapter():  # type: ignore[operator]
                ref = regroup(masked_logprobs(policy, flat, pad, max_batch_tokens,
                                              bar("pi_ref")))
        else:
            ref = regroup(masked_logprobs(frozen.ref, flat, pad, max_batch_tokens,
                                          bar("pi_ref")))
    values = None
    if learner.value_model is not None:
        learner.value_model.eval()
        values = regroup(critic_values(learner.value_model, flat, pad, max_batch_tokens))
    out = [Scored(dict(r), list(s), seqs, o, None if ref is None else ref[i],
                  None if values is None else values[i])
           for i, (r, s, seqs, o) in enumerate(zip(rows, segments, sequences, old, strict=True))]
    if "turn_rewards" in (rows[0] if rows else {}):
        return out  # offline: the rewards stage's per-turn rewards come with the rows
    hind = (hindsight_logprobs(frozen.hind, builder, rows, grammar, window, max_batch_tokens,
                               bar("pi_hind")) if frozen.hind is not None else None)
    sprm = {}
    for name, model in (("sprm", frozen.sprm), ("turn_sprm", frozen.turn_sprm)):
        if model is not None:
            trajectories = [trajectory_of(sc.sequences, len(sc.row["turns"]), sc.segments,
                                          sc.row["outcome"]) for sc in out]
            sprm[name] = turn_rewards(model, trajectories, pad, max_batch_tokens)
    for i, sc in enumerate(out):
        sc.hind_logp = None if hind is None else hind[i]
        sc.model_r = {k: v[i] for k, v in sprm.items()}
    return out


# -- 4. fuse ---------------------------------------------------------------------------------------
def fuse(scored: Sequence[Scored], variant: str, beta: float, alpha: float,
         options: RewardOptions = PAPER, ratio_reference: str = "policy") -> None:
    """Step 4: each trajectory's per-turn rewards of ``variant`` under the reward ``options``
    (the ``rewards.importance`` / ``rescale`` / ``grounding`` keys), as the rewards stage
    computes them (``grpo``: the outcome, which only its group advantage reads). The
    log-ratio compares ``pi_hind`` with the policy's log-probs, or with ``pi_ref``'s under
    ``ratio_reference: pi_ref``."""
    for sc in scored:
        row = sc.row
        m = len(row["turns"])
        if "turn_rewards" in row:
            sc.turn_rewards = torch.tensor(row["turn_rewards"], dtype=torch.float64)
            continue
        if variant in ("ppo", "grpo"):
            sc.turn_rewards = variant_rewards("ppo", torch.zeros(0), torch.zeros(m), [], [True] * m,
                                              alpha, row["outcome"])
            continue
        if ratio_reference == "pi_ref" and sc.ref_logp is None:
            raise ValueError("rewards.ratio_reference: pi_ref needs pi_ref's log-probs")
        policy = sc.per_turn(sc.ref_logp if ratio_reference == "pi_ref" else sc.old_logp)
        hind = sc.hind_logp if sc.hind_logp is not None else policy  # ratios 0: uniform z
        ratios = torch.tensor([log_ratio(h, p, beta) for h, p in zip(hind, policy, strict=True)],
                              dtype=torch.float64)
        model_r = sc.model_r["turn_sprm" if variant in TURN_LEVEL else "sprm"]
        last = torch.tensor([s.last for s in sc.segments], dtype=torch.long)
        sc.turn_rewards = variant_rewards(variant, model_r.double()[last], ratios, sc.segments,
                                          [bool(t["admissible"]) for t in row["turns"]], alpha,
                                          row["outcome"], options)


def iteration_credit(scored: Sequence[Scored], segments: Sequence[Sequence[Segment]],
                     info: DistInfo) -> dict[str, float]:
    """The credit accuracy (docs/method.md, "Credit accuracy") of the variant's fused rewards
    on this iteration's trajectories, every process's: summed per segment of ``segments`` (the
    segmenter's, as the rewards stage measures every variant, whatever the variant's own) and
    ranked against the oracle's true credit. Point estimates (a few episodes; the curve over
    iterations shows the spread): ``credit/spearman``, ``credit/kendall``,
    ``credit/first_error_top1``, ``credit/return_margin`` and its ratio to the outcome's; nan
    where undefined, empty where the environment reports no distance."""
    local = []
    for sc, segs in zip(scored, segments, strict=True):
        turns = sc.row["turns"]
        before = [t.get("distance_before", UNKNOWN_DISTANCE) for t in turns]
        after = [t.get("distance_after", UNKNOWN_DISTANCE) for t in turns]
        if sc.turn_rewards is None or UNKNOWN_DISTANCE in before + after:
            continue
        fused = sc.turn_rewards.numpy()
        local.append(CreditRecord.from_distances(
            before, after, segs, sc.row["won"], sc.row["outcome"],
            {"fused": segment_credit(fused, segs)}, {"fused": float(fused.sum())}))
    records = gather_objects(local, info)
    if not records:
        return {}
    true, fused = [r.segment_credit for r in records], [r.signals["fused"] for r in records]
    won = [r.won for r in records]
    margin = return_margin([r.returns["fused"] for r in records], won)
    return {"credit/spearman": pooled_spearman(true, fused),
            "credit/kendall": mean_kendall_tau(true, fused)[0],
            "credit/first_error_top1": first_error_top1(
                [r.turn_credit for r in records], [r.segments for r in records], fused, won)[0],
            "credit/return_margin": margin,
            "credit/return_margin_ratio": relative_margin(
                margin, return_margin([r.outcome for r in records], won))}


# -- 5. advantages ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sample:
    """One scoring sequence, ready for the update. ``key`` orders samples the same way on
    every process count. Shape: keep (T-1,) bool; the rest (n,), n = keep.sum()."""

    key: tuple[int, int, int]
    input_ids: list[int]
    keep: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor


def advantages(scored: Sequence[Scored], keys: Sequence[tuple[int, int]], variant: str,
               cfg: PpoParams) -> list[Sample]:
    """Step 5: GAE per trajectory over its response tokens (all its sequences in order), or
    GRPO's group advantage; whitened over every process's tokens (not for ``grpo``, already
    normalised). ``keys``: (task index, sample) of each trajectory."""
    if not scored:
        per_traj: list[tuple[torch.Tensor, torch.Tensor]] = []
    elif variant == "grpo":
        groups = torch.tensor([k[0] for k in keys])
        adv = group_advantages(torch.tensor([float(sc.row["outcome"]) for sc in scored]), groups)
        per_traj = []
        for a, sc in zip(adv.tolist(), scored, strict=True):
            n = sum(int(x.numel()) for x in sc.old_logp)
            per_traj.append((torch.full((n,), a, dtype=torch.float64),
                             torch.zeros(n, dtype=torch.float64)))
    else:
        n_max = max(sum(int(x.numel()) for x in sc.old_logp) for sc in scored)
        rewards = torch.zeros(len(scored), n_max, dtype=torch.float64)
        values = torch.zeros(len(scored), n_max, dtype=torch.float64)
        mask = torch.zeros(len(scored), n_max, dtype=torch.bool)
        for i, sc in enumerate(scored):
            assert sc.values is not None and sc.turn_rewards is not None
            v = torch.cat(sc.values).double()
            rewards[i, :v.numel()] = place_turn_rewards(sc.turn_rewards, sc.turn_of_token())
            values[i, :v.numel()] = v
            mask[i, :v.numel()] = True
        adv, ret = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = whiten(adv, mask, all_reduce_sum(masked_moments(adv, mask)))
        per_traj = [(adv[i, mask[i]], ret[i, mask[i]]) for i in range(len(scored))]
    if variant != "grpo" and not scored and cfg.whiten_advantages:
        all_reduce_sum(torch.zeros(3, dtype=torch.float64))  # join the collective
    samples = []
    for (task, sample), sc, (adv_t, ret_t) in zip(keys, scored, per_traj, strict=True):
        start = 0
        for s, enc in enumerate(sc.sequences):
            n = int(sc.old_logp[s].numel())
            piece = slice(start, start + n)
            keep = torch.tensor(enc.response_mask[1:], dtype=torch.bool)
            zeros = torch.zeros(n)
            samples.append(Sample(
                (task, sample, s), list(enc.input_ids), keep, sc.old_logp[s].float(),
                sc.ref_logp[s].float() if sc.ref_logp is not None else zeros,
                sc.values[s].float() if sc.values is not None else zeros,
                adv_t[piece].float(), ret_t[piece].float()))
            start += n
    return samples


def gather_objects(local: list[Any], info: DistInfo) -> list[Any]:
    """Every process's ``local`` items, process by process (``local`` itself on one)."""
    if info.world_size == 1:
        return local
    parts: list[list[Any] | None] = [None] * info.world_size
    dist.all_gather_object(parts, local)
    return [x for part in parts if part for x in part]


def gather_samples(samples: list[Sample], info: DistInfo) -> list[Sample]:
    """Every process's samples, in key order (what one process would hold)."""
    return sorted(gather_objects(samples, info), key=lambda s: s.key)


# -- 6. update -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class UpdateBatch:
    """A micro-batch of samples. Shape: input_ids [B, T], keep [B, T-1]; the rest [N], N the
    response tokens in row-major order. ``n_tokens``: real (non-padding) tokens."""

    input_ids: torch.Tensor
    keep: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    n_tokens: int

    @property
    def n_units(self) -> int:
        return int(self.keep.sum())

    def to(self, device: torch.device) -> UpdateBatch:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def collate(samples: Sequence[Sample], pad_id: int) -> UpdateBatch:
    ids, _ = right_pad([s.input_ids for s in samples], pad_id)
    keep = torch.zeros((len(samples), ids.shape[1] - 1), dtype=torch.bool)
    for j, s in enumerate(samples):
        keep[j, :s.keep.numel()] = s.keep
    cat = {name: torch.cat([getattr(s, name) for s in samples])
           for name in ("old_logp", "ref_logp", "old_values", "advantages", "returns")}
    return UpdateBatch(ids, keep, n_tokens=sum(len(s.input_ids) for s in samples), **cat)


def minibatch_windows(lengths: Sequence[int], cfg: PpoParams, info: DistInfo, iteration: int,
                      epoch: int) -> list[list[list[int]]]:
    """This process's micro-batches of each optimizer step of one pass: the pass's global
    micro-batches (:func:`epoch_batches`, the same for every process count) split into
    ``minibatches`` consecutive windows."""
    batches = epoch_batches(lengths, cfg.micro_batch_size * info.world_size,
                            seed=cfg.seed * 1_000_003 + iteration, epoch=epoch,
                            min_size=info.world_size)
    n = min(cfg.minibatches, len(batches))
    windows = [batches[i * len(batches) // n:(i + 1) * len(batches) // n] for i in range(n)]
    return [[rank_slice(b, info) for b in w] for w in windows]


def _train_step(engine: Engine, batches: Sequence[UpdateBatch],
                inputs: Callable[[UpdateBatch], dict[str, torch.Tensor]], n_units: int
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of every micro-batch, then one optimizer step. Each loss is scaled
    by ``world_size / N_global`` (the backends average over processes): the step follows the
    mean over the global minibatch's response tokens. Returns this process's summed stats."""
    scale = engine.info.world_size / max(1, n_units)
    total: torch.Tensor | None = None
    for i, batch in enumerate(batches):
        with engine.micro_step(last=i == len(batches) - 1):
            loss, stats = engine.module(**inputs(batch))
            engine.backward(loss * scale)
        total = stats if total is None else total + stats
    return (total if total is not None else torch.zeros(0)), engine.step()


def update(learner: Learner, samples: Sequence[Sample], pad_id: int, iteration: int
           ) -> dict[str, float]:
    """Step 6: ``ppo_epochs`` passes over the (gathered) samples, ``minibatches`` optimizer
    steps each, policy and critic. Returns the mean losses and statistics over all steps."""
    cfg, info = learner.cfg, learner.info
    device = learner.policy.device
    learner.policy.module.train()
    if learner.critic is not None:
        learner.critic.module.train()
    lengths = [len(s.input_ids) for s in samples]
    # ppo.critic_warmup: the first iterations step only the critic (not with no critic: grpo).
    train_policy = learner.critic is None or iteration >= cfg.critic_warmup
    pol = torch.zeros(5, dtype=torch.float64, device=device)
    crit = torch.zeros(3, dtype=torch.float64, device=device)
    tokens, real, sequences, steps = 0, 0, 0, 0
    norms: list[float] = []
    for epoch in range(cfg.ppo_epochs):
        for window in minibatch_windows(lengths, cfg, info, iteration, epoch):
            batches = [collate([samples[i] for i in mb], pad_id).to(device) for mb in window]
            counts = all_reduce_sum(torch.tensor(
                [sum(b.n_units for b in batches), sum(b.n_tokens for b in batches),
                 sum(int(b.input_ids.shape[0]) for b in batches)],
                dtype=torch.float64, device=device))
            n_units = int(counts[0])
            if train_policy:
                stats, optim = _train_step(learner.policy, batches, lambda b: {
                    "input_ids": b.input_ids, "keep": b.keep, "old_logp": b.old_logp,
                    "advantages": b.advantages, "ref_logp": b.ref_logp}, n_units)
                pol += all_reduce_sum(stats)
                norms.append(optim["grad_norm"])
            if learner.critic is not None:
                stats, _ = _train_step(learner.critic, batches, lambda b: {
                    "input_ids": b.input_ids, "keep": b.keep, "old_values": b.old_values,
                    "returns": b.returns}, n_units)
                crit += all_reduce_sum(stats)
            tokens += n_units
            real += int(counts[1])
            sequences += int(counts[2])
            steps += 1
    n = max(tokens, 1)
    p = n if train_policy else math.nan  # nan: no policy step this iteration
    out = {"losses/policy": float(pol[0]) / p, "policy/kl": float(pol[1]) / p,
           "policy/entropy": float(pol[2]) / p, "policy/clipfrac": float(pol[3]) / p,
           "policy/ratio_mean": float(pol[4]) / p, "optim/steps": steps,
           "optim/policy_steps": steps if train_policy else 0,
           "optim/grad_norm": sum(norms) / len(norms) if norms else math.nan,
           "optim/lr": float(learner.policy.optimizer.param_groups[0]["lr"]),
           "update/tokens": float(real), "update/response_tokens": float(tokens),
           "update/mean_length": real / max(sequences, 1)}
    if learner.critic is not None:
        out.update({"losses/value": float(crit[0]) / n, "critic/clipfrac": float(crit[1]) / n,
                    "critic/value_mean": float(crit[2]) / n})
    return out


# -- one iteration ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Inputs:
    """What an iteration reads besides the models.

    online: env, tasks (the training split), segmenter settings, hindsight window.
    beta, alpha, options, ratio_reference: the reward settings (``rewards`` params; online only, offline rows
    carry the rewards stage's).
    offline: rows (``D_st`` rows, each with ``turn_rewards`` of the variant).
    progress: progress bars inside an iteration (episodes played, sequences scored).
    """

    builder: PromptBuilder
    grammar: Sequence[str]
    tasks: Sequence[Task] = ()
    env: Environment | None = None
    rows: Sequence[dict[str, Any]] = ()
    segmenter: str = "rule"
    verbs: Sequence[str] = ()
    entropy_threshold: float = 0.5
    entropy_min_turns: int = 2
    window: Window = dataclasses.field(default_factory=Window)
    beta: float = 1.0
    alpha: float = 0.1
    options: RewardOptions = dataclasses.field(default_factory=RewardOptions)
    ratio_reference: str = "policy"
    max_new_tokens: int = 96
    batch_size: int = 32
    kv_dtype: str = "bfloat16"    # rollout.kv_dtype
    progress: bool = False


def run_iteration(learner: Learner, frozen: Frozen, inputs: Inputs, iteration: int
                  ) -> dict[str, float]:
    """Steps 1-6 of one iteration; returns its metrics (same names on every variant)."""
    cfg, info = learner.cfg, learner.info
    t0 = time.perf_counter()
    # Steps 1-5 change no weights: a stop there abandons the iteration at once (see train).
    with preempt.interruptible():
        # 1. collect: this process's share of the iteration's tasks (whole groups).
        if cfg.mode == "online":
            if inputs.env is None:
                raise ValueError("online PPO needs an environment and training tasks")
            chosen = iteration_tasks(inputs.tasks, cfg, iteration)[info.rank::info.world_size]
            rows = collect(learner.policy_model, inputs.builder, inputs.env,
                           [inputs.tasks[i] for i in chosen], cfg, inputs.max_new_tokens,
                           inputs.batch_size, iteration, inputs.progress and info.is_main,
                           inputs.kv_dtype)
            keys = [(i, s) for i in chosen for s in range(cfg.samples_per_task)]
            # 2. segment
            segments = segment(rows, learner.variant, inputs.segmenter, inputs.verbs,
                               inputs.entropy_threshold, inputs.entropy_min_turns)
        else:
            chosen = iteration_tasks(inputs.rows, cfg, iteration)[info.rank::info.world_size]
            rows = [dict(inputs.rows[i]) for i in chosen]
            keys = [(i, 0) for i in chosen]
            segments = [[Segment.from_row(s) for s in r["segments"]] for r in rows]
        t1 = time.perf_counter()
        # 3. score, 4. fuse, 5. advantages
        scored = score(learner, frozen, inputs.builder, inputs.grammar, rows, segments,
                       inputs.window, cfg.max_batch_tokens,
                       needs(learner.variant, cfg, inputs.ratio_reference)["ref"],
                       inputs.progress and info.is_main)
        fuse(scored, learner.variant, inputs.beta, inputs.alpha, inputs.options,
             inputs.ratio_reference)
        # Credit is measured over the segmenter's segments for every variant (the turn-level
        # ones reward single turns online), as the rewards stage measures them.
        measured = segments
        if cfg.mode == "online" and learner.variant in TURN_LEVEL:
            measured = [segment_offline(inputs.segmenter, r["turns"], inputs.verbs,
                                        inputs.entropy_threshold, inputs.entropy_min_turns)
                        for r in rows]
        credit = iteration_credit(scored, measured, info)
        samples = gather_samples(advantages(scored, keys, learner.variant, cfg), info)
    t2 = time.perf_counter()
    # 6. update
    metrics = update(learner, samples, _pad_id(inputs.builder), iteration)
    t3 = time.perf_counter()
    local = torch.tensor([len(rows), sum(r["won"] for r in rows),
                          sum(float(sc.turn_rewards.sum()) for sc in scored
                              if sc.turn_rewards is not None),
                          sum(r["n_turns"] for r in rows),
                          sum(not t.get("parsed", True) for r in rows for t in r["turns"])],
                         dtype=torch.float64, device=learner.policy.device)
    n_rows, wins, reward, turns, unparsed = all_reduce_sum(local).tolist()
    if learner.critic is not None and samples:
        # Before this update: how much of the returns the critic that scored them explained.
        metrics["critic/explained_variance"] = explained_variance(
            torch.cat([s.old_values for s in samples]), torch.cat([s.returns for s in samples]))
    metrics.update({
        "rollout/success": wins / max(n_rows, 1), "rollout/episodes": n_rows,
        "rollout/mean_turns": turns / max(n_rows, 1),
        "rollout/parse_failure_rate": unparsed / max(turns, 1),
        "rewards/fused_mean": reward / max(n_rows, 1),
        "time/generate_s": t1 - t0, "time/score_s": t2 - t1, "time/update_s": t3 - t2,
        "perf/tokens_per_s": metrics["update/tokens"] / max(t3 - t2, 1e-9),
        **credit,
    })
    return metrics


# -- 7. the loop, 8. checkpoints -------------------------------------------------------------------
CHECKPOINT_META = ckpt.META


def _stop_everywhere(info: DistInfo, device: torch.device) -> bool:
    """Whether any process was asked to stop (every process gets the same answer)."""
    flag = torch.tensor([float(preempt.requested() is not None)], dtype=torch.float64,
                        device=device)
    return bool(all_reduce_sum(flag).item())


def train(learner: Learner, frozen: Frozen, inputs: Inputs, start: int = 0,
          checkpoint: Path | None = None, extra: Mapping[str, Any] | None = None,
          on_log: Callable[[int, dict[str, float]], None] | None = None,
          progress: bool = True) -> list[dict[str, float]]:
    """Iterations ``start .. iterations-1``; ``on_log(iteration, metrics)`` on rank 0 after
    each; a checkpoint (with ``extra`` in its meta) every ``checkpoint_every`` iterations and
    after the last. Returns every iteration's metrics (rank 0's view; all are global).

    SIGTERM / SIGINT: during rollouts and scoring (which change no weights) the iteration is
    abandoned at once and the checkpoint holds the state it started from (its RNG states
    included, so the rerun plays it again identically); during the update, the update ends
    first and the checkpoint holds the iteration done. Then
    :class:`~hisr_core.train.preempt.Preempted` is raised."""
    from tqdm.auto import tqdm

    cfg, info = learner.cfg, learner.info
    history = []
    bar = tqdm(total=cfg.iterations, initial=start, desc=f"ppo {learner.variant}", unit="it",
               disable=not (progress and info.is_main), dynamic_ncols=True)
    name = f"ppo {learner.variant}"
    where = f"checkpoint in {checkpoint}" if checkpoint is not None else "no checkpoint"
    with preempt.deferred():
        for iteration in range(start, cfg.iterations):
            rng = ckpt.rng_state()
            try:
                metrics = run_iteration(learner, frozen, inputs, iteration)
            except preempt.Preempted as stop:
                if checkpoint is not None:
                    save_checkpoint(learner, checkpoint, iteration, extra or {}, rng=rng)
                bar.close()
                raise preempt.stopped(stop.signum, f"{name}: stopped by "
                                      f"{signal.Signals(stop.signum).name} during iteration "
                                      f"{iteration + 1} of {cfg.iterations} (redone on "
                                      f"resume); {where}") from None
            history.append(metrics)
            done = iteration + 1
            if info.is_main and on_log is not None:
                on_log(done, metrics)
            bar.update(1)
            bar.set_postfix(success=f"{metrics['rollout/success']:.3f}",
                            reward=f"{metrics['rewards/fused_mean']:.3f}")
            stop = _stop_everywhere(info, learner.policy.device)
            if checkpoint is not None and (stop or done % cfg.checkpoint_every == 0
                                           or done == cfg.iterations):
                save_checkpoint(learner, checkpoint, done, extra or {})
            if stop:
                bar.close()
                raise preempt.stopped(preempt.requested() or signal.SIGTERM,
                                      f"{name}: stopped by "
                                      f"{signal.Signals(preempt.requested() or 15).name} "
                                      f"after iteration {done} of {cfg.iterations}; {where}")
    bar.close()
    return history


def _engines(learner: Learner) -> dict[str, Engine]:
    return {n: e for n, e in (("policy", learner.policy), ("critic", learner.critic))
            if e is not None}


def save_checkpoint(learner: Learner, folder: Path, iteration: int,
                    extra: Mapping[str, Any], rng: Mapping[str, Any] | None = None) -> None:
    """Policy, critic, optimizers, schedules, every process's RNG states (``rng``: taken
    earlier) and the iteration count, atomically (:func:`hisr_core.train.checkpoint.save`).
    Collective: every process calls it."""
    ckpt.save(folder, _engines(learner), learner.info, learner.backend,
              {"iteration": iteration, "variant": learner.variant, **extra}, rng=rng)


def read_checkpoint_meta(folder: Path) -> dict[str, Any] | None:
    """The meta of the checkpoint in ``folder`` (``None``: there is none)."""
    return ckpt.read_meta(folder)


def load_checkpoint(learner: Learner, folder: Path) -> dict[str, Any] | None:
    """Restore :func:`save_checkpoint`'s state into ``learner`` and this process's RNGs;
    returns the meta (``iteration``: the iterations done), or ``None`` if there is none."""
    meta = read_checkpoint_meta(folder)
    if meta is None:
        return None
    if meta.get("variant") != learner.variant:
        raise ValueError(f"checkpoint {folder} was written with variant={meta.get('variant')!r}, "
                         f"this run has {learner.variant!r}; delete it to start afresh")
    return ckpt.load(folder, _engines(learner), learner.info, learner.backend)


def save_critic(critic: ValueModel, out_dir: str | Path,
                tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """The critic as a Hugging Face folder of its causal LM plus the value head, atomically."""
    head = {"weight": critic.v_head.weight.detach().float().cpu().contiguous(),
            "bias": critic.v_head.bias.detach().float().cpu().contiguous()}
    return save_model_folder(critic.lm, out_dir, tokenizer,
                             extra=lambda folder: save_file(head, str(folder / VALUE_HEAD_FILE)))


def load_critic(path: str | Path, dtype: torch.dtype | None = None) -> ValueModel:
    """The critic saved by :func:`save_critic`, in eval mode."""
    from hisr_core.agent.models import load_model

    path = Path(path)
    if not (path / VALUE_HEAD_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a critic folder (no {VALUE_HEAD_FILE})")
    critic = ValueModel(load_model(path, dtype=dtype))
    head = load_file(str(path / VALUE_HEAD_FILE))
    critic.v_head.weight.data.copy_(head["weight"])
    critic.v_head.bias.data.copy_(head["bias"])
    return critic.eval()


def save_models(learner: Learner, policy_dir: Path, critic_dir: Path | None,
                tokenizer: PreTrainedTokenizerBase) -> None:
    """The trained policy (LoRA merged) and critic as model folders. Collective."""
    learner.policy.save(policy_dir, tokenizer)
    if learner.critic is not None and critic_dir is not None:
        with learner.critic.full_weights():
            if learner.info.is_main:
                save_critic(learner.value_model, critic_dir, tokenizer)  # type: ignore[arg-type]
        barrier()
