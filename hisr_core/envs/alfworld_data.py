"""Unpack ALFWorld's game archives into the layout the ``alfworld`` environment reads.

The archives (``train.tar.gz``, ``valid_seen.tar.gz``, ... each holding ``<split>/<task>/
<trial>/...``) and the ``logic`` folder come from ALFWorld's generated data; this lays them
out as ``alfworld-download`` does, ``DEST/json_2.1.1/<split>/...`` and ``DEST/logic``, so that
``env.options.data_dir: DEST`` plays them::

    python -m hisr_core.envs.alfworld_data SOURCE_FOLDER data/alfworld/games
    python -m hisr_core.envs.alfworld_data SOURCE_FOLDER DEST --splits valid_seen --limit 20

Members are checked before extraction: only regular files and folders under the split's own
folder are written (an archive cannot write outside DEST).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

from hisr_core.envs.alfworld import ROOT

DEFAULT_SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_train")


def _trial(name: str) -> tuple[str, str, str] | None:
    """(split, task folder, trial folder) of an archive member, or None if it is not in one."""
    parts = Path(name).parts
    if len(parts) < 3 or any(p in ("..", "") for p in parts) or Path(name).is_absolute():
        return None
    return parts[0], parts[1], parts[2]


def unpack(source: Path, dest: Path, splits: Sequence[str] = DEFAULT_SPLITS,
           limit: int | None = None) -> dict[str, int]:
    """Unpack ``source/<split>.tar.gz`` for each split into ``dest/json_2.1.1`` and copy
    ``source/logic`` to ``dest/logic``; returns the number of games unpacked per split.

    ``limit``: keep only the first ``limit`` games of each split in archive order (small
    test or smoke-run sets). Existing files are overwritten, so a rerun repairs a partial one.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out = dest / ROOT
    counts: dict[str, int] = {}
    for split in splits:
        archive = source / f"{split}.tar.gz"
        if not archive.is_file():
            raise FileNotFoundError(f"no archive for split {split!r}: {archive}")
        kept: set[tuple[str, str]] = set()
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                where = _trial(member.name)
                if where is None or where[0] != split:
                    continue
                game = where[1:]
                if game not in kept:
                    if limit is not None and len(kept) >= limit:
                        continue
                    kept.add(game)
                if member.isfile():
                    tar.extract(member, out, filter="data")
        counts[split] = len(kept)
    logic = source / "logic"
    if logic.is_dir():
        shutil.copytree(logic, dest / "logic", dirs_exist_ok=True)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hisr_core.envs.alfworld_data",
        description="Unpack ALFWorld game archives into DEST/json_2.1.1 and DEST/logic.")
    parser.add_argument("source", type=Path,
                        help="folder with <split>.tar.gz archives and logic/")
    parser.add_argument("dest", type=Path, help="data folder (env.options.data_dir)")
    parser.add_argument("--splits", nargs="+", default=list(DEFAULT_SPLITS))
    parser.add_argument("--limit", type=int, default=None,
                        help="games per split (default: all)")
    args = parser.parse_args(argv)
    try:
        counts = unpack(args.source, args.dest, args.splits, args.limit)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, n in counts.items():
        print(f"{split}: {n} games -> {args.dest / ROOT / split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
