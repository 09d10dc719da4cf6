"""Where each artifact lives in the data folder, and which contract it follows."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from hisr_core import contracts

#: Glob (relative to the data folder, any depth prefix allowed) → contract name.
LOCATIONS: dict[str, str] = {
    "tasks/*.parquet": "tasks",
    "expert/d_bc.parquet": "expert_trajectories",
    "collect/d_ct.parquet": "rollouts",
    "collect/dropped.parquet": "rollouts",
    "segment/d_st.parquet": "segmented",
    "rewards/rewards.parquet": "rewards",
}


def contract_for(path: Path) -> str:
    posix = path.as_posix()
    for pattern, name in LOCATIONS.items():
        if fnmatch.fnmatch(posix, f"*{pattern}") or fnmatch.fnmatch(posix, pattern):
            return name
    raise ValueError(f"{path}: no known contract for this location; pass --contract "
                     f"(one of {sorted(contracts.SCHEMAS)})")


def describe(path: Path, contract: str) -> str:
    table = contracts.read_table(path, contract)
    return f"{path}: ok ({contract}, {table.num_rows} rows, {table.num_columns} columns)"
