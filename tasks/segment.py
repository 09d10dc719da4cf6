"""Tasks of the ``segment`` stage: sub-goal segments of every kept rollout (``D_st``), and the
turns-per-segment histogram split by success and failure (the paper's Fig. 3)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hisr_core import contracts
from hisr_core.config import Params
from hisr_core.envs import environment_class
from hisr_core.segment.segmenter import Segment, segment_offline, validate
from tasks.caching import cached_task
from tasks.files import save_figure, write_csv


@cached_task("segment-trajectories", inputs=["d_ct"], outputs=["out"],
             sections=["env", "segment"], retries=2)
def segment(params: Params, d_ct: Path, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Segment every trajectory of ``d_ct`` with ``segment.segmenter``; write ``out`` (D_st)
    once all are done. Returns the rows and the metrics."""
    cfg = params.segment
    rows = contracts.read_rows(d_ct, "rollouts")
    stats: dict[str, Any] = {}
    if cfg.segmenter == "llm":
        from hisr_core.segment.llm import LLMSegmenter

        c = cfg.llm
        llm = LLMSegmenter(c.base_url, c.model, c.api_key_env, Path(c.cache_dir),
                           concurrency=c.concurrency, timeout_s=c.timeout_s,
                           max_retries=c.max_retries, attempts=c.attempts,
                           max_tokens=c.max_tokens)
        with tqdm(total=len(rows), desc="segment llm", unit="traj", mininterval=2) as bar:
            results = llm.segment_all(rows, on_done=bar.update)
        stats = dict(llm.stats)
    else:
        verbs = environment_class(params.env.name).state_changing_verbs
        results = [{"segments": segment_offline(cfg.segmenter, r["turns"], verbs,
                                                cfg.entropy_threshold, cfg.entropy_min_turns),
                    "fallback": False, "reason": ""} for r in rows]
    keep = [f.name for f in contracts.schema("segmented")]
    out_rows = []
    for row, res in zip(rows, results, strict=True):
        validate(res["segments"], len(row["turns"]))
        out_rows.append({**{k: row[k] for k in keep if k in row}, "segmenter": cfg.segmenter,
                         "segments": [s.to_row() for s in res["segments"]],
                         "fallback": res["fallback"], "fallback_reason": res["reason"]})
    contracts.write_rows(out_rows, out, "segmented")
    return out_rows, {**segment_metrics(out_rows), **({"llm": stats} if stats else {})}


def segment_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and mean turns per segment, overall and by success / failure."""
    def mean_len(sel: list[dict[str, Any]]) -> float:
        segs = [s for r in sel for s in r["segments"]]
        return sum(Segment.from_row(s).turns for s in segs) / len(segs) if segs else 0.0

    won = [r for r in rows if r["won"]]
    lost = [r for r in rows if not r["won"]]
    n_segments = sum(len(r["segments"]) for r in rows)
    return {"trajectories": len(rows), "segments": n_segments,
            "segments_per_trajectory": n_segments / len(rows) if rows else 0.0,
            "fallbacks": sum(r["fallback"] for r in rows),
            "mean_turns_per_segment": {"all": mean_len(rows), "success": mean_len(won),
                                       "failure": mean_len(lost)}}


def length_histogram(rows: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per segment length (turns): how many segments of successful and of failed
    trajectories have it."""
    count: dict[bool, collections.Counter[int]] = {True: collections.Counter(),
                                                   False: collections.Counter()}
    for r in rows:
        for s in r["segments"]:
            count[bool(r["won"])][Segment.from_row(s).turns] += 1
    top = max([*count[True], *count[False], 1])
    return [{"turns": n, "success": count[True][n], "failure": count[False][n]}
            for n in range(1, top + 1)]


def write_histogram(rows: list[dict[str, Any]], csv_path: Path, png_path: Path,
                    segmenter: str) -> None:
    """The histogram as CSV (a DVC plot) and as a PNG (logged to MLflow), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = length_histogram(rows)
    columns = ["turns", "success", "failure"]
    write_csv(csv_path, [columns, *([t[c] for c in columns] for t in table)])
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    x = [t["turns"] for t in table]
    for offset, key, color in ((-0.2, "success", "tab:green"), (0.2, "failure", "tab:red")):
        total = sum(t[key] for t in table) or 1
        ax.bar([v + offset for v in x], [t[key] / total for t in table], width=0.4,
               color=color, label=f"{key} ({sum(t[key] for t in table)} segments)")
    ax.set_xlabel("turns per segment")
    ax.set_ylabel("share of segments")
    ax.set_title(f"Segment length, {segmenter} segmenter")
    ax.set_xticks(x)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, png_path)
