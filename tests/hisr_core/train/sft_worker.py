"""Synthetic household ReAct episodes for SFT tests, and an entry script that trains on them.

As a script (one process, or one rank under ``torchrun``)::

    python tests/hisr_core/train/sft_worker.py --model DIR --backend torch --micro 2 --steps 4 \
        --out losses.json [--save DIR]

trains with :func:`hisr_core.train.sft.train_sft` (``log_every=1``) and has rank 0 write the logged
metrics of every step and the summary to ``--out``; with ``--hindsight``, ``pi_hind``'s gates
and block readers on the frozen model instead (:func:`train_hindsight`). ``--checkpoint DIR``
keeps a resumable checkpoint there; ``--stop-at K`` has rank 0 send itself SIGTERM while it
logs step K (the run then stops with a checkpoint and exit status 143).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

GRAMMAR = ["go to {recep}", "open {recep}", "take {obj} from {recep}", "put {obj} in/on {recep}"]
OBJECTS = ["mug", "apple", "book", "pen", "plate", "knife", "towel", "bowl"]
RECEPTACLES = ["cabinet", "shelf", "drawer", "countertop", "fridge", "table"]


def _turn(observation: str, thought: str, action: str) -> dict[str, Any]:
    return {"observation": observation, "response": f"Thought: {thought}\nAction: {action}",
            "action": action, "admissible": True}


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` D_bc-like rows: fetch an object (after 0-2 wrong places) and put it somewhere."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        obj = rng.choice(OBJECTS)
        places = [f"{r} {k}" for r in RECEPTACLES for k in (1, 2)]
        rng.shuffle(places)
        wrong, src, dst = places[:rng.randint(0, 2)], places[3], places[4]
        room = ", ".join(f"a {p}" for p in places[:6])
        obs = f"You are in the middle of a room. Looking around you, you see {room}."
        turns = []
        for place in [*wrong, src]:
            turns.append(_turn(obs, f"A {obj} may be in {place}.", f"go to {place}"))
            found = place == src
            obs = (f"You arrive at {place}. On the {place}, you see "
                   + (f"a {obj} 1." if found else "nothing."))
        turns.append(_turn(obs, f"Here is the {obj}.", f"take {obj} 1 from {src}"))
        obs = f"You pick up the {obj} 1 from the {src}."
        turns.append(_turn(obs, f"Now I go to {dst}.", f"go to {dst}"))
        obs = f"You arrive at {dst}. On the {dst}, you see nothing."
        turns.append(_turn(obs, "I put it here.", f"put {obj} 1 in/on {dst}"))
        rows.append({"task_id": f"synthetic/{i}", "instruction": f"put a {obj} in {dst}",
                     "turns": turns})
    return rows


def corpus(rows: list[dict[str, Any]]) -> list[str]:
    """Texts to train a builtin tokenizer on: system prompts, observations, responses."""
    from hisr_core.agent.prompts import system_text

    texts = [system_text(r["instruction"], GRAMMAR) for r in rows]
    for r in rows:
        texts += [t["observation"] for t in r["turns"]] + [t["response"] for t in r["turns"]]
    return texts


def sft_params(backend: str, micro: int, steps: int, **overrides: Any):
    from hisr_core.config import SftParams

    values: dict[str, Any] = {
        "seed": 0, "epochs": 100.0, "max_steps": steps, "lr": 3e-3, "warmup_ratio": 0.0,
        "micro_batch_size": micro, "grad_accum": 2, "backend": backend, "zero_stage": 2,
        "log_every": 1, "max_grad_norm": 1.0}
    values.update(overrides)
    return SftParams(**values)


def train(model_dir: Path, params, n_rows: int, save: Path | None = None,
          lora=None, checkpoint: Path | None = None, stop_at: int | None = None
          ) -> dict[str, Any]:
    """Train the saved model at ``model_dir`` on ``n_rows`` synthetic episodes; every step logged."""
    import os
    import signal

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.train.fit import Checkpoint
    from hisr_core.train.sft import encode_trajectories, train_sft

    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir)
    sequences = encode_trajectories(make_rows(n_rows, seed=1), PromptBuilder(tokenizer), GRAMMAR)
    logs: list[tuple[int, dict[str, float]]] = []

    def on_log(step: int, metrics: dict[str, float]) -> None:
        logs.append((step, metrics))
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # rank 0 only: the other rank follows it

    summary = train_sft(model, tokenizer, sequences, params, "float32", on_log=on_log,
                        progress=False, lora=lora, out_dir=save,
                        checkpoint=Checkpoint(checkpoint, "sft-worker") if checkpoint else None)
    return {"steps": [s for s, _ in logs], "losses": [m["losses/sft"] for _, m in logs],
            "grad_norms": [m["optim/grad_norm"] for _, m in logs],
            "lrs": [m["optim/lr"] for _, m in logs], "summary": summary}


def train_hindsight(model_dir: Path, backend: str, micro: int, steps: int) -> dict[str, Any]:
    """Train ``pi_hind`` as the stage does with ``hindsight.lr: 0`` (gates, rank-4 block
    readers and pointer on the frozen model at ``model_dir``) on household rollouts; the loss
    of every step, and the parameters that moved with their values."""
    import torch

    from hisr_core.agent.models import load_model, load_tokenizer
    from hisr_core.agent.prompts import PromptBuilder
    from hisr_core.config import HindsightParams
    from hisr_core.envs import environment_class
    from hisr_core.rewards.gated_attention import attach_gates
    from hisr_core.rewards.hindsight import Window, trajectory_examples
    from hisr_core.train.engine import freeze_weights
    from hisr_core.train.sft import train_sft
    from tests.household_data import rollout_rows

    tokenizer = load_tokenizer(model_dir)
    builder = PromptBuilder(tokenizer, None, 4096)
    grammar = environment_class("household").command_grammar
    examples = [e for r in rollout_rows(4) for e in trajectory_examples(builder, r, grammar,
                                                                        Window(2, 2))]
    # Gates that open and train (params.yaml keeps them closed).
    params = HindsightParams(reads="block", backend=backend, max_steps=steps, log_every=1,
                             micro_batch_size=micro, grad_accum=2, epochs=0.5, lr=0.0, gate_init=-4.0, gate_lr=0.1,
                             reader_rank=4, pointer_rank=4)
    model = load_model(model_dir)
    attach_gates(model, params.gate_init, params.gate_lr, params.reader_rank, params.reader_lr,
                 params.seed, params.pointer_rank, params.pointer_lr)
    freeze_weights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logs: list[tuple[int, dict[str, float]]] = []
    train_sft(model, tokenizer, examples, params, "float32",
              on_log=lambda step, m: logs.append((step, m)), progress=False, name="hindsight")
    after = dict(model.named_parameters())
    moved = sorted(n for n, p in after.items() if not torch.equal(p, before[n]))
    return {"losses": [m["losses/hindsight"] for _, m in logs],
            "grad_norms": [m["optim/grad_norm"] for _, m in logs], "moved": moved,
            "values": {n: after[n].detach().flatten().tolist() for n in moved}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--lora", action="store_true",
                        help="train rank-4 adapters on q_proj and v_proj (saved merged)")
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--hindsight", action="store_true",
                        help="train pi_hind with frozen weights instead (train_hindsight)")
    args = parser.parse_args(argv)
    if args.hindsight:
        result = train_hindsight(args.model, args.backend, args.micro, args.steps)
    else:
        from hisr_core.config import LoraParams

        params = sft_params(args.backend, args.micro, args.steps, zero_stage=args.zero_stage)
        lora = LoraParams(enabled=True, r=4, alpha=8, dropout=0.0,
                          target_modules=["q_proj", "v_proj"]) if args.lora else None
        result = train(args.model, params, args.rows, save=args.save, lora=lora,
                       checkpoint=args.checkpoint, stop_at=args.stop_at)
    from hisr_core.train.engine import init_distributed

    if init_distributed().is_main:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
