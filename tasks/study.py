"""The powered study's pieces (``profiles/study.yaml``, run by ``scripts/study.py``).

The study runs for ~11 hours on 2 cores, longer than a machine is held, so it is run in pieces
that each end in files small enough for git: a PPO run's ``metrics.json`` and ``curve.csv``, an
evaluation's ``metrics.json`` and per-task ``outcomes.csv``. A piece is done when its files
are there; what the pieces of a seed compare must come from one upstream (``pi_ref``, the
reward models, ``pi_hind``), so each seed records the upstream it was started on, and only a
machine that rebuilds the same upstream (SFT is bit-for-bit reproducible on one CPU type, not
across types) adds to it. Another machine starts a seed of its own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hisr_core.config import Params
from tasks.evaluate import OUTCOMES_FILE

#: Folders of the default pipeline the study reads (linked into the study's data folder).
UPSTREAM = ("tasks", "expert", "sft", "collect", "segment", "sprm", "hindsight", "rewards")
#: What fixes a seed's comparisons: the models every variant starts from or is scored with.
UPSTREAM_MODELS = ("sft/pi_ref", "sprm/model", "sprm/turn_model", "hindsight/pi_hind")
#: Minutes a piece took on the reference machine (2 cores of an Intel Xeon; the study's and
#: pilots' runs of 2026-12-06, rounded up), PPO runs by variant at 60 iterations of 32
#: episodes; and that machine's float32 matmul rate on 2 threads (GFLOP/s), by which
#: ``scripts/study.py`` scales them to the machine at hand.
MINUTES = {"sft": 1, "start_curve": 12, "evaluate": 5,
           "ppo": {"ppo": 45, "grpo": 35, "no_both": 65, "hisr": 60}}
REFERENCE_GFLOPS = 334.5
#: How much longer than the matmul ratio says a piece takes where generation falls back to
#: SDPA (no decode kernel): a PPO iteration took 2.69x the reference's on an AMD EPYC whose
#: matmul rate is 1.85x lower, when the kernel needed AVX-512
#: (benchmarks/results/ppo_iteration_before_after.json).
NO_KERNEL_SLOWER = 1.45
#: Least minutes left in a budget for which a PPO run too long to finish is started anyway, to
#: stop at a checkpoint when the budget is spent (``scripts/study.py``): on a slow machine a
#: run is longer than a session, and only runs split over sessions can finish there.
LEAST_PARTIAL = 20.0


@dataclasses.dataclass(frozen=True)
class Piece:
    """One unit of the study: ``kind`` ``sft`` (the seed's copy of ``evaluate_sft``),
    ``start_curve``, ``ppo`` or ``evaluate``; ``files``: what it leaves for git, relative to
    the study's data folder (the piece is done when all exist)."""

    kind: str
    seed: int
    variant: str = ""
    files: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.kind}@{self.variant + '-' if self.variant else ''}{self.seed}"

    def minutes(self, slower: float = 1.0, done: float = 0.0) -> float:
        """Estimated minutes on a machine ``slower`` times slower than the reference, for the
        share ``1 - done`` of the piece still to run (``done``: a resumable PPO run's share of
        iterations behind it)."""
        m = MINUTES[self.kind]
        return slower * (1.0 - done) * float(m[self.variant] if isinstance(m, dict) else m)

    def done(self, root: Path) -> bool:
        return all((root / f).is_file() for f in self.files)


def pieces(params: Params) -> list[Piece]:
    """Every piece of the study in the order it runs (seed by seed; in a seed: its ``sft``
    evaluation, its start curve, then each variant's PPO run and evaluation in
    ``sweep.variants`` order)."""
    out = []
    for seed in params.sweep.seeds:
        sft = f"eval/sft/seed{seed}"
        start = f"ppo/sft/seed{seed}"
        out += [Piece("sft", seed, files=(f"{sft}/metrics.json", f"{sft}/{OUTCOMES_FILE}")),
                Piece("start_curve", seed, files=(f"{start}/metrics.json", f"{start}/curve.csv"))]
        for v in params.sweep.variants:
            run, ev = f"ppo/{v}/seed{seed}", f"eval/{v}/seed{seed}"
            out += [Piece("ppo", seed, v, (f"{run}/metrics.json", f"{run}/curve.csv")),
                    Piece("evaluate", seed, v, (f"{ev}/metrics.json", f"{ev}/{OUTCOMES_FILE}"))]
    return out


def upstream_fingerprint(data: Path) -> str:
    """SHA-256 (first 16 hex digits) of the bytes of every file of ``UPSTREAM_MODELS`` under
    ``data``, in path order; fails naming the stage to run when one is missing."""
    digest = hashlib.sha256()
    for rel in UPSTREAM_MODELS:
        folder = data / rel
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is missing: run `dvc repro rewards` first")
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(data)).encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def seed_file(root: Path, seed: int) -> Path:
    return root / f"seed{seed}.json"


def seed_upstream(root: Path, seed: int) -> str | None:
    """The upstream a seed was started on (``None``: not started)."""
    path = seed_file(root, seed)
    return json.loads(path.read_text())["upstream"] if path.is_file() else None


def own_pieces(todo: Sequence[Piece], root: Path, upstream: str) -> list[Piece]:
    """The pieces of ``todo`` still to run of the seeds started on ``upstream`` whose ``sft``
    evaluation is in. They need nothing of the pipeline but that upstream's folders, so
    ``scripts/study.py`` runs them without ``dvc repro``, which would rerun a stage whose code
    changed even where its outputs cannot (and rewrite every model it restores)."""
    sft_done = {p.seed for p in todo if p.kind == "sft" and p.done(root)}
    return [p for p in todo if p.seed in sft_done and not p.done(root)
            and seed_upstream(root, p.seed) == upstream]


def runnable(todo: Sequence[Piece], root: Path, upstream: str) -> tuple[list[Piece], list[str]]:
    """The pieces of ``todo`` that are not done and whose seed is new or was started on
    ``upstream``; and, per seed left out, why."""
    keep, why = [], {}
    for piece in todo:
        if piece.done(root):
            continue
        started = seed_upstream(root, piece.seed)
        if started is not None and started != upstream:
            record = json.loads(seed_file(root, piece.seed).read_text())
            where = ", ".join(f"{k} {record[k]}" for k in ("cpu", "decode") if k in record)
            why[piece.seed] = (f"seed {piece.seed} was started on upstream {started}"
                               + (f" ({where})" if where else "")
                               + f", this machine built {upstream}: its pieces need that "
                               "machine type and decode route (HISR_DECODE_KERNEL=0 for sdpa)")
            continue
        keep.append(piece)
    return keep, list(why.values())


def fit(todo: Sequence[Piece], minutes: float, slower: float = 1.0,
        done: Mapping[str, float] | None = None) -> list[Piece]:
    """The longest prefix of ``todo`` whose estimated minutes (:meth:`Piece.minutes`, of what
    is left of a piece named in ``done``) add up to ``minutes`` or less, a PPO run only with
    its evaluation (a run without one compares nothing)."""
    done = done or {}
    out: list[Piece] = []
    total = 0.0
    i = 0
    while i < len(todo):
        group = [todo[i]]
        nxt = todo[i + 1] if i + 1 < len(todo) else None
        if todo[i].kind == "ppo" and nxt is not None and nxt.kind == "evaluate":
            group.append(nxt)
        cost = sum(p.minutes(slower, done.get(p.name, 0.0)) for p in group)
        if total + cost > minutes:
            break
        out += group
        total += cost
        i += len(group)
    return out


def to_split(todo: Sequence[Piece], plan: Sequence[Piece], minutes: float,
             slower: float = 1.0, done: Mapping[str, float] | None = None,
             least: float = LEAST_PARTIAL) -> Piece | None:
    """The piece after ``plan`` in ``todo`` when it is a PPO run (followed by its evaluation)
    that does not fit whole in ``minutes`` (the budget) while ``least`` minutes or more are
    left after ``plan``'s estimates and its evaluation's: it runs until the budget is spent and
    stops at a checkpoint, to be resumed later on this machine. ``None``: no such piece."""
    done = done or {}
    nxt = todo[len(plan):len(plan) + 2]
    if len(nxt) < 2 or nxt[0].kind != "ppo" or nxt[1].kind != "evaluate":
        return None
    left = minutes - sum(p.minutes(slower, done.get(p.name, 0.0)) for p in [*plan, nxt[1]])
    return nxt[0] if left >= least else None


def record_seed(root: Path, seed: int, info: dict[str, Any]) -> None:
    """Write the seed's upstream record once (its first piece); later pieces keep it."""
    path = seed_file(root, seed)
    if not path.is_file():
        from tasks.files import write_text
        write_text(path, json.dumps(info, indent=2, sort_keys=True) + "\n")
