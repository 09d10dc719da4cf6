"""Checkpoints of a training run, for every stage that trains (the fit loop and PPO).

A checkpoint is one folder holding, per engine, the trainable weights (the adapters only under
LoRA), the optimizer and the LR schedule (``<name>.pt``; DeepSpeed's own checkpoint folder
``<name>/`` under that backend), every process's RNG states (``rng-<rank>.pt``: Python, NumPy,
torch, CUDA) and ``meta.json`` (the step reached, the fingerprint of the params and inputs it
belongs to, whatever the caller adds). It is written into a sibling temporary folder that
replaces the previous checkpoint only once complete, so a kill at any moment leaves one whole
checkpoint. A checkpoint of other params or inputs (another fingerprint) is discarded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hisr_core import stamp
from hisr_core.train.engine import Backend, DistInfo, Engine, barrier

META = "meta.json"


def fingerprint(config: Any, inputs: Sequence[Path] = ()) -> str:
    """What a checkpoint must match to be resumed: ``config`` (JSON-able: the params read) and
    the input files' names, sizes and bytes (:func:`hisr_core.stamp.file_stamp`)."""
    return stamp.fingerprint(config, inputs)


def read_meta(folder: Path) -> dict[str, Any] | None:
    """The meta of the checkpoint in ``folder`` (``None``: there is none)."""
    path = Path(folder) / META
    return json.loads(path.read_text()) if path.is_file() else None


def keep_if_matching(folder: Path, fp: str, info: DistInfo) -> dict[str, Any] | None:
    """The checkpoint's meta when it was written with fingerprint ``fp``; a checkpoint of other
    params or inputs is removed, with a message, and ``None`` returned. Collective: rank 0
    decides (other ranks may see other input paths, a private copy of a base model)."""
    folder = Path(folder)
    if info.is_main:
        meta = read_meta(folder)
        if meta is not None and meta.get("fingerprint") != fp:
            print(f"{folder}: a checkpoint of other params or inputs; starting afresh")
            shutil.rmtree(folder)
        elif meta is None and folder.exists():
            shutil.rmtree(folder)  # a folder without meta is not a checkpoint
    barrier()
    return read_meta(folder)


def remove(folder: Path, info: DistInfo) -> None:
    """Delete the checkpoint (the run's outputs are written). Collective."""
    barrier()
    if info.is_main:
        shutil.rmtree(folder, ignore_errors=True)
    barrier()


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # Frozen weights are the ones the run started from: leaving them out keeps a LoRA
    # checkpoint to the adapters' size.
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch, CUDA when present)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(folder: Path, engines: Mapping[str, Engine], info: DistInfo, backend: Backend,
         meta: Mapping[str, Any], rng: Mapping[str, Any] | None = None) -> float:
    """Write a checkpoint of ``engines`` and this process's RNGs (``rng``: states taken
    earlier, where the weights are) with ``meta``, replacing the one in ``folder`` once
    complete. Collective. Returns the seconds it took."""
    start = time.perf_counter()
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        if backend == "deepspeed":
            engine.module.save_checkpoint(str(tmp / name), tag="state",
                                          exclude_frozen_parameters=True)
        elif info.is_main:
            torch.save({"model": _trainable_state(engine.model),
                        "optimizer": engine.optimizer.state_dict(),
                        "scheduler": engine.scheduler.state_dict()}, tmp / f"{name}.pt")
    torch.save(dict(rng) if rng is not None else rng_state(), tmp / f"rng-{info.rank}.pt")
    barrier()
    if info.is_main:
        full = {**meta, "world_size": info.world_size, "backend": backend}
        (tmp / META).write_text(json.dumps(full, indent=2) + "\n")
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return time.perf_counter() - start


def load(folder: Path, engines: Mapping[str, Engine], info: DistInfo,
         backend: Backend) -> dict[str, Any] | None:
    """Restore :func:`save`'s state into ``engines`` and this process's RNGs; returns the meta,
    or ``None`` if ``folder`` holds no checkpoint. Collective."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta is None:
        return None
    for key, have in (("world_size", info.world_size), ("backend", backend)):
        if meta.get(key) != have:
            raise ValueError(f"checkpoint {folder} was written with {key}={meta.get(key)!r}, "
                             f"this run has {have!r}; delete it to start afresh")
    for name, engine in engines.items():
        if backend == "deepspeed":
            engine.module.load_checkpoint(str(folder / name), tag="state",
                                          load_module_strict=False)
            continue
        state = torch.load(folder / f"{name}.pt", weights_only=False, map_location=engine.device)
        missing = set(_trainable_state(engine.model)) - set(state["model"])
        if missing:
            raise ValueError(f"checkpoint {folder} does not hold this model's trainable "
                             f"weights ({sorted(missing)[:3]}...); delete it to start afresh")
        engine.model.load_state_dict(state["model"], strict=False)
        engine.optimizer.load_state_dict(state["optimizer"])
        engine.scheduler.load_state_dict(state["scheduler"])
    rng = torch.load(folder / f"rng-{info.rank}.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    barrier()
    return meta
