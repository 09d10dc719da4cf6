"""Tasks of the ``report`` stage: read every evaluation, learning curve and analysis of the
pipeline and write one Markdown and one HTML report (the paper's Table 1, the curves, Fig. 3
and 4, the case tables)."""

from __future__ import annotations

import csv
import html
import json
import math
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from hisr_core import contracts
from hisr_core.config import Params
from hisr_core.report import (
    Cell,
    block_differences,
    curve_difference,
    markdown_table,
    mean_curve,
    order,
    ordered,
    outcome_matrix,
    paired_difference,
    paired_runs,
    success_interval,
    success_table,
    versus_reference,
)
from tasks.evaluate import OUTCOMES_FILE, read_outcomes, task_types
from tasks.files import save_figure, write_csv, write_text

#: Curve columns plotted (``curve.csv`` of a PPO run), with their axis labels.
CURVES = {"rollout_success": "rollout success", "rewards_fused_mean": "fused reward / episode",
          "policy_kl": "KL to pi_ref / token", "policy_clipfrac": "clipped share of tokens",
          "credit_spearman": "credit Spearman (fused vs oracle)"}


@dataclass
class Inputs:
    """What the report found: evaluations per policy (one per seed), PPO curves per variant
    and seed, the start curves per seed, and the runs of the sweep that are missing."""

    evaluations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    curves: dict[str, dict[int, list[dict[str, float]]]] = field(default_factory=dict)
    #: seed → ``pi_ref`` playing that seed's PPO draws (``flows.start_curve``).
    starts: dict[int, list[dict[str, float]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    #: policy → split → seed → ``{task_id: 1.0 | 0.0}``, for each seed whose outcomes are at
    #: hand; seed ``None``: one ``sft`` evaluation shared by every seed.
    outcomes: dict[str, dict[str, dict[int | None, dict[str, float]]]] = field(
        default_factory=dict)


def _read_curve(path: Path) -> list[dict[str, float]]:
    with path.open(newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)}
                for row in csv.DictReader(f)]


def _outcomes(folder: Path) -> dict[str, dict[str, float]]:
    """split → task id → outcome of one evaluation: its ``outcomes.csv`` (tracked in git), or
    else its episodes (in DVC's cache, from before that file was written)."""
    if (folder / OUTCOMES_FILE).is_file():
        return read_outcomes(folder / OUTCOMES_FILE)
    return {episodes.stem: {r["task_id"]: float(r["won"])
                            for r in contracts.read_rows(episodes, "episodes")}
            for episodes in sorted((folder / "episodes").glob("*.parquet"))}


def gather(params: Params, data: Path) -> Inputs:
    """Every evaluation and curve of ``sft`` and the sweep (``sweep.variants`` x
    ``sweep.seeds``); fails, naming the stage to run, when there is no evaluation at all."""
    found = Inputs()
    # ``sft`` once, or once per seed where each seed has its own copy (the study: a seed's
    # variants are paired with the evaluation of the pi_ref they started from).
    sft_seeds = [s for s in params.sweep.seeds
                 if (data / "eval" / "sft" / f"seed{s}" / "metrics.json").is_file()]
    runs = ([("sft", s) for s in sft_seeds] if sft_seeds else [("sft", None)]) + \
        [(v, s) for v in params.sweep.variants for s in params.sweep.seeds]
    for policy, seed in runs:
        name = policy if seed is None else f"{policy}/seed{seed}"
        metrics = data / "eval" / name / "metrics.json"
        if metrics.is_file():
            found.evaluations.setdefault(policy, []).append(json.loads(metrics.read_text())["eval"])
        else:
            found.missing.append(f"evaluate {name}")
        for split, won in _outcomes(data / "eval" / name).items():
            found.outcomes.setdefault(policy, {}).setdefault(split, {})[seed] = won
        curve = data / "ppo" / policy / f"seed{seed}" / "curve.csv"
        if seed is not None and policy != "sft" and curve.is_file():  # sft's: start curves
            rows = _read_curve(curve)
            if rows and "rollout_success" in rows[0]:  # rft's curve is a loss curve
                found.curves.setdefault(policy, {})[seed] = rows
    for seed in params.sweep.seeds:
        start = data / "ppo" / "sft" / f"seed{seed}" / "curve.csv"
        if start.is_file() and (rows := _read_curve(start)):
            found.starts[seed] = rows
    if not found.evaluations:
        raise FileNotFoundError(f"no evaluation under {data / 'eval'}; run the evaluate stages "
                                "first (dvc repro evaluate_sft, dvc repro evaluate)")
    return found


def plot_curves(curves: dict[str, dict[int, list[dict[str, float]]]], path: Path) -> None:
    """One panel per ``CURVES`` column, one line per policy (mean over seeds); an empty
    figure saying so when no PPO run has a curve (``rft`` only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.6))
    for ax, (key, label) in zip(axes, CURVES.items(), strict=True):
        for variant in ordered(list(curves)):
            points = mean_curve(list(curves[variant].values()), key)
            if points:
                n = len(curves[variant])
                ax.plot(*zip(*points, strict=True), marker="o", markersize=3,
                        label=variant + (f" ({n} seeds)" if n > 1 else ""))
        ax.set_xlabel("iteration")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if curves:
        axes[0].legend(fontsize=8)
    else:
        axes[0].text(0.5, 0.5, "no PPO curves", ha="center", transform=axes[0].transAxes)
    fig.tight_layout()
    save_figure(fig, path)


def learning_rows(curves: dict[str, dict[int, list[dict[str, float]]]],
                  starts: dict[int, list[dict[str, float]]], figure: Path
                  ) -> tuple[list[str], list[list[str]]]:
    """The table of each variant's success minus its start curve's per block of iterations
    (about six blocks over the run), and ``figure``: those differences per iteration, a moving
    mean over a block (a figure that says so, and no rows, without start curves)."""
    diffs = {v: d for v in ordered(list(curves))
             if (d := curve_difference(curves[v], starts)).size}
    if not diffs:
        _plot_learning({}, 1, figure)
        return [], []
    width = max(d.shape[1] for d in diffs.values())
    block = max(1, math.ceil(width / 6))
    spans = [(first, min(first + block - 1, width)) for first in range(1, width + 1, block)]
    header = ["variant", *(f"iterations {a}–{b}" for a, b in spans), "seeds"]
    rows = []
    for variant, diff in diffs.items():
        cells = {first: _interval(m, lo, hi, signed=True)
                 for first, _, m, lo, hi in block_differences(diff, block)}
        rows.append([variant, *(cells.get(a, "-") for a, _ in spans), str(diff.shape[0])])
    _plot_learning(diffs, block, figure)
    return header, rows


def _plot_learning(diffs: dict[str, np.ndarray], block: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean(values: np.ndarray) -> float:
        values = values[~np.isnan(values)]
        return float(values.mean()) if values.size else math.nan

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for variant, diff in diffs.items():
        # Window ending at each iteration: every (seed, iteration) cell in it with a value.
        ends = range(block, diff.shape[1] + 1)
        ax.plot(list(ends), [100 * mean(diff[:, end - block:end].ravel()) for end in ends],
                label=f"{variant} ({diff.shape[0]} seed{'s' if diff.shape[0] > 1 else ''})")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("iteration (end of the moving window)")
    ax.set_ylabel(f"success − start, points ({block}-iteration mean)")
    ax.grid(alpha=0.3)
    if diffs:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no PPO run with a start curve (dvc repro start_curve)", ha="center",
                transform=ax.transAxes)
    fig.tight_layout()
    save_figure(fig, path)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _add_table(md: list[str], page: list[str], title: str, header: list[str],
               rows: list[list[str]], note: str | None = None) -> None:
    """A titled table (and a note above it) appended to the Markdown and the HTML report."""
    md += [f"## {title}", "", *([note, ""] if note else []), "| " + " | ".join(header) + " |",
           "|---" * len(header) + "|", *("| " + " | ".join(r) + " |" for r in rows), ""]
    page.append(f"<h2>{html.escape(title)}</h2>" + (f"<p>{html.escape(note)}</p>" if note else "")
                + _html_table(header, rows))


def _body(page: str) -> str:
    """The inside of an HTML page's ``<body>`` (its first heading dropped)."""
    match = re.search(r"<body>(.*)</body>", page, re.DOTALL)
    inner = match.group(1) if match else page
    return re.sub(r"^\s*<h1>.*?</h1>", "", inner, count=1, flags=re.DOTALL)


# Not a cached task: it takes a second, and which files it reads is only known as it runs.
@task(name="write-report")
def write_report(params: Params, data: Path, out: Path) -> dict[str, Any]:
    """Write ``out/report.md``, ``out/report.html``, ``out/table.csv`` and the figures they
    show; return the Avg success per policy and split (for MLflow and DVC metrics)."""
    found = gather(params, data)
    types = task_types(params.env.name)
    columns = [*types, "Avg"]
    tables = {s: success_table(found.evaluations, s, types) for s in params.evaluate.splits}
    ev = params.evaluate
    decoding = ("greedy" if ev.temperature == 0
                else f"temperature {ev.temperature:g}, top-p {ev.top_p:g}, seed {ev.seed}")
    intro = (f"Environment `{params.env.name}`, model `{params.model.name_or_path}`; PPO runs: "
             f"variants {', '.join(params.sweep.variants)} x seeds "
             f"{', '.join(map(str, params.sweep.seeds))}. Success rate in % ({decoding} episodes, "
             + (f"first {params.evaluate.n_tasks} tasks" if params.evaluate.n_tasks
                else "every task") + " of each split); mean ± sample std "
             "over seeds where there are several.")
    md = ["# HISR report", "", intro, ""]
    page = [f"<h1>HISR report</h1><p>{html.escape(intro)}</p>"]
    if found.missing:
        note = "Not found (not run yet): " + ", ".join(found.missing) + "."
        md += [note, ""]
        page.append(f"<p><b>{html.escape(note)}</b></p>")
    csv_rows: list[list[Any]] = [["split", "policy", "column", "mean", "std", "seeds"]]
    summary: dict[str, Any] = {}
    for split, table in tables.items():
        md += [f"## Success rate, {split}", "", markdown_table(table, columns), ""]
        page.append(f"<h2>Success rate, {html.escape(split)}</h2>" + _html_table(
            ["policy", *columns, "seeds"],
            [[p, *(row[c].percent() if c in row else "-" for c in columns), str(row["Avg"].n)]
             for p, row in table.items()]))
        for policy, row in table.items():
            csv_rows += [[split, policy, c, cl.mean, "" if cl.std is None else cl.std, cl.n]
                         for c, cl in row.items()]
            summary.setdefault(policy, {})[split] = _as_dict(row["Avg"])
    write_csv(out / "table.csv", csv_rows)
    for split in params.evaluate.splits:
        header, rows, diffs = comparison_rows(found.outcomes, split)
        if rows:
            title = f"Paired comparisons, {split}"
            note = ("Avg success and differences in percentage points, with 95% bootstrap "
                    "intervals over the same tasks and seeds (seed s of one policy paired with "
                    "seed s of the other); an interval that excludes 0 tells the two apart.")
            _add_table(md, page, title, header, rows, note)
            lines = verdict_lines(diffs, params.sweep.seeds)
            note = (f"Each test from its interval above: {len(lines)} intervals at 95% with no "
                    "correction for multiplicity, so one may exclude 0 by chance.")
            md += [note, "", *lines, ""]
            page.append(f"<p>{html.escape(note)}</p><ul>" + "".join(
                f"<li>{html.escape(line[2:].replace('`', ''))}</li>" for line in lines) + "</ul>")
    plot_curves({**({"sft": found.starts} if found.starts else {}), **found.curves},
                out / "curves.png")
    if found.curves:
        note = ("Per PPO iteration, mean over seeds; `sft`: `pi_ref` playing the same draws "
                "(`flows.start_curve`).")
        md += ["## Learning curves", "", note, "", "![learning curves](curves.png)", ""]
        page.append(f"<h2>Learning curves</h2><p>{html.escape(note)}</p>"
                    "<img src='curves.png' alt='learning curves'>")
    header, rows = learning_rows(found.curves, found.starts, out / "learning.png")
    if rows:
        note = ("Training success minus that of `pi_ref` playing the same tasks with the same "
                "sampler seeds, in percentage points, per block of iterations (mean over the "
                "block's iterations and seeds, 95% bootstrap interval over them). The draws' "
                "varying difficulty cancels; the first iteration is played by `pi_ref` in both.")
        _add_table(md, page, "Learning against the start (training draws)", header, rows, note)
        md += ["![learning against the start](learning.png)", ""]
        page.append("<img src='learning.png' alt='learning against the start'>")
    md_a, page_a = _analyses(data, out)
    md += md_a
    page += page_a
    write_text(out / "report.md", "\n".join(md) + "\n")
    write_text(out / "report.html", "<!doctype html><html><head><meta charset='utf-8'><title>"
               "HISR report</title><style>body{font-family:sans-serif;max-width:72em;"
               "margin:auto}table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px "
               "solid #ccc;padding:2px 6px;font-size:90%}img{max-width:100%}</style></head>"
               "<body>" + "\n".join(page) + "</body></html>\n")
    return {"avg_success": summary, "missing": len(found.missing)}


#: The policies every other is compared with: ``sft`` (does RL improve on its start) and the
#: paper's ordering ``hisr > no_both > ppo`` pair by pair.
REFERENCES = ("sft", "no_both", "ppo")
ORDERING = (("hisr", "no_both"), ("no_both", "ppo"), ("hisr", "ppo"))

#: (policy, other) → (policy minus other, 95% interval low, high; the seeds paired).
Differences = dict[tuple[str, str], tuple[float, float, float, list[int | None]]]


def _interval(point: float, low: float, high: float, signed: bool = False) -> str:
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(100 * point)} [{fmt.format(100 * low)}, {fmt.format(100 * high)}]"


def _seeds(seeds: Sequence[int | None]) -> str:
    return "one run" if list(seeds) == [None] else ", ".join(map(str, seeds))


def comparison_rows(outcomes: dict[str, dict[str, dict[int | None, dict[str, float]]]],
                    split: str) -> tuple[list[str], list[list[str]], Differences]:
    """Per policy with episodes of ``split``: its Avg success with a 95% interval, and its
    paired difference to each of ``REFERENCES`` over the tasks every run played and the seeds
    both have (the cell names them where they are fewer than the policy's own); also those
    differences, for :func:`verdict_lines`."""
    runs = {p: by_split[split] for p, by_split in outcomes.items() if by_split.get(split)}
    tasks = sorted(set.intersection(*(set(r) for rs in runs.values() for r in rs.values()))) \
        if runs else []
    if not tasks:
        return [], [], {}
    diffs: Differences = {}
    for policy, run in runs.items():
        for other in REFERENCES:
            if other in runs and other != policy:
                a, b, seeds = paired_runs(run, runs[other], tasks)
                if seeds:
                    diffs[policy, other] = (*paired_difference(a, b), seeds)
    header = ["policy", f"Avg [95% CI] ({len(tasks)} tasks)", *(f"vs {o}" for o in REFERENCES),
              "seeds"]
    rows = []
    for policy in ordered(list(runs)):
        own = sorted(runs[policy], key=lambda s: -1 if s is None else s)
        cells = []
        for other in REFERENCES:
            if (policy, other) not in diffs:
                cells.append("–")
                continue
            *interval, seeds = diffs[policy, other]
            fewer = len(seeds) < len(own) and None not in own
            cells.append(_interval(*interval, signed=True)
                         + (f" (seed{'s' if len(seeds) > 1 else ''} {_seeds(seeds)})"
                            if fewer else ""))
        rows.append([policy, _interval(*success_interval(outcome_matrix(
            [runs[policy][s] for s in own], tasks))), *cells, _seeds(own)])
    return header, rows, diffs


def verdict_lines(diffs: Differences, seeds: Sequence[int]) -> list[str]:
    """The study's tests in words (docs/results.md): each variant against ``sft`` (beats it,
    not worse within the 3-point margin, or may be worse) and the ordering's pairs (differ or
    cannot be told apart), each with its interval and the seeds it rests on; interim where a
    test has fewer seeds than ``sweep.seeds``."""
    def rests_on(paired: list[int | None]) -> str:
        shown = [s for s in paired if s is not None]
        n = len(shown)
        interim = "; interim" if n < len(seeds) else ""
        return f"{n} of {len(seeds)} seeds{interim}" if shown else "one run each"

    words = {"beats": "beats `sft`", "not worse": "not worse than `sft` (3-point margin), "
             "not shown better", "may be worse": "may be worse than `sft` by more than 3 points",
             "worse": "worse than `sft` by more than 3 points"}
    lines = []
    for policy in ordered(sorted({p for p, _ in diffs})):
        if (policy, "sft") in diffs:
            point, low, high, paired = diffs[policy, "sft"]
            lines.append(f"- `{policy}` {words[versus_reference(low, high)]}: "
                         f"{_interval(point, low, high, signed=True)} ({rests_on(paired)})")
    for a, b in ORDERING:
        if (a, b) in diffs:
            point, low, high, paired = diffs[a, b]
            sign = order(low, high)
            said = (f"`{a}` {sign} `{b}`" if sign != "≈"
                    else f"`{a}` and `{b}` cannot be told apart")
            lines.append(f"- {said}: `{a}` − `{b}` {_interval(point, low, high, signed=True)} "
                         f"({rests_on(paired)})")
    return lines


def _as_dict(c: Cell) -> dict[str, float]:
    return {"mean": c.mean, **({"std": c.std} if c.std is not None else {}), "seeds": c.n}


def credit_table_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The rewards stage's ``credit.csv`` as a table: per scope and signal, each metric as
    ``point [low, high]`` (the return-margin ratio to the outcome's as a plain number)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    metrics = ["spearman", "kendall", "first_error_top1", "return_margin"]

    def cell(row: dict[str, str], key: str) -> str:
        point, low, high = row[key], row[f"{key}_low"], row[f"{key}_high"]
        if not point:
            return "–"
        return f"{float(point):.3f} [{float(low):.3f}, {float(high):.3f}]" if low else \
            f"{float(point):.3f}"

    header = ["scope", "signal", "Spearman", "Kendall τ", "first error top-1", "return margin",
              "margin / outcome's"]
    body = [[r["scope"], r["signal"], *(cell(r, m) for m in metrics),
             f"{float(r['return_margin_ratio']):.2f}" if r["return_margin_ratio"] else "–"]
            for r in rows]
    return header, body


def option_table_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The rewards stage's ``credit_options.csv`` as a table: per combination of the reward
    options and scope, ``r_him``'s Spearman and Kendall τ with their CIs, and the return
    margin over the outcome's of ``hisr`` and of the variant where it is lowest."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    groups: dict[tuple[str, ...], dict[str, dict[str, str]]] = {}
    for r in rows:
        key = (r["importance"], r["rescale"], r["grounding"], r["scope"])
        groups.setdefault(key, {})[r["signal"]] = r

    def ci(r: dict[str, str], key: str) -> str:
        return (f"{float(r[key]):.3f} [{float(r[key + '_low']):.3f}, "
                f"{float(r[key + '_high']):.3f}]") if r.get(key) else "–"

    header = ["importance", "rescale", "grounding", "scope", "r_him Spearman", "r_him Kendall τ",
              "hisr margin / outcome's", "lowest margin / outcome's"]
    body = []
    for key, signals in groups.items():
        ratios = {s: float(r["return_margin_ratio"]) for s, r in signals.items()
                  if r.get("return_margin_ratio")}
        low = min(ratios, key=ratios.get) if ratios else None
        body.append([*key, ci(signals["r_him"], "spearman"), ci(signals["r_him"], "kendall"),
                     f"{ratios['hisr']:.2f}" if "hisr" in ratios else "–",
                     f"{ratios[low]:.2f} ({low})" if low else "–"])
    return header, body


def _num(row: dict[str, str], key: str) -> float:
    """A cell of a metrics CSV (empty where the metric is undefined: NaN)."""
    return float(row[key]) if row.get(key) else math.nan


def _versus(a: dict[str, str], b: dict[str, str], key: str) -> str:
    """How ``a``'s ``key`` compares with ``b``'s by their 95% intervals (an undefined interval
    tells nothing apart)."""
    if _num(a, f"{key}_low") > _num(b, f"{key}_high"):
        return "is above"
    if _num(a, f"{key}_high") < _num(b, f"{key}_low"):
        return "is below"
    return "cannot be told apart from"


def credit_verdict(credit_csv: Path, told_json: Path | None = None) -> list[str]:
    """The sentences under the credit table: whether ``r_him`` ranks segments better than
    ``r_hat`` and the turn SPRM (pooled Spearman over all of ``D_st``, intervals apart or
    not), and whether ``pi_hind`` reads the future where it tells the answer (held-out
    ``told`` NLL difference, ``hindsight_told.json``); if either fails, that modulation does
    not beat ``r_hat`` here."""
    with credit_csv.open(newline="") as f:
        rows = {r["signal"]: r for r in csv.DictReader(f) if r["scope"] == "credit"}
    if not {"r_him", "r_hat"} <= set(rows):
        return []

    def ci(signal: str) -> str:
        point, low, high = (_num(rows[signal], k)
                            for k in ("spearman", "spearman_low", "spearman_high"))
        return f"{point:.3f} [{low:.3f}, {high:.3f}]"

    others = [s for s in ("r_hat", "turn_sprm") if s in rows]
    verdicts = {s: _versus(rows["r_him"], rows[s], "spearman") for s in others}
    lines = ["Spearman of `r_him` " + "; ".join(
        f"{verdicts[s]} `{s}`'s ({ci('r_him')} vs {ci(s)})" for s in others) + "."]
    reads = None
    if told_json is not None and told_json.is_file():
        told = json.loads(told_json.read_text())["heldout"]
        delta, low, high = (told[f"told/{k}"] for k in ("delta", "delta_low", "delta_high"))
        reads = high < 0
        lines.append(
            f"On held-out turns whose next observation tells the answer, `pi_hind`'s NLL minus "
            f"`pi_ref`'s is {delta:+.5f} [{low:+.5f}, {high:+.5f}] ({delta / told['told/nll_ref']:+.2%}): "
            + ("`pi_hind` reads the future there." if reads else
               "`pi_hind` does not read the future measurably, so `z` carries no hindsight."))
    if any(v != "is above" for v in verdicts.values()) or reads is False:
        lines.append("**Modulation does not beat `r_hat` here**: at this model size the "
                     "hindsight-modulated reward is not a better credit signal than the "
                     "segment SPRM alone.")
    return lines


def _analyses(data: Path, out: Path) -> tuple[list[str], list[str]]:
    """The segment and reward analyses (Fig. 3, Fig. 4 and its table, the credit accuracy of
    each reward signal, the case tables),
    where their stages have written them; the figures are copied beside the report."""
    md: list[str] = []
    page: list[str] = []
    figures = [("segment/segment_lengths.png", "Turns per segment, by outcome (Fig. 3)"),
               ("rewards/position_share.png",
                "Share of reward by segment position, before and after modulation (Fig. 4)")]
    for rel, title in figures:
        src = data / rel
        if src.is_file():
            shutil.copyfile(src, out / src.name)
            md += [f"## {title}", "", f"![{title}]({src.name})", ""]
            page.append(f"<h2>{html.escape(title)}</h2><img src='{src.name}' "
                        f"alt='{html.escape(title)}'>")
    share = data / "rewards" / "position_share.csv"
    if share.is_file():
        with share.open(newline="") as f:
            rows = list(csv.reader(f))
        fmt = [[r[0], *(f"{float(v):.3f}" for v in r[1:])] for r in rows[1:]]
        md += ["| " + " | ".join(rows[0]) + " |", "|---" * len(rows[0]) + "|",
               *("| " + " | ".join(r) + " |" for r in fmt), ""]
        page.append(_html_table(rows[0], fmt))
    for name, reader, title in (
            ("credit.csv", credit_table_rows,
             "Credit accuracy against the oracle (95% bootstrap CIs over trajectories)"),
            ("credit_options.csv", option_table_rows,
             ("Credit accuracy under each combination of the reward options (chosen on the "
              "SPRM's training tasks, reported on its held-out tasks)"))):
        path = data / "rewards" / name
        if path.is_file():
            verdict = (credit_verdict(path, data / "rewards" / "hindsight_told.json")
                       if name == "credit.csv" else [])
            _add_table(md, page, title, *reader(path), note=" ".join(verdict) or None)
    cases_md, cases_html = data / "rewards" / "cases.md", data / "rewards" / "cases.html"
    if cases_md.is_file():
        text = cases_md.read_text(encoding="utf-8")
        # The case tables' own headings move one level down, under the report's.
        md += ["## Reward case tables (Table 2)", "",
               re.sub(r"^(#+) ", r"#\1 ", re.sub(r"^# .*\n", "", text, count=1), flags=re.MULTILINE)]
    if cases_html.is_file():
        page.append("<h2>Reward case tables (Table 2)</h2>"
                    + _body(cases_html.read_text(encoding="utf-8")))
    return md, page
