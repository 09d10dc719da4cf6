"""SFT speed: this project's trainer (hisr_core.train.sft) against TRL's ``SFTTrainer``, one process.

Both train the same freshly initialised model on the same token sequences (episodes encoded by
``PromptBuilder``, loss on response tokens only), with the same micro-batch, sequence length and
number of optimizer steps, in float32 without gradient checkpointing. Throughput counts real
(non-padding) tokens of the sequences each trainer consumed, divided by the wall time of its
training call (``train_sft`` / ``SFTTrainer.train``, optimizer set-up included); the same per
CPU-second of the process is reported too (steadier on a shared machine). Ours runs first, so
any one-off warm-up cost of the process falls on it. Prints one JSON object.

    python benchmarks/sft_vs_trl.py                       # builtin:small, synthetic episodes
    python benchmarks/sft_vs_trl.py --model PATH --data data/expert/d_bc.parquet --steps 50
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from hisr_core.agent.models import build_builtin, is_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import Encoded, PromptBuilder, system_text
from hisr_core.config import SftParams
from hisr_core.train.sft import encode_trajectories, train_sft

GRAMMAR = ("go to {recep}", "open {recep}", "close {recep}", "take {obj} from {recep}",
           "put {obj} in/on {recep}", "clean {obj} with {recep}", "heat {obj} with {recep}",
           "cool {obj} with {recep}", "use {lamp}", "look", "inventory")
RECEPTACLES = ["cabinet", "drawer", "countertop", "shelf", "diningtable", "sidetable",
               "garbagecan", "coffeemachine", "stoveburner", "toaster", "desk", "dresser"]
CLOSED = {"cabinet", "drawer"}
OBJECTS = ["apple", "mug", "cup", "plate", "bowl", "knife", "spatula", "potato", "tomato",
           "egg", "lettuce", "book", "pen", "cellphone", "keychain", "creditcard"]
APPLIANCE = {"clean": ("sinkbasin 1", "clean"), "heat": ("microwave 1", "heat"),
             "cool": ("fridge 1", "cool")}


# -- data ------------------------------------------------------------------------------------------
def _say(thought: str, action: str) -> str:
    return f"Thought: {thought}\nAction: {action}"


def household_episode(rng: random.Random) -> dict[str, Any]:
    """One successful ReAct episode in the style of the household (ALFWorld-like) expert."""
    places = [f"{r} {k}" for r in RECEPTACLES for k in range(1, rng.randint(2, 4))]
    rng.shuffle(places)
    kind = rng.choice(["pick", "clean", "heat", "cool", "look"])
    obj = rng.choice(OBJECTS)
    src, dst = places[0], places[1]
    search = places[2:2 + rng.randint(0, 5)] + [src]
    room = ", ".join(f"a {p}" for p in sorted(places))
    obs = f"You are in the middle of a room. Looking around you, you see {room}, a fridge 1, " \
          "a microwave 1, and a sinkbasin 1."
    turns: list[tuple[str, str]] = []
    for place in search:
        turns.append((obs, _say(f"To solve the task, I need to find a {obj}. A {obj} is more "
                                f"likely to appear in {place}.", f"go to {place}")))
        found = [f"a {obj} 1"] if place == src else []
        items = found + [f"a {o} {rng.randint(1, 3)}" for o in rng.sample(OBJECTS, 2) if o != obj]
        if place.split()[0] in CLOSED:
            turns.append((f"You arrive at {place}. The {place} is closed.",
                          _say(f"The {place} is closed; I open it.", f"open {place}")))
            obs = f"You open the {place}. The {place} is open. In it, you see {', '.join(items)}."
        else:
            obs = f"You arrive at {place}. On the {place}, you see {', '.join(items)}."
    turns.append((obs, _say(f"Now I find a {obj} 1. Next, I need to take it.",
                            f"take {obj} 1 from {src}")))
    obs = f"You pick up the {obj} 1 from the {src}."
    if kind in APPLIANCE:
        place, verb = APPLIANCE[kind]
        turns.append((obs, _say(f"Now I take a {obj} 1. Next, I need to go to {place} and "
                                f"{verb} it.", f"go to {place}")))
        turns.append((f"You arrive at {place}. On the {place}, you see nothing.",
                      _say(f"I {verb} the {obj} with {place}.", f"{verb} {obj} 1 with {place}")))
        obs = f"You {verb} the {obj} 1 using the {place}."
    if kind == "look":
        turns.append((obs, _say("Now I need a desklamp to look at it.", f"go to {dst}")))
        turns.append((f"You arrive at {dst}. On the {dst}, you see a desklamp 1.",
                      _say("I turn on the desklamp.", "use desklamp 1")))
        instruction = f"look at {obj} under the desklamp"
    else:
        turns.append((obs, _say(f"Now I put the {obj} in {dst}.", f"go to {dst}")))
        turns.append((f"You arrive at {dst}. On the {dst}, you see nothing.",
                      _say(f"I put the {obj} 1 in/on {dst}.", f"put {obj} 1 in/on {dst}")))
        prefix = "" if kind == "pick" else f"{kind} some "
        instruction = f"put {'a ' if kind == 'pick' else ''}{prefix}{obj} in {dst.split()[0]}"
    return {"instruction": instruction,
            "turns": [{"observation": o, "response": r} for o, r in turns]}


def load_rows(data: Path | None, episodes: int, seed: int) -> tuple[list[dict], list[str]]:
    """D_bc rows (a Parquet file, or synthetic household episodes) and the command grammar."""
    if data is None:
        rng = random.Random(seed)
        return [household_episode(rng) for _ in range(episodes)], list(GRAMMAR)
    rows = pq.read_table(data, columns=["env", "instruction", "turns"]).to_pylist()[:episodes]
    try:
        from hisr_core.envs import environment_class

        grammar = list(environment_class(rows[0]["env"]).command_grammar)
    except (ImportError, ValueError):
        grammar = list(GRAMMAR)
    return rows, grammar


def model_dir(name: str, rows: list[dict], grammar: list[str], seed: int, tmp: Path) -> Path:
    if not is_builtin(name):
        return Path(name)
    texts = [system_text(r["instruction"], grammar) for r in rows]
    texts += [t[k] for r in rows for t in r["turns"] for k in ("observation", "response")]
    return build_builtin(name, texts, seed, tmp / "model")


# -- the two trainers ------------------------------------------------------------------------------
def run_ours(path: Path, sequences: list[Encoded], args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(path)
    model = load_model(path)
    params = SftParams(seed=args.seed, epochs=1000.0, max_steps=args.steps, lr=args.lr,
                       warmup_ratio=0.0, micro_batch_size=args.micro, grad_accum=1,
                       backend="torch", log_every=args.steps)
    start, cpu = time.perf_counter(), time.process_time()
    stats = train_sft(model, tokenizer, sequences, params, "float32", progress=False)
    return {"tokens": stats["tokens"], "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu, "loss": stats["loss"]}


class _CountingCollator:
    """Counts the real tokens of every batch TRL's own collator builds."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.tokens = inner, 0

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.inner(examples)
        self.tokens += int(batch["attention_mask"].sum())
        return batch


def run_trl(path: Path, sequences: list[Encoded], args: argparse.Namespace,
            out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "right"
    model = load_model(path)
    dataset = Dataset.from_dict({"input_ids": [s.input_ids for s in sequences],
                                 "completion_mask": [s.response_mask for s in sequences]})
    config = SFTConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=1, learning_rate=args.lr, warmup_steps=0,
        lr_scheduler_type="cosine", weight_decay=0.01, max_grad_norm=1.0, seed=args.seed,
        max_length=args.max_tokens, completion_only_loss=True, packing=False,
        # Same numerics as ours: float32, no activation recomputation.
        bf16=False, fp16=False, gradient_checkpointing=False,
        train_sampling_strategy="group_by_length" if args.trl_group_by_length else "random",
        report_to="none", save_strategy="no", logging_steps=args.steps, disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=not torch.cuda.is_available())
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=tokenizer)
    counter = _CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    start, cpu = time.perf_counter(), time.process_time()
    result = trainer.train()
    return {"tokens": counter.tokens, "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu, "loss": result.training_loss}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:small",
                        help="builtin:tiny|small|small-mq|base (created fresh) or a Hugging Face folder")
    parser.add_argument("--data", type=Path, help="a D_bc Parquet file (default: synthetic)")
    parser.add_argument("--episodes", type=int, default=160)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--max-tokens", type=int, default=1024, help="longest sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-group-by-length", action="store_true",
                        help="let TRL group sequences by length too (its default is off)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows, grammar = load_rows(args.data, args.episodes, args.seed)
        path = model_dir(args.model, rows, grammar, args.seed, tmp)
        builder = PromptBuilder(load_tokenizer(path), history=None, max_tokens=args.max_tokens)
        sequences = encode_trajectories(rows, builder, grammar)
        ours = run_ours(path, sequences, args)
        trl = run_trl(path, sequences, args, tmp / "trl")

    ours_tps, trl_tps = ours["tokens"] / ours["seconds"], trl["tokens"] / trl["seconds"]
    per_cpu_s = {k: r["tokens"] / r["cpu_seconds"] for k, r in (("ours", ours), ("trl", trl))}
    print(json.dumps({
        "benchmark": "sft_vs_trl",
        "model": args.model,
        "data": str(args.data) if args.data else "synthetic-household",
        "sequences": len(sequences),
        "mean_tokens_per_sequence": round(sum(len(s.input_ids) for s in sequences)
                                          / len(sequences), 1),
        "steps": args.steps, "micro_batch_size": args.micro, "max_tokens": args.max_tokens,
        "ours": {"tokens": ours["tokens"], "seconds": round(ours["seconds"], 3),
                 "tokens_per_s": round(ours_tps, 1),
                 "tokens_per_cpu_s": round(per_cpu_s["ours"], 1),
                 "final_loss": round(ours["loss"], 4)},
        "trl": {"tokens": trl["tokens"], "seconds": round(trl["seconds"], 3),
                "tokens_per_s": round(trl_tps, 1),
                "tokens_per_cpu_s": round(per_cpu_s["trl"], 1),
                "train_loss": round(trl["loss"], 4),
                "group_by_length": args.trl_group_by_length},
        "ratio_ours_over_trl": round(ours_tps / trl_tps, 3),
        # Less sensitive to other processes sharing the machine than the wall-clock ratio.
        "ratio_per_cpu_s": round(per_cpu_s["ours"] / per_cpu_s["trl"], 3),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }))


if __name__ == "__main__":
    main()
