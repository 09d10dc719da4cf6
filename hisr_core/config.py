"""Typed, validated parameters: one model per ``params.yaml`` section.

Every flow calls :func:`load_params` before doing any work. Unknown keys, wrong types and
out-of-range values raise :class:`ParamsError` with one message that names each offending key
(and, for an unknown key, the nearest valid one), so a typo never silently falls back to a
default.

The models' defaults are ``params.yaml``'s values (a test keeps them equal), so a params file
that leaves a key out gets the pipeline's value. A profile (``profiles/*.yaml``) is an overlay:
its top-level ``base:`` names the file it changes, relative to the profile's own folder
(``base: ../params.yaml``), and it lists only the keys it changes (:func:`merge_params`).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ParamsError(ValueError):
    """``params.yaml`` is missing, unreadable or invalid; the message names the key."""


class Section(BaseModel):
    """Base of every section: unknown keys are errors, fields are documented, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class EnvParams(Section):
    """The benchmark every stage plays."""

    name: str = "household"
    """Registry name of the environment: ``household`` (built in), ``virtualhome`` (extra
    ``virtualhome``) or ``alfworld`` (extra ``alfworld``)."""

    max_turns: int = Field(40, ge=1, le=1000)
    """Turn limit of an episode; the episode ends unsuccessfully when it is reached."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific options, checked by the environment (household and virtualhome:
    ``show_admissible``; alfworld: ``data_dir``, ``show_admissible`` and ``oracle``, the
    planner's distance to the goal after every step: slow, off by default)."""


class ExpertParams(Section):
    """The ``expert`` stage: task lists of every split and the expert trajectories ``D_bc``."""

    seed: int = Field(0, ge=0)
    """Seed of task generation; the same seed gives byte-identical task and ``D_bc`` files."""

    n_train: int = Field(2000, ge=1, le=1_000_000)
    """Number of training tasks (the expert plays each once; successes form ``D_bc``)."""

    n_valid_seen: int = Field(200, ge=0, le=1_000_000)
    """Number of ``valid_seen`` tasks (new seeds, same vocabulary as train)."""

    n_valid_unseen: int = Field(500, ge=0, le=1_000_000)
    """Number of ``valid_unseen`` tasks (combinations and layouts never in train). 500: the
    report's comparisons need them (100 tasks is a binomial SE of 5 points a run)."""

    slip_rate: float = Field(0.1, ge=0.0, le=0.5)
    """Chance per turn that the expert first slips (a plausible wrong command, answered
    ``Nothing happens.``) and then recovers; slipped turns carry no SFT loss. Training split
    only; 0 turns recovery demonstrations off."""

    workers: int = Field(0, ge=0, le=256)
    """Processes playing the expert's games (0: in the stage's own process). Slow
    environments (ALFWorld: ~2.5 s a game) want one per core."""

    def split_sizes(self) -> dict[str, int]:
        return {
            "train": self.n_train,
            "valid_seen": self.n_valid_seen,
            "valid_unseen": self.n_valid_unseen,
        }


class LoraParams(Section):
    """Optional LoRA adapters (peft) instead of full fine-tuning."""

    enabled: bool = False
    """Train LoRA adapters only; the base weights stay frozen."""

    r: int = Field(8, ge=1, le=1024)
    """LoRA rank."""

    alpha: int = Field(16, ge=1)
    """LoRA scaling numerator (scale = alpha / r)."""

    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the LoRA input."""

    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Names of the linear modules that get adapters."""


class ModelParams(Section):
    """The policy model and how episodes are put into its context."""

    name_or_path: str = Field("builtin:small", min_length=1)
    """A Hugging Face causal LM (local folder or hub id) or ``builtin:tiny|small|small-mq|base``."""

    history: int | None = Field(None, ge=0)
    """Turns of history kept in context besides the task (``null``: all that fit)."""

    max_tokens: int = Field(2048, ge=64)
    """Longest prompt or training sequence; whole old turns are dropped beyond it."""

    past_admissible: bool = True
    """Past observations in context keep the admissible list ``env.options.show_admissible``
    appends. ``false``: only the newest observation shows it (the list of the place one left
    no longer applies); on ALFWorld the lists are most of a sequence's tokens."""

    grammar: bool = True
    """The system message lists the environment's command templates. ``false`` (where
    ``env.options.show_admissible`` lists the commands anyway): a shorter prompt (ALFWorld:
    about 70 tokens fewer, 16% of a training sequence)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights dtype for training and inference; ``auto``: bfloat16 on a GPU that supports it."""

    lora: LoraParams = Field(default_factory=LoraParams)
    """LoRA adapters (off by default)."""


class FitParams(Section):
    """The optimisation loop shared by every stage that fits a model (sft, sprm, hindsight).
    Its defaults are ``sft``'s; ``sprm`` and ``hindsight`` override those they change."""

    seed: int = Field(0, ge=0)
    """Seed of model creation, data order and dropout."""

    epochs: float = Field(5.0, gt=0)
    """Passes over the training examples (fractions allowed)."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (``null``: run all epochs)."""

    lr: float = Field(3e-3, gt=0, le=1.0)
    """Peak learning rate of AdamW."""

    warmup_ratio: float = Field(0.05, ge=0.0, lt=1.0)
    """Fraction of steps with linear warm-up before the cosine decay."""

    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Learning rate at the end of the cosine, as a fraction of ``lr``."""

    weight_decay: float = Field(0.01, ge=0.0)
    """AdamW weight decay (not applied to biases and norms)."""

    micro_batch_size: int = Field(8, ge=1)
    """Examples per forward pass and process (sequences; trajectories for the SPRM)."""

    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm."""

    backend: Literal["auto", "torch", "deepspeed"] = "auto"
    """Training backend; ``auto``: DeepSpeed when a GPU is present, plain torch otherwise."""

    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage (with ``backend: deepspeed``)."""

    log_every: int = Field(10, ge=1)
    """Optimizer steps between logged losses."""

    checkpoint_every_s: float = Field(600.0, gt=0)
    """Seconds between checkpoints (weights or adapters, optimizer, schedule, RNG, data
    position; only the last is kept, under ``<data>/cache/checkpoints``). A killed run
    restarted with the same command resumes from it; SIGTERM / SIGINT also write one."""


class SftParams(FitParams):
    """The ``sft`` stage: behaviour cloning of ``D_bc`` (NLL of response tokens only)."""

    every_response: bool = False
    """Train every response of each training sequence, not only the turns it was made for.
    With a short ``model.history`` each turn has its own sequence holding ``history`` earlier
    turns as context; this also trains those (seen there with less history than at inference),
    so a step supervises up to ``history + 1`` times the tokens at the same cost."""


class SprmParams(FitParams):
    """The ``sprm`` stage: the segment-level process reward model, fitted on ``D_st`` with the
    loss ``(R - sum_i r_i)^2`` per trajectory, or over its prefixes (``target``; docs/method.md
    stage 4)."""

    epochs: float = Field(6.0, gt=0)
    """Passes over the training trajectories (fractions allowed)."""

    lr: float = Field(5e-4, gt=0, le=1.0)
    """Peak learning rate of AdamW (backbone and head)."""

    micro_batch_size: int = Field(4, ge=1)
    """Trajectories per forward pass and process (each with all its sequences)."""

    log_every: int = Field(5, ge=1)
    """Optimizer steps between logged losses."""

    head_dim: int | None = Field(None, ge=1)
    """Width of the head's hidden layer ``W1`` (``null``: the backbone's hidden size)."""

    holdout: float = Field(0.2, ge=0.0, lt=1.0)
    """Share of tasks held out (all samples of a task go together) for MSE and Pearson r."""

    target: Literal["sum", "prefix_sums"] = "prefix_sums"
    """What the segment model's rewards regress on each trajectory: ``sum``, the paper's
    ``(R - sum_i r_i)^2``; ``prefix_sums``, the mean over its segment ends j of
    ``(R - sum_{i<=j} r_i)^2``, so that ``sum_{i<=j} r_i`` estimates the chance of success
    after segment j and ``r_i`` is the change segment i brings (a trajectory's length then
    tells nothing its prefix does not). The turn model keeps SPA-RL's ``sum``."""

    lora: LoraParams = Field(default_factory=LoraParams)
    """LoRA adapters on the backbone instead of full fine-tuning (the head is always trained)."""


class HindsightParams(FitParams):
    """The ``hindsight`` stage: ``pi_hind`` recovers a masked response from the whole trajectory
    and its outcome (docs/method.md stage 5); one example per turn of ``D_ct``."""

    epochs: float = Field(1.5, gt=0)
    """Passes over the examples (one per turn; fractions allowed)."""

    lr: float = Field(0.0, ge=0, le=1.0)
    """Peak learning rate of AdamW for the weights (0: they stay ``pi_ref``'s; the gates, the
    block readers and the copy head train at their own rates either way)."""

    grad_accum: int = Field(4, ge=1)
    """Micro-batches per optimizer step (the block's signal is small next to the sampling
    noise of a few examples, so a step averages more of them than the other stages do)."""

    past: int | None = Field(None, ge=0)
    """Turns kept before the masked one (``null``: all the policy's prompt kept)."""

    future: int | None = Field(2, ge=0)
    """Turns kept after the masked one (``null``: all that fit)."""

    holdout: float = Field(0.2, ge=0.0, lt=1.0)
    """Share of tasks held out to compare ``pi_hind``'s NLL with ``pi_ref``'s."""

    block_at: Literal["system", "turn"] = "turn"
    """Positions the hindsight block is read at: ``system`` where it sits (after the system
    text), ``turn`` just before the masked turn's observation (the recent context)."""

    reads: Literal["episode", "block"] = "episode"
    """Where ``pi_hind`` reads the future from. ``episode``: ``pi_ref``'s own pass over the
    episode; the copy head reads the hidden states of the ``future`` turns after k there, and
    of the outcome line read on its own; the weights stay ``pi_ref``'s and the copy head alone
    trains, on features computed once (one pass over ``D_ct``). ``block``: the later turns and
    the outcome written as a block into each turn's example, read through gated attention
    (each turn's example re-encodes its past; the gates, block readers and weights can
    train)."""

    gate_init: float = Field(-30.0, le=0.0)
    """Initial gate on the attention logits of the hindsight block's tokens, every layer and
    head (``-20`` or below: closed, exactly ``pi_ref`` outside the block; between ``-20`` and
    0: open, added to the logits as it is)."""

    gate_lr: float = Field(0.0, ge=0.0)
    """Peak learning rate of the gates (the weights use ``lr``; 0: they stay at
    ``gate_init``)."""

    reader_rank: int = Field(0, ge=0)
    """Rank of the block reader every layer adds to the block tokens' hidden states (0: none)."""

    reader_lr: float = Field(1e-3, gt=0.0)
    """Peak learning rate of the block readers."""

    pointer_rank: int = Field(32, ge=0)
    """Rank of the copy head on the block (:class:`~hisr_core.rewards.gated_attention.BlockPointer`;
    0: none): it boosts the block's tokens where the future shows the answer."""

    pointer_lr: float = Field(1e-2, gt=0.0)
    """Peak learning rate of the copy head."""

    lora: LoraParams = Field(default_factory=LoraParams)
    """LoRA adapters instead of full fine-tuning (the gates train either way)."""

    @model_validator(mode="after")
    def _lora_needs_a_rate(self) -> HindsightParams:
        if self.reads == "episode":
            trained = [name for name, on in (("lr", self.lr > 0), ("gate_lr", self.gate_lr > 0),
                                             ("reader_rank", self.reader_rank > 0),
                                             ("lora.enabled", self.lora.enabled)) if on]
            if trained:
                raise ValueError(f"hindsight.reads: episode keeps pi_ref's weights and trains "
                                 f"the copy head alone; set {', '.join(trained)} to 0/false, "
                                 "or hindsight.reads: block")
            if self.pointer_rank == 0:
                raise ValueError("hindsight.reads: episode needs the copy head "
                                 "(hindsight.pointer_rank > 0)")
        if self.lora.enabled and self.lr == 0:
            raise ValueError("hindsight.lora.enabled needs hindsight.lr > 0 (lr 0 keeps the "
                             "weights frozen: no adapters to train)")
        return self


class RewardsParams(Section):
    """The ``rewards`` stage: hindsight-modulated segmental rewards of ``D_st`` (docs/method.md
    stages 6 and 7), scored with ``pi_ref`` as the policy."""

    beta: float = Field(1.0, gt=0)
    """Temperature of ``log_ratio_k = (1 / (beta L)) sum_j [log pi_hind - log pi]``."""

    alpha: float = Field(0.1, ge=0.0, le=1.0)
    """Weight of the action-grounding reward; segment rewards get ``1 - alpha``."""

    variants: list[Literal["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"]] = Field(
        default_factory=lambda: ["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo"],
        min_length=1)
    """Reward variants written (the variants table of docs/method.md); ``no_spr``/``no_both`` use turn segments."""

    max_batch_tokens: int = Field(8192, ge=64)
    """Padded tokens per scoring forward pass (rows x longest row)."""

    cases: int = Field(3, ge=0)
    """Successful and failed trajectories shown in the case tables (each)."""

    importance: Literal["paper", "length_neutral"] = "paper"
    """Segment importance: ``paper`` sums the segment's normalised turn importances;
    ``length_neutral`` divides that by the segment's share of turns and renormalises, so equal
    log-ratios leave ``r_him = r_hat`` (docs/method.md, "Reward options")."""

    rescale: Literal["l1", "signed_total"] = "l1"
    """Rescale of ``r_hat * z``: ``l1`` keeps ``sum |r_hat|``; ``signed_total`` rescales the
    positive and the negative segment rewards separately, each keeping its own total, so the
    signed ``sum r_hat`` is kept too (docs/method.md, "Reward options")."""

    grounding: Literal["bonus", "penalty"] = "penalty"
    """Action-grounding reward: ``penalty`` is 0 for an admissible action and -1 otherwise, so
    a longer episode earns nothing more (chosen by the credit table); ``bonus`` is 1 and 0 (the
    paper; docs/method.md, "Reward options")."""

    ratio_reference: Literal["policy", "pi_ref"] = "policy"
    """Online PPO: what ``pi_hind`` is compared with in the log-ratio. ``policy``, the policy
    being trained (the paper); ``pi_ref``, the SFT policy ``pi_hind`` is built on, so the
    ratio measures only what the hindsight block adds, not how far the policy has moved (the
    rewards stage scores ``pi_ref`` as the policy either way; docs/method.md, "Reward
    options")."""


Variant = Literal["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo", "grpo", "rft"]

#: The bounds of the sampling fields, defined once for every section that samples.
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


class SamplingParams(Section):
    """How a stage samples the policy's responses: the fields ``evaluate``, ``collect`` and
    ``ppo`` share, written directly in each of those sections (``params.yaml`` keeps one flat
    section per stage). The longest response is ``rollout.max_new_tokens``, for every stage."""

    temperature: Temperature = 1.0
    """Sampling temperature (the paper's collection: 1.0); 0 decodes greedily."""

    top_p: TopP = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches
    ``top_p`` (1: the whole distribution; unused when greedy)."""


class PpoParams(SamplingParams):
    """The ``ppo`` stage (docs/method.md stage 7): multi-turn PPO from ``pi_ref`` with a critic, for
    each variant of the variants table of docs/method.md and the baselines. ``rewards.beta`` / ``rewards.alpha``
    and the reward options (``rewards.importance`` / ``rescale`` / ``grounding``) shape the
    rewards; one iteration is collect → segment → score → fuse → advantages →
    update."""

    seed: int = Field(0, ge=0)
    """Seed of task order, sampling, minibatch order and dropout. The pipeline sets it per run
    from ``sweep.seeds`` (``flows.ppo --seed``), so ``params.yaml`` leaves it out."""

    mode: Literal["online", "offline"] = "online"
    """``online``: each iteration plays fresh rollouts with the current policy and scores them;
    ``offline``: each iteration takes trajectories of ``D_st`` with the rewards stage's
    precomputed rewards (SPA-RL's released setting)."""

    iterations: int = Field(10, ge=1)
    """PPO iterations (collect + update)."""

    tasks_per_iter: int = Field(16, ge=1)
    """Training tasks played per iteration (offline: ``D_st`` trajectories per iteration)."""

    samples_per_task: int = Field(2, ge=1)
    """Rollouts per task (the group of ``grpo``, which needs >= 2; with 2 and a success rate
    near one half, about half the groups tie and carry no advantage)."""

    ppo_epochs: int = Field(2, ge=1)
    """Passes over each iteration's data."""

    minibatches: int = Field(2, ge=1)
    """Optimizer steps per pass (the iteration's sequences split evenly)."""

    micro_batch_size: int = Field(4, ge=1)
    """Sequences per forward pass and process."""

    lr: float = Field(1e-4, gt=0, le=1.0)
    """Peak learning rate of the policy (AdamW)."""

    critic_lr: float = Field(5e-4, gt=0, le=1.0)
    """Peak learning rate of the critic (AdamW)."""

    critic_warmup: int = Field(1, ge=0)
    """Iterations at the start that step only the critic, not the policy, so that a fresh
    value head has learned the returns before the policy moves on its advantages (verl's
    ``trainer.critic_warmup``). Less than ``iterations``; ``grpo`` (no critic) ignores it."""

    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of optimizer steps with linear warm-up."""

    min_lr_ratio: float = Field(1.0, ge=0.0, le=1.0)
    """Learning rate at the end of the cosine, as a fraction of the peak (1: constant)."""

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm (policy and critic separately)."""

    clip: float = Field(0.2, gt=0, lt=1.0)
    """PPO ratio clip epsilon."""

    value_clip: float | None = Field(None, gt=0)
    """Clip of the critic's change per iteration (``null``: unclipped value loss)."""

    vf_coef: float = Field(0.5, gt=0)
    """Weight of the value loss (the critic has its own optimizer; this scales its gradient)."""

    gamma: float = Field(1.0, gt=0, le=1.0)
    """GAE discount per response token."""

    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""

    whiten_advantages: bool = True
    """Whiten advantages over the iteration's response tokens."""

    kl_coef: float = Field(0.01, ge=0.0)
    """Weight of the KL-to-``pi_ref`` loss term (0: ``pi_ref`` is not scored)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the per-token KL (``k3``: unbiased and non-negative)."""

    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus."""

    backend: Literal["auto", "torch", "deepspeed"] = "auto"
    """Training backend; ``auto``: DeepSpeed when a GPU is present, plain torch otherwise."""

    zero_stage: int = Field(2, ge=0, le=3)
    """DeepSpeed ZeRO stage (with ``backend: deepspeed``)."""

    checkpoint_every: int = Field(2, ge=1)
    """Iterations between checkpoints (policy, critic, optimizers, RNG, iteration); a killed
    run restarted with the same command resumes from the last one."""

    max_batch_tokens: int = Field(8192, ge=64)
    """Padded tokens per scoring forward pass (rows x longest row)."""

    rft_epochs: float = Field(1.0, gt=0)
    """``rft``: passes over the successful rollouts (the rate from ``rft_lr``, other settings
    from ``sft``)."""

    rft_lr: float = Field(2e-4, gt=0)
    """``rft``: peak learning rate. It fine-tunes ``pi_ref`` further, so it takes a rate of
    the RL stage's order rather than ``sft.lr``, which trains the model from scratch."""

    lora: LoraParams = Field(default_factory=LoraParams)
    """LoRA adapters on the policy instead of full fine-tuning."""

    @field_validator("temperature")
    @classmethod
    def _sampled(cls, v: float) -> float:
        # The policy gradient needs rollouts drawn from the policy's distribution; greedy
        # responses (0) are not, and every rollout of a task would be the same.
        if v <= 0:
            raise ValueError("must be > 0: PPO learns from sampled rollouts")
        return v


    @model_validator(mode="after")
    def _critic_warmup_leaves_policy_iterations(self) -> PpoParams:
        if self.critic_warmup >= self.iterations:
            raise ValueError(f"ppo.critic_warmup={self.critic_warmup} leaves no iteration of "
                             f"ppo.iterations={self.iterations} to train the policy")
        return self

class SweepParams(Section):
    """Which PPO runs the pipeline trains, evaluates and reports: every variant with every
    seed (``dvc.yaml``'s ``matrix``; one stage instance and one MLflow run each). A stage does
    not read this section, so adding a seed adds runs without rerunning the others."""

    variants: list[Variant] = Field(
        default_factory=lambda: ["hisr", "no_him", "no_spr", "no_both", "no_agr", "ppo", "grpo",
                                 "rft"], min_length=1)
    """The reward variants, ``grpo`` (group-normalised outcome advantage, no critic) and
    ``rft`` (fine-tuning of ``pi_ref`` on its successful rollouts in ``D_ct``)."""

    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """``ppo.seed`` of each run; the report shows mean ± std over them."""

    @field_validator("variants", "seeds")
    @classmethod
    def _distinct(cls, v: list[Any]) -> list[Any]:
        if len(set(v)) != len(v):
            raise ValueError(f"must not repeat an entry (got {v})")
        if any(isinstance(x, int) and x < 0 for x in v):
            raise ValueError(f"seeds must be >= 0 (got {v})")
        return v


class OpenAIParams(Section):
    """The ``openai`` generation backend: any OpenAI-compatible completions server (vLLM)."""

    base_url: str = Field("http://127.0.0.1:8000/v1", min_length=1)
    """The server's API root."""

    model: str | None = None
    """Served model name; ``null``: the policy's model folder, as ``vllm serve DIR`` names it."""

    api_key_env: str = Field("OPENAI_API_KEY", min_length=1)
    """Environment variable holding the API key (the key itself never goes in params)."""

    concurrency: int = Field(32, ge=1)
    """Most requests in flight at once."""

    timeout_s: float = Field(120.0, gt=0)
    """Per-request timeout."""

    max_retries: int = Field(5, ge=0)
    """Retries of a failed request (connection error, timeout, 429, 5xx), with back-off."""


class RolloutParams(Section):
    """The engine that plays episodes (evaluation, collection, PPO)."""

    backend: Literal["hf", "openai"] = "hf"
    """``hf``: in-process transformers; ``openai``: a server (see ``openai``)."""

    batch_size: int = Field(32, ge=1)
    """Episodes played at once: each is stepped as soon as its response is back, while the
    others keep generating (the ``hf`` backend's rows, the ``openai`` backend's requests)."""

    max_new_tokens: int = Field(96, ge=1)
    """Longest response of one turn, in tokens."""

    env_workers: int = Field(0, ge=0)
    """Worker processes stepping the episodes (0: step in-process, right for the built-in
    household; slow environments such as ALFWorld want a few, e.g. 4)."""

    action_choice: Literal["free", "snap", "constrained"] = "free"
    """Evaluation and collection, where observations list the admissible commands
    (``env.options.show_admissible``): ``free`` plays the action the policy wrote (the paper's
    setting); ``snap`` replaces an unlisted one by the listed command closest to it as text, in
    the stored response too (as Huang et al., 2022, map free-form steps to admissible ones);
    ``constrained`` decodes the action only among the listed commands, token by token by the
    policy's own distribution (the ``hf`` backend; others snap). PPO's own rollouts are free."""

    kv_dtype: Literal["bfloat16", "float32", "model"] = "bfloat16"
    """The ``hf`` backend's KV cache dtype: ``bfloat16``, ``float32``, or ``model`` (the
    model's own dtype). An explicit value, so the same params compute the same numbers on any
    machine: attention reads the stored keys and values in float32 arithmetic whether the
    compiled CPU decode kernel or the SDPA fallback runs (they agree within float rounding).
    Decoding many episodes on a CPU is bound by reading the cache, and ``bfloat16`` under a
    float32 model halves what each step reads (docs/results.md); ``float32`` keeps a float32
    model's own numbers. A vLLM server has its own (``--kv-cache-dtype``)."""

    openai: OpenAIParams = Field(default_factory=OpenAIParams)
    """Settings of the ``openai`` backend."""


class EvaluateParams(SamplingParams):
    """The ``evaluate`` flow: episodes on held-out splits (greedy by default)."""

    temperature: Temperature = 0.0
    """Decoding temperature (0: greedy, the paper's evaluation). Above 0 a small policy that
    repeats itself greedily (the same two commands until the turn limit) can leave the loop."""

    splits: list[str] = Field(default_factory=lambda: ["valid_seen", "valid_unseen"], min_length=1)
    """Splits to play (task lists written by the ``expert`` stage)."""

    n_tasks: int | None = Field(None, ge=1)
    """Play only the first ``n_tasks`` of each split (``null``: all); task types cycle, so any
    prefix stays balanced."""

    seed: int = Field(0, ge=0)
    """Sampling seed when ``temperature > 0`` (same seed and ``hf`` backend: same episodes)."""


class CollectParams(SamplingParams):
    """The ``collect`` stage: N sampled rollouts of ``pi_ref`` per training task (``D_ct``)."""

    seed: int = Field(0, ge=0)
    """Sampling seed (same seed and ``hf`` backend: identical ``D_ct``)."""

    n_tasks: int | None = Field(200, ge=1)
    """The first ``n_tasks`` training tasks (``null``: all)."""

    samples_per_task: int = Field(4, ge=1)
    """N, rollouts per task (the paper: 10)."""

    max_unparsed: int = Field(3, ge=0)
    """Responses without a parsable action an episode may have before it is dropped."""

    loop_repeats: int = Field(3, ge=2)
    """An episode repeating the same action block this many times in a row is dropped."""

    loop_max_period: int = Field(2, ge=1)
    """Longest action block (in turns) the loop filter looks for."""


class LLMSegmentParams(Section):
    """The ``llm`` segmenter's server (any OpenAI-compatible chat-completions endpoint)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The server's API root (OpenAI: https://api.openai.com/v1; a vLLM server: .../v1)."""

    model: str = "gpt-4o"
    """The model the server knows (the paper: GPT-4o)."""

    api_key_env: str = Field("OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding the API key; never the key itself."""

    concurrency: int = Field(8, ge=1)
    """Most requests in flight at once."""

    timeout_s: float = Field(120.0, gt=0)
    """Per-request timeout, in seconds."""

    max_retries: int = Field(5, ge=0)
    """Retries of a request after a connection error, timeout, 429 or 5xx (with back-off)."""

    attempts: int = Field(3, ge=1)
    """Requests per trajectory while the answers are invalid; then it falls back to ``turn``."""

    max_tokens: int = Field(1024, ge=16)
    """Longest answer, in tokens."""

    cache_dir: str = "data/cache/segment_llm"
    """Answers cached by (model, prompt) hash: a rerun makes no request."""


class SegmentParams(Section):
    """The ``segment`` stage: sub-goal segments of every trajectory of ``D_ct`` (``D_st``)."""

    segmenter: Literal["rule", "entropy", "turn", "llm"] = "rule"
    """``rule``: a boundary after each state-changing action (offline); ``entropy``: where the
    response entropy jumps (offline); ``turn``: one turn per segment (the "w/o SPR" ablation);
    ``llm``: a chat model splits each trajectory (the paper: GPT-4o)."""

    entropy_threshold: float = Field(0.5, ge=0.0)
    """``entropy``: a boundary before a turn whose entropy exceeds the previous turn's by this
    many standard deviations of the trajectory's entropies."""

    entropy_min_turns: int = Field(2, ge=1)
    """``entropy``: shortest segment (no boundary before the running segment has this many)."""

    llm: LLMSegmentParams = Field(default_factory=LLMSegmentParams)
    """Settings of the ``llm`` segmenter."""


class TrackingParams(Section):
    """Where MLflow records runs."""

    mlflow_uri: str = "sqlite:///data/mlflow/mlflow.db"
    """MLflow tracking URI; a relative ``sqlite:///`` or file path is relative to the project root."""

    experiment: str = Field("hisr", min_length=1)
    """MLflow experiment name; one run per stage."""

    @field_validator("mlflow_uri")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        if "@" in v.split("//", 1)[-1].split("/", 1)[0]:
            raise ValueError("must not contain credentials; set MLFLOW_TRACKING_USERNAME/PASSWORD")
        return v


class Params(Section):
    """The whole ``params.yaml``."""

    env: EnvParams = Field(default_factory=EnvParams)
    """The environment (benchmark) and its turn limit."""

    expert: ExpertParams = Field(default_factory=ExpertParams)
    """Expert task generation and ``D_bc``."""

    model: ModelParams = Field(default_factory=ModelParams)
    """The policy model and its context window."""

    sft: SftParams = Field(default_factory=SftParams)
    """Behaviour cloning."""

    rollout: RolloutParams = Field(default_factory=RolloutParams)
    """The episode engine and its generation backend."""

    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    """Evaluation."""

    collect: CollectParams = Field(default_factory=CollectParams)
    """N-rollout collection."""

    segment: SegmentParams = Field(default_factory=SegmentParams)
    """Segmentation into sub-goal segments."""

    sprm: SprmParams = Field(default_factory=SprmParams)
    """The segment-level process reward model."""

    hindsight: HindsightParams = Field(default_factory=HindsightParams)
    """The hindsight model ``pi_hind``."""

    rewards: RewardsParams = Field(default_factory=RewardsParams)
    """Hindsight-modulated segmental rewards."""

    ppo: PpoParams = Field(default_factory=PpoParams)
    """Multi-turn PPO, its variants and baselines."""

    sweep: SweepParams = Field(default_factory=SweepParams)
    """The PPO runs of the pipeline (variants x seeds)."""

    tracking: TrackingParams = Field(default_factory=TrackingParams)
    """MLflow tracking."""

    @model_validator(mode="after")
    def _grpo_groups(self) -> Params:
        if "grpo" in self.sweep.variants and self.ppo.samples_per_task < 2:
            raise ValueError("grpo needs ppo.samples_per_task >= 2 (its advantage is relative "
                             "to the other rollouts of the same task)")
        return self


def _nested_model(model: type[BaseModel], key: str | int) -> type[BaseModel] | None:
    """The model of field ``key`` of ``model`` if it is a block of settings, else ``None``."""
    field = model.model_fields.get(key) if isinstance(key, str) else None
    annotation = getattr(field, "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _allowed_keys(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """Field names valid at ``loc`` (the location of an unknown key's parent)."""
    current: type[BaseModel] | None = model
    for part in loc:
        current = _nested_model(current, part)
        if current is None:
            return []
    return list(current.model_fields)


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(Params, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.5)
            hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
            lines.append(f"unknown key {key!r}{hint} (valid here: {', '.join(allowed)})")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return f"{source}: invalid parameters:\n  " + "\n  ".join(lines)


def parse_params(data: Any, source: str = "params") -> Params:
    """Validate an already-loaded mapping; raises :class:`ParamsError`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParamsError(f"{source}: expected a mapping of sections, got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ParamsError(_format_errors(err, source)) from None


#: The top-level key of an overlay that names the file it changes.
BASE_KEY = "base"


def merge_params(base: dict[str, Any], overlay: dict[str, Any],
                 model: type[BaseModel] = Params) -> dict[str, Any]:
    """``overlay`` over ``base`` (raw mappings, neither changed). A section or a nested block of
    settings (``model.lora``, ``rollout.openai``) merges key by key; any other value replaces
    the base's whole: a number, a list, and a free-form mapping such as ``env.options``, whose
    keys belong to one environment and would not fit another's."""
    merged = dict(base)
    for key, value in overlay.items():
        nested = _nested_model(model, key)
        if nested is not None and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_params(merged[key], value, nested)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ParamsError(f"{path}: cannot read parameters file ({err.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None


def _resolve(path: Path, seen: tuple[Path, ...] = ()) -> tuple[Any, tuple[Path, ...]]:
    """The raw mapping of a params file with its ``base:`` chain merged under it (each base
    relative to the folder of the file that names it), and the files of that chain."""
    data = _read_yaml(path)
    if not isinstance(data, dict) or BASE_KEY not in data:
        return data, (path,)  # not a mapping: parse_params names the file and what it holds
    data = dict(data)
    base = data.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ParamsError(f"{path}: {BASE_KEY} must be the path of the params file this one "
                          f"changes, relative to {path.parent} (got {base!r})")
    base_path = path.parent / base
    if base_path.resolve() in (*seen, path.resolve()):
        raise ParamsError(f"{path}: {BASE_KEY} {base!r} leads back to a file of its own chain")
    try:
        under, chain = _resolve(base_path, (*seen, path.resolve()))
    except ParamsError as err:
        raise ParamsError(f"{path}: its {BASE_KEY} {base!r}: {err}") from None
    if not isinstance(under, dict):
        raise ParamsError(f"{path}: its {BASE_KEY} {base_path} holds no mapping of sections")
    return merge_params(under, data), (path, *chain)


def load_params(path: str | Path) -> Params:
    """Read and validate a params file (``params.yaml``, or a profile over it); raises
    :class:`ParamsError` naming what is wrong (and, for a profile, the files it merged)."""
    data, chain = _resolve(Path(path))
    return parse_params(data, " over ".join(map(str, chain)))


def section_dict(section: BaseModel) -> dict[str, Any]:
    """A section as plain JSON-able data (for cache keys and MLflow params)."""
    return section.model_dump(mode="json")
