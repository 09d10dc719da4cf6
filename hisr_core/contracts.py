"""Data contracts: the pyarrow schema of every artifact passed between stages.

Every Parquet file the pipeline writes or reads goes through :func:`write_table` and
:func:`read_table`, which check the schema named by the caller. Writes are atomic (a temporary
file in the same folder, then ``os.replace``), so a crash never leaves a half-written artifact,
and deterministic (no pandas metadata, fixed writer options), so the same rows give the same bytes.
A truncated file, a missing, extra or mistyped column raises :class:`ContractError` naming the
file and the column; a file written before a column or field existed is also told which stage to
rerun (:data:`WRITTEN_BY`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


class ContractError(ValueError):
    """An artifact does not match its declared schema (or cannot be read at all)."""


#: One turn of an expert trajectory (later rollouts extend it with token and entropy fields).
TURN = pa.struct(
    [
        pa.field("observation", pa.string(), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("admissible", pa.bool_(), nullable=False),
    ]
)

#: One turn of a policy's episode: the expert fields plus what the rollout engine measures.
#: ``distance_before`` / ``distance_after``: the environment's oracle distance to the goal
#: (``Episode.distance_to_goal``; -1 where it cannot tell) before and after the turn, so the
#: turn's true credit is their difference (docs/method.md, "Oracle progress").
EPISODE_TURN = pa.struct(
    [
        *TURN,
        pa.field("parsed", pa.bool_(), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("response_tokens", pa.int32(), nullable=False),
        pa.field("entropy", pa.float32(), nullable=False),
        pa.field("distance_before", pa.int32(), nullable=False),
        pa.field("distance_after", pa.int32(), nullable=False),
    ]
)

#: One sub-goal segment: turns first_turn..last_turn (0-based, inclusive).
SEGMENT = pa.struct(
    [
        pa.field("first_turn", pa.int32(), nullable=False),
        pa.field("last_turn", pa.int32(), nullable=False),
        pa.field("subgoal", pa.string(), nullable=False),
    ]
)

#: Columns describing the task an episode played (shared by every trajectory table).
_TASK_COLUMNS = [
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("env", pa.string(), nullable=False),
    pa.field("split", pa.string(), nullable=False),
    pa.field("task_type", pa.string(), nullable=False),
    pa.field("instruction", pa.string(), nullable=False),
]

_EPISODE_COLUMNS = [
    *_TASK_COLUMNS,
    pa.field("sample", pa.int32(), nullable=False),
    pa.field("policy", pa.string(), nullable=False),
    pa.field("turns", pa.list_(pa.field("item", EPISODE_TURN, nullable=False)), nullable=False),
    pa.field("n_turns", pa.int32(), nullable=False),
    pa.field("won", pa.bool_(), nullable=False),
    pa.field("score", pa.float64(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("final_observation", pa.string(), nullable=False),
]

#: A segment with its rewards (the paper's Table 2 columns): the SPRM's ``r_hat``, the
#: normalised hindsight importance ``z`` and the modulated ``r_him``.
SCORED_SEGMENT = pa.struct(
    [
        *SEGMENT,
        pa.field("r_hat", pa.float64(), nullable=False),
        pa.field("importance", pa.float64(), nullable=False),
        pa.field("r_him", pa.float64(), nullable=False),
    ]
)

#: Per-turn scores: the hindsight log-ratio, the normalised turn importance, the grounding bit,
#: the turn SPRM's reward (NaN without a turn model) and the true credit (the drop of the
#: environment's oracle distance to the goal over the turn; docs/method.md, "Credit accuracy").
SCORED_TURN = pa.struct(
    [
        pa.field("action", pa.string(), nullable=False),
        pa.field("admissible", pa.bool_(), nullable=False),
        pa.field("log_ratio", pa.float64(), nullable=False),
        pa.field("importance", pa.float64(), nullable=False),
        pa.field("r_turn", pa.float64(), nullable=False),
        pa.field("true_credit", pa.float64(), nullable=False),
    ]
)

#: One variant's reward per turn, placed on the turn's last response token.
VARIANT_REWARDS = pa.struct(
    [
        pa.field("variant", pa.string(), nullable=False),
        pa.field("turn_rewards", pa.list_(pa.field("item", pa.float64(), nullable=False)),
                 nullable=False),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    # One row per task of a split; ``spec`` rebuilds the episode (see hisr_core.envs.Task).
    "tasks": pa.schema(
        [
            *_TASK_COLUMNS,
            pa.field("seed", pa.int64(), nullable=False),
            pa.field("spec", pa.string(), nullable=False),
        ]
    ),
    # D_bc: one row per successful expert episode, turns in order.
    "expert_trajectories": pa.schema(
        [
            *_TASK_COLUMNS,
            pa.field("turns", pa.list_(pa.field("item", TURN, nullable=False)), nullable=False),
            pa.field("n_turns", pa.int32(), nullable=False),
            pa.field("won", pa.bool_(), nullable=False),
            pa.field("score", pa.float64(), nullable=False),
            pa.field("final_observation", pa.string(), nullable=False),
        ]
    ),
    # A policy's episodes (evaluation): one row per episode. ``truncated``: ended by the
    # turn limit without a win.
    "episodes": pa.schema(_EPISODE_COLUMNS),
    # The N rollouts (D_ct, and the dropped ones beside it): episodes plus the outcome R
    # (the environment's score in [0, 1]) and why the episode was dropped ("" if kept).
    "rollouts": pa.schema(
        [
            *_EPISODE_COLUMNS,
            pa.field("outcome", pa.float64(), nullable=False),
            pa.field("drop_reason", pa.string(), nullable=False),
        ]
    ),
    # D_st: the kept rollouts with their sub-goal segments (turn indices from 0, inclusive),
    # the segmenter that made them, and whether it fell back to ``turn`` (and why).
    "segmented": pa.schema(
        [
            *_EPISODE_COLUMNS,
            pa.field("outcome", pa.float64(), nullable=False),
            pa.field("segmenter", pa.string(), nullable=False),
            pa.field("segments", pa.list_(pa.field("item", SEGMENT, nullable=False)),
                     nullable=False),
            pa.field("fallback", pa.bool_(), nullable=False),
            pa.field("fallback_reason", pa.string(), nullable=False),
        ]
    ),
    # The rewards of D_st (docs/method.md stages 6-7), one row per trajectory: its segments with
    # (r_hat, z, r_him), its turns' hindsight scores, and each variant's per-turn rewards.
    "rewards": pa.schema(
        [
            *_TASK_COLUMNS,
            pa.field("sample", pa.int32(), nullable=False),
            pa.field("n_turns", pa.int32(), nullable=False),
            pa.field("won", pa.bool_(), nullable=False),
            pa.field("outcome", pa.float64(), nullable=False),
            pa.field("segmenter", pa.string(), nullable=False),
            pa.field("segments", pa.list_(pa.field("item", SCORED_SEGMENT, nullable=False)),
                     nullable=False),
            pa.field("turns", pa.list_(pa.field("item", SCORED_TURN, nullable=False)),
                     nullable=False),
            pa.field("variants", pa.list_(pa.field("item", VARIANT_REWARDS, nullable=False)),
                     nullable=False),
        ]
    ),
}


#: The pipeline stage that writes each contract's files: one that lacks a column or field the
#: contract has since gained is remade by rerunning it.
WRITTEN_BY: dict[str, str] = {
    "tasks": "expert",
    "expert_trajectories": "expert",
    "episodes": "evaluate_sft or evaluate",
    "rollouts": "collect",
    "segmented": "segment, after collect",
    "rewards": "rewards",
}


def schema(name: str) -> pa.Schema:
    try:
        return SCHEMAS[name]
    except KeyError:
        raise KeyError(f"no data contract named {name!r}; known: {sorted(SCHEMAS)}") from None


def check_schema(actual: pa.Schema, name: str, source: str | Path) -> None:
    """Raise :class:`ContractError` unless ``actual`` has exactly the columns of contract ``name``."""
    expected = schema(name)
    problems = []
    missing = False
    for field in expected:
        idx = actual.get_field_index(field.name)
        if idx < 0:
            problems.append(f"missing column {field.name!r} (expected {field.type})")
            missing = True
            continue
        found = actual.field(idx).type
        if found.equals(field.type, check_metadata=False):
            continue
        lacking = missing_fields(found, field.type, field.name)
        if lacking:
            problems += [f"column {field.name!r} lacks field {path!r} (expected {typ})"
                         for path, typ in lacking]
            missing = True
        else:
            problems.append(f"column {field.name!r} has type {found}, expected {field.type}")
    for field in actual:
        if expected.get_field_index(field.name) < 0:
            problems.append(f"unexpected column {field.name!r}")
    if problems:
        hint = (f"; the file predates the contract: rerun the stage that writes it "
                f"({WRITTEN_BY.get(name, 'unknown')})" if missing else "")
        raise ContractError(f"{source}: does not match contract {name!r}: "
                            + "; ".join(problems) + hint)


def missing_fields(actual: pa.DataType, expected: pa.DataType,
                   path: str) -> list[tuple[str, pa.DataType]]:
    """The struct fields ``expected`` has and ``actual`` lacks, looking through lists, as
    (dotted path from ``path``, expected type): ``[("turns.distance_after", int32)]``."""
    if pa.types.is_list(expected) and pa.types.is_list(actual):
        return missing_fields(actual.value_type, expected.value_type, path)
    if not (pa.types.is_struct(expected) and pa.types.is_struct(actual)):
        return []
    out = []
    for field in expected:
        idx = actual.get_field_index(field.name)
        if idx < 0:
            out.append((f"{path}.{field.name}", field.type))
        else:
            out += missing_fields(actual.field(idx).type, field.type, f"{path}.{field.name}")
    return out


def _first_gap(value: Any, typ: pa.DataType) -> str | None:
    """Where in ``value`` (a list or dict of type ``typ``) the first non-nullable struct field
    is absent or null (``[3].distance_after``); None if nowhere. ``pa.Table.from_pylist`` would
    fill it with a null that the column's nullability does not stop."""
    if pa.types.is_list(typ) and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            gap = _first_gap(item, typ.value_type)
            if gap is not None:
                return f"[{i}]{gap}"
    elif pa.types.is_struct(typ) and isinstance(value, Mapping):
        for field in typ:
            item = value.get(field.name)
            if item is None:
                if not field.nullable:
                    return f".{field.name}"
                continue
            gap = _first_gap(item, field.type)
            if gap is not None:
                return f".{field.name}{gap}"
    return None


def to_table(rows: Iterable[Mapping[str, Any]], name: str, source: str = "rows") -> pa.Table:
    """Rows (dicts) → a table of contract ``name``; a missing or mistyped value names the column."""
    sch = schema(name)
    rows = list(rows)
    nested = [f for f in sch if pa.types.is_list(f.type) or pa.types.is_struct(f.type)]
    for i, row in enumerate(rows):
        for field in sch:
            if field.name not in row:
                raise ContractError(f"{source}: row {i} lacks column {field.name!r}")
            if row[field.name] is None and not field.nullable:
                raise ContractError(f"{source}: row {i}, column {field.name!r} is null")
        for field in nested:
            gap = _first_gap(row[field.name], field.type)
            if gap is not None:
                raise ContractError(f"{source}: row {i}, column {field.name!r}: "
                                    f"{field.name}{gap} is missing or null")
    try:
        return pa.Table.from_pylist(rows, schema=sch)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        for field in sch:
            try:
                pa.array([row[field.name] for row in rows], type=field.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as col_err:
                raise ContractError(
                    f"{source}: column {field.name!r}: values do not fit {field.type} ({col_err})"
                ) from err
        raise ContractError(f"{source}: rows do not fit contract {name!r}: {err}") from err


def write_table(table: pa.Table, path: str | Path, name: str) -> Path:
    """Check ``table`` against contract ``name`` and write it to ``path`` atomically."""
    path = Path(path)
    check_schema(table.schema, name, path)
    null_cols = [f.name for f in schema(name) if not f.nullable and table.column(f.name).null_count]
    if null_cols:
        raise ContractError(f"{path}: null values in non-nullable column {null_cols[0]!r}")
    # Cast so nullability and field order are the contract's, whatever built the table.
    table = table.select(schema(name).names).cast(schema(name))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(
            table.replace_schema_metadata(None),
            tmp,
            compression="zstd",
            write_statistics=True,
            store_schema=True,
        )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_rows(rows: Iterable[Mapping[str, Any]], path: str | Path, name: str) -> Path:
    return write_table(to_table(rows, name, str(path)), path, name)


def read_table(path: str | Path, name: str) -> pa.Table:
    """Read ``path`` and check it against contract ``name``."""
    path = Path(path)
    if not path.is_file():
        raise ContractError(f"{path}: no such file (expected a {name!r} table)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ContractError(f"{path}: not a readable Parquet file ({err})") from None
    check_schema(table.schema, name, path)
    return table.select(schema(name).names)


def read_rows(path: str | Path, name: str) -> list[dict[str, Any]]:
    return read_table(path, name).to_pylist()


def write_json(data: Mapping[str, Any], path: str | Path) -> Path:
    """Write JSON atomically (DVC metrics files, reports, caches)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
