"""Tasks of the ``rewards`` stage: hindsight-modulated segmental rewards of ``D_st`` with
``pi_ref`` as the scored policy, the reward share by segment position (the paper's Fig. 4) and
case tables (the paper's Table 2)."""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hisr_core import contracts
from hisr_core.agent.models import load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import Params
from hisr_core.envs import UNKNOWN_DISTANCE, environment_class
from hisr_core.rewards.credit import (
    CreditRecord,
    credit_table,
    pooled_spearman,
    position_r2,
    segment_credit,
)
from hisr_core.rewards.gated_attention import load_gated
from hisr_core.rewards.hindsight import Window, hindsight_logprobs, told_nll, told_turns
from hisr_core.rewards.modulation import (
    POSITIONS,
    TURN_LEVEL,
    RewardOptions,
    modulate,
    position_mass,
    segment_importance,
    trajectory_rewards,
    variants_from_ratios,
)
from hisr_core.rewards.sprm import load_sprm, pearson, turn_rewards
from hisr_core.segment.segmenter import Segment
from hisr_core.train.engine import resolve_dtype
from hisr_core.train.fit import split_by_task
from hisr_core.train.scoring import episode_of, turn_logprobs
from tasks.caching import cached_task
from tasks.files import save_figure, write_csv, write_text
from tasks.sprm import encode_rows


def _sprm_turn_rewards(path: Path, rows: list[dict[str, Any]], builder: PromptBuilder,
                       params: Params, turn_level: bool) -> list[torch.Tensor]:
    model, tokenizer = load_sprm(path, resolve_dtype(params.model.dtype))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trajectories = encode_rows(rows, builder, params.env.name, turn_level)
    return turn_rewards(model, trajectories, pad, params.rewards.max_batch_tokens)


@cached_task("score-rewards", inputs=["d_st", "pi_ref", "pi_hind", "sprm", "d_ct"],
             outputs=["out", "told_json"],
             sections=["env", "segment", "model", "hindsight", "rewards"])
def score(params: Params, d_st: Path, pi_ref: Path, pi_hind: Path, sprm: Path, d_ct: Path,
          out: Path, told_json: Path) -> list[dict[str, Any]]:
    """Score every trajectory of ``D_st`` (log-probs under ``pi_ref`` and ``pi_hind``, the
    SPRMs' rewards), compute its rewards for every variant and write ``out``; write
    ``told_json``: where the future tells a turn's answer, how much better ``pi_hind``
    predicts it than ``pi_ref`` (:func:`~hisr_core.rewards.hindsight.told_nll`), over all of
    ``D_st`` and over the tasks the hindsight stage held out (its split of ``d_ct``)."""
    cfg = params.rewards
    dtype = resolve_dtype(params.model.dtype)
    rows = contracts.read_rows(d_st, "segmented")
    grammar = environment_class(params.env.name).command_grammar
    builder = PromptBuilder.of(load_tokenizer(pi_ref), params.model)
    policy = turn_logprobs(load_model(pi_ref, dtype=dtype).eval(), builder,
                           [episode_of(builder, r, grammar) for r in rows], cfg.max_batch_tokens,
                           progress="score pi_ref")
    hind = hindsight_logprobs(load_gated(pi_hind, dtype=dtype).eval(), builder, rows, grammar,
                              Window.of(params.hindsight),
                              cfg.max_batch_tokens,
                              progress="score pi_hind")
    told = [told_turns(r) for r in rows]
    ct_tasks = sorted({r["task_id"] for r in contracts.read_rows(d_ct, "rollouts")})
    _, held_idx = split_by_task(ct_tasks, params.hindsight.holdout, params.hindsight.seed)
    held = {ct_tasks[i] for i in held_idx}
    sel = [i for i, r in enumerate(rows) if r["task_id"] in held]
    contracts.write_json({
        "all": told_nll(told, hind, policy),
        "heldout": told_nll([told[i] for i in sel], [hind[i] for i in sel],
                            [policy[i] for i in sel]),
        "heldout_trajectories": len(sel)}, told_json)
    seg_r = _sprm_turn_rewards(sprm / "model", rows, builder, params, False)
    turn_r: list[torch.Tensor | None] = [None] * len(rows)
    if TURN_LEVEL & set(cfg.variants):
        turn_r = list(_sprm_turn_rewards(sprm / "turn_model", rows, builder, params, True))
    out_rows = []
    for i, row in enumerate(rows):
        segments = [Segment.from_row(s) for s in row["segments"]]
        admissible = [t["admissible"] for t in row["turns"]]
        res = trajectory_rewards(policy[i], hind[i], seg_r[i], turn_r[i], segments, admissible,
                                 row["outcome"], cfg.beta, cfg.alpha, cfg.variants,
                                 RewardOptions.of(cfg))
        out_rows.append({
            **{k: row[k] for k in ("task_id", "env", "split", "task_type", "instruction",
                                   "sample", "n_turns", "won", "outcome", "segmenter")},
            "segments": [{**s.to_row(), "r_hat": float(res.r_hat[j]),
                          "importance": float(res.segment_importance[j]),
                          "r_him": float(res.r_him[j])} for j, s in enumerate(segments)],
            "turns": [{"action": t["action"], "admissible": t["admissible"],
                       "log_ratio": float(res.log_ratios[k]),
                       "importance": float(res.turn_importance[k]),
                       "r_turn": float(turn_r[i][k]) if turn_r[i] is not None else math.nan,
                       "true_credit": _true_credit(t)}
                      for k, t in enumerate(row["turns"])],
            "variants": [{"variant": v, "turn_rewards": res.variants[v].tolist()}
                         for v in cfg.variants],
        })
    contracts.write_rows(out_rows, out, "rewards")
    return out_rows


def reward_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Summary numbers: how the SPRM's sums track R over all of ``D_st``, the hindsight
    log-ratios by outcome, and the reward shares by segment position."""
    sums = [sum(s["r_hat"] for s in r["segments"]) for r in rows]
    ratios = {w: [t["log_ratio"] for r in rows if r["won"] == w for t in r["turns"]]
              for w in (True, False)}
    out: dict[str, Any] = {
        "trajectories": len(rows),
        "r_hat_sum": {"success": _mean([s for s, r in zip(sums, rows) if r["won"]]),
                      "failure": _mean([s for s, r in zip(sums, rows) if not r["won"]])},
        "log_ratio": {"success": _mean(ratios[True]), "failure": _mean(ratios[False])},
        "position_share": position_shares(rows),
    }
    if len(rows) >= 2:
        out["r_hat_sum"]["pearson_all"] = pearson(sums, [r["outcome"] for r in rows])
    out["sprm_probe"] = shortcut_probe(rows)
    return out


def shortcut_probe(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How much of ``r_hat`` its segment's position explains (``position_r2``; the true
    credit's beside it), and ``r_hat``'s pooled Spearman with true credit
    within won and within failed trajectories (the SPRM's length shortcut: a signal that only
    tracks position ranks well pooled and poorly within each class)."""
    records = [r for r in credit_records(rows) if r is not None]
    out = {"position_r2": position_r2([[s["r_hat"] for s in r["segments"]] for r in rows]),
           "position_r2_true_credit": position_r2([r.segment_credit for r in records])}
    for name, won in (("won", True), ("failed", False)):
        sel = [r for r in records if r.won == won]
        out[f"spearman_{name}"] = pooled_spearman([r.segment_credit for r in sel],
                                                  [r.signals["r_hat"] for r in sel])
    return out


#: The reward signals whose credit accuracy is measured (docs/method.md, "Credit accuracy"),
#: per segment: the segment SPRM's ``r_hat``, the modulated ``r_him``, the importance ``z``
#: alone and the turn SPRM summed per segment; then every variant's fused reward.
SIGNALS = ("r_hat", "r_him", "z", "turn_sprm")


def _true_credit(turn: dict[str, Any]) -> float:
    """The drop of the oracle distance over a turn; NaN where the environment cannot tell
    (ALFWorld without ``env.options.oracle``)."""
    before, after = turn["distance_before"], turn["distance_after"]
    return math.nan if UNKNOWN_DISTANCE in (before, after) else float(before - after)


def credit_records(rows: Sequence[dict[str, Any]]) -> list[CreditRecord | None]:
    """Each rewards row as the credit metrics read it (``None`` where its true credit is
    unknown): its turns' true credit, its segments' signals, and each variant's fused rewards
    summed per segment and over the trajectory (its return with ``ppo.gamma: 1``)."""
    records: list[CreditRecord | None] = []
    for row in rows:
        if any(math.isnan(t["true_credit"]) for t in row["turns"]):
            records.append(None)
            continue
        segments = tuple(Segment.from_row(s) for s in row["segments"])
        turn_sprm = np.array([t["r_turn"] for t in row["turns"]], dtype=np.float64)
        signals = {"r_hat": [s["r_hat"] for s in row["segments"]],
                   "r_him": [s["r_him"] for s in row["segments"]],
                   "z": [s["importance"] for s in row["segments"]]}
        if np.isfinite(turn_sprm).all():
            signals["turn_sprm"] = segment_credit(turn_sprm, segments)
        returns = {}
        for v in row["variants"]:
            fused = np.asarray(v["turn_rewards"], dtype=np.float64)
            signals[v["variant"]] = segment_credit(fused, segments)
            returns[v["variant"]] = float(fused.sum())
        records.append(CreditRecord([t["true_credit"] for t in row["turns"]], segments,
                                    row["won"], row["outcome"], signals, returns))
    return records


def credit_metrics(rows: Sequence[dict[str, Any]], held_out: Sequence[int], n_boot: int,
                   seed: int) -> dict[str, dict[str, float]]:
    """The credit-accuracy table (:func:`hisr_core.rewards.credit.credit_table`) over all of
    ``D_st`` (``credit``) and over the trajectories of the tasks the SPRM held out (rows
    ``held_out``; ``credit_heldout``), keyed ``<signal>/<metric>``; trajectories whose true
    credit is unknown are left out (none known: no table)."""
    records = credit_records(rows)
    out = {}
    for scope, sel in (("credit", records), ("credit_heldout", [records[i] for i in held_out])):
        sel = [r for r in sel if r is not None]
        if sel:
            table = credit_table(sel, n_boot=n_boot, seed=seed)
            out[scope] = {k.removeprefix("credit/"): v for k, v in table.items()}
    return out


def write_credit_csv(metrics: dict[str, dict[str, float]], path: Path) -> None:
    """One row per scope and signal: each metric with its 95% CI (empty where undefined)."""
    columns = ["spearman", "kendall", "first_error_top1", "return_margin"]
    header = ["scope", "signal"] + [f"{c}{e}" for c in columns for e in ("", "_low", "_high")]
    header.append("return_margin_ratio")
    rows = []
    for scope, table in metrics.items():
        names = dict.fromkeys(k.rsplit("/", 1)[0] for k in table)
        for name in names:
            values = [table.get(f"{name}/{h}") for h in header[2:]]
            rows.append([scope, name, *("" if v is None or not np.isfinite(v) else f"{v:.4f}"
                                        for v in values)])
    write_csv(path, [header, *rows])


#: Every combination of the reward options (docs/method.md, "Reward options"), each measured by
#: the credit table over recorded trajectories (:func:`option_credit`).
OPTION_GRID = tuple(RewardOptions(i, r, g) for i in ("paper", "length_neutral")
                    for r in ("l1", "signed_total") for g in ("bonus", "penalty"))


def refused(row: dict[str, Any], alpha: float, options: RewardOptions) -> dict[str, Any]:
    """A rewards row with its importance ``z``, ``r_hat``'s modulation ``r_him`` and every
    variant's fused rewards computed again under ``options``, from the log-ratios and model
    rewards it records (no model is run)."""
    segments = [Segment.from_row(s) for s in row["segments"]]
    ratios = torch.tensor([t["log_ratio"] for t in row["turns"]], dtype=torch.float64)
    r_hat = torch.tensor([s["r_hat"] for s in row["segments"]], dtype=torch.float64)
    r_turn = torch.tensor([t["r_turn"] for t in row["turns"]], dtype=torch.float64)
    z = segment_importance(ratios, segments, options.importance)
    r_him = modulate(r_hat, z, options.rescale)
    fused = variants_from_ratios(ratios, r_hat, None if r_turn.isnan().any() else r_turn,
                                 segments, [t["admissible"] for t in row["turns"]],
                                 row["outcome"], alpha, [v["variant"] for v in row["variants"]],
                                 options)
    return {**row,
            "segments": [{**s, "importance": float(z[j]), "r_him": float(r_him[j])}
                         for j, s in enumerate(row["segments"])],
            "variants": [{"variant": v, "turn_rewards": r.tolist()} for v, r in fused.items()]}


def option_credit(rows: Sequence[dict[str, Any]], alpha: float, held_out: Sequence[int],
                  n_boot: int, seed: int) -> list[dict[str, Any]]:
    """The credit table (:func:`credit_metrics`) of ``z``, ``r_him`` and every variant under
    each combination of :data:`OPTION_GRID`, on the trajectories of the tasks the SPRM trained
    on (``select``: where options are chosen) and of those it held out (``heldout``: where the
    choice is reported). One record per options, scope and signal."""
    held = set(held_out)
    scopes = {"select": [i for i in range(len(rows)) if i not in held],
              "heldout": sorted(held)}
    out = []
    for options in OPTION_GRID:
        records = credit_records([refused(r, alpha, options) for r in rows])
        for scope, index in scopes.items():
            sel = [records[i] for i in index if records[i] is not None]
            if not sel:
                continue
            names = ["z", "r_him", *sel[0].returns]
            table = credit_table(sel, signals=names, n_boot=n_boot, seed=seed)
            for name in names:
                out.append({**dataclasses.asdict(options), "scope": scope, "signal": name,
                            **{k.split("/")[-1]: v for k, v in table.items()
                               if k.split("/")[1] == name}})
    return out


def write_option_csv(records: Sequence[dict[str, Any]], path: Path) -> None:
    """:func:`option_credit`'s records, one row each (empty where a metric is undefined)."""
    header = list(dict.fromkeys(k for r in records for k in r))
    write_csv(path, [header, *([_cell(r.get(k)) for k in header] for r in records)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if np.isfinite(value) else ""
    return "" if value is None else str(value)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def position_shares(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Share of absolute reward in the first / middle / last segment, before (``r_hat``) and
    after (``r_him``) modulation, over trajectories of >= 3 segments: all, and successful."""
    out: dict[str, dict[str, float]] = {}
    for group, sel in (("all", rows), ("success", [r for r in rows if r["won"]])):
        sel = [r for r in sel if len(r["segments"]) >= 3]
        for key in ("r_hat", "r_him"):
            mass = sum((position_mass(torch.tensor([s[key] for s in r["segments"]]))
                        for r in sel), torch.zeros(3, dtype=torch.float64))
            total = float(mass.sum())
            out[f"{group}/{key}"] = {p: float(m) / total if total > 0 else float("nan")
                                     for p, m in zip(POSITIONS, mass, strict=True)}
        out[f"{group}/trajectories"] = {"n": len(sel)}
    return out


def write_position_plot(shares: dict[str, dict[str, float]], csv_path: Path,
                        png_path: Path) -> None:
    """The share of reward by segment position, before and after modulation: CSV (a DVC plot)
    and PNG (grouped bars, all trajectories and successful ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {"r_hat_all": "all/r_hat", "r_him_all": "all/r_him",
            "r_hat_success": "success/r_hat", "r_him_success": "success/r_him"}
    write_csv(csv_path, [["position", *keys],
                         *([p, *(f"{shares[k][p]:.6f}" for k in keys.values())]
                           for p in POSITIONS)])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=120, sharey=True)
    for ax, group in zip(axes, ("all", "success"), strict=True):
        x = range(len(POSITIONS))
        for offset, key, color, label in ((-0.2, "r_hat", "tab:gray", "SPRM r_hat"),
                                          (0.2, "r_him", "tab:blue", "modulated r_him")):
            ax.bar([v + offset for v in x], [shares[f"{group}/{key}"][p] for p in POSITIONS],
                   width=0.4, color=color, label=label)
        n = int(shares[f"{group}/trajectories"]["n"])
        ax.set_title(f"{group} trajectories (n={n}, >= 3 segments)")
        ax.set_xticks(list(x), POSITIONS)
    axes[0].set_ylabel("share of |reward|")
    axes[0].legend()
    fig.tight_layout()
    save_figure(fig, png_path)


def pick_cases(rows: Sequence[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Up to ``n`` successful and ``n`` failed trajectories with the most segments (ties: the
    first in ``D_st``), successful first."""
    def top(sel: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(sel, key=lambda r: -len(r["segments"]))[:n]
    return top([r for r in rows if r["won"]]) + top([r for r in rows if not r["won"]])


def case_tables(rows: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """(Markdown, HTML): per trajectory, per segment its turns, actions, sub-goal and
    ``(r_hat, z, r_him)``."""
    md = ["# Reward case tables", ""]
    body = []
    for r in rows:
        title = (f"{r['task_id']} sample {r['sample']}: {'success' if r['won'] else 'failure'} "
                 f"(R = {r['outcome']:.2f}), {r['n_turns']} turns, {r['segmenter']} segments")
        md += [f"## {title}", "", f"Task: {r['instruction']}", "",
               "| segment | turns | actions | sub-goal | r_hat | z | r_him |",
               "|---|---|---|---|---|---|---|"]
        cells = []
        for i, s in enumerate(r["segments"]):
            acts = "; ".join(t["action"] or "(none)"
                             for t in r["turns"][s["first_turn"]:s["last_turn"] + 1])
            row = [str(i + 1), f"{s['first_turn'] + 1}-{s['last_turn'] + 1}", acts,
                   s["subgoal"] or "", f"{s['r_hat']:.3f}", f"{s['importance']:.3f}",
                   f"{s['r_him']:.3f}"]
            md.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
            cells.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
        md.append("")
        body.append(f"<h2>{html.escape(title)}</h2><p>Task: {html.escape(r['instruction'])}</p>"
                    "<table><tr><th>segment</th><th>turns</th><th>actions</th><th>sub-goal</th>"
                    "<th>r_hat</th><th>z</th><th>r_him</th></tr>" + "".join(cells) + "</table>")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>Reward case tables</title>"
            "<style>body{font-family:sans-serif;max-width:72em;margin:auto}table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:90%}</style></head>"
            "<body><h1>Reward case tables</h1>" + "".join(body) + "</body></html>\n")
    return "\n".join(md), page


def write_cases(rows: Sequence[dict[str, Any]], n: int, md_path: Path, html_path: Path) -> None:
    md, page = case_tables(pick_cases(rows, n))
    write_text(md_path, md)
    write_text(html_path, page)
