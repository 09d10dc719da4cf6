"""Check Parquet artifacts against their data contracts.

    python -m flows.validate data/expert/d_bc.parquet [--contract expert_trajectories]

Without ``--contract`` the contract is found from the file's place in the data folder. Exits
with status 2 and a message naming the file and the column when a file does not conform.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.artifacts import contract_for, describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+")
    parser.add_argument("--contract", help="contract name (default: inferred from the path)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.paths:
        try:
            print(describe(path, args.contract or contract_for(path)))
        except (ValueError, KeyError) as err:
            print(f"error: {err}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
