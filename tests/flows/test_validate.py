"""``python -m flows.validate``: corrupted or mismatched Parquet inputs fail with a clear message."""

from __future__ import annotations

import pyarrow.parquet as pq

from hisr_core import contracts


def _tasks_file(path):
    row = {"task_id": "household/train/00000", "env": "household", "split": "train",
           "task_type": "PICK", "instruction": "put a mug in shelf", "seed": 1, "spec": "{}"}
    return contracts.write_rows([row], path, "tasks")


def test_valid_file_passes(run_module, tmp_path):
    path = _tasks_file(tmp_path / "data" / "tasks" / "train.parquet")
    proc = run_module("flows.validate", str(path))
    assert proc.returncode == 0 and "ok (tasks, 1 rows" in proc.stdout


def test_truncated_file_fails_naming_file(run_module, tmp_path):
    path = _tasks_file(tmp_path / "data" / "tasks" / "train.parquet")
    path.write_bytes(path.read_bytes()[:-40])
    proc = run_module("flows.validate", str(path))
    assert proc.returncode == 2
    assert f"{path}: not a readable Parquet file" in proc.stderr


def test_mismatched_columns_fail_naming_column(run_module, tmp_path):
    path = tmp_path / "data" / "expert" / "d_bc.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(contracts.read_table(_tasks_file(tmp_path / "t.parquet"), "tasks"), path)
    proc = run_module("flows.validate", str(path))
    assert proc.returncode == 2
    assert "d_bc.parquet: does not match contract 'expert_trajectories'" in proc.stderr
    assert "missing column 'turns'" in proc.stderr


def test_unknown_location_asks_for_contract(run_module, tmp_path):
    path = _tasks_file(tmp_path / "elsewhere.parquet")
    proc = run_module("flows.validate", str(path))
    assert proc.returncode == 2 and "pass --contract" in proc.stderr
    assert run_module("flows.validate", str(path), "--contract", "tasks").returncode == 0
