import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hisr_core import contracts
from hisr_core.contracts import ContractError


def task_row(i=0, **over):
    row = {"task_id": f"household/train/{i:05d}", "env": "household", "split": "train",
           "task_type": "PICK", "instruction": "put a mug in shelf", "seed": 7 + i, "spec": "{}"}
    row.update(over)
    return row


def traj_row(**over):
    turn = {"observation": "o", "response": "Thought: t\nAction: look", "action": "look",
            "admissible": True}
    row = {"task_id": "household/train/00000", "env": "household", "split": "train",
           "task_type": "PICK", "instruction": "put a mug in shelf", "turns": [turn, turn],
           "n_turns": 2, "won": True, "score": 1.0, "final_observation": "done"}
    row.update(over)
    return row


def test_round_trip(tmp_path):
    path = contracts.write_rows([task_row(0), task_row(1)], tmp_path / "t.parquet", "tasks")
    assert contracts.read_rows(path, "tasks") == [task_row(0), task_row(1)]
    path = contracts.write_rows([traj_row()], tmp_path / "d.parquet", "expert_trajectories")
    assert contracts.read_rows(path, "expert_trajectories") == [traj_row()]


def test_same_rows_same_bytes(tmp_path):
    a = contracts.write_rows([traj_row()], tmp_path / "a.parquet", "expert_trajectories")
    b = contracts.write_rows([traj_row()], tmp_path / "b.parquet", "expert_trajectories")
    assert a.read_bytes() == b.read_bytes()


def test_missing_column_on_write_names_it(tmp_path):
    row = task_row()
    del row["spec"]
    with pytest.raises(ContractError, match=r"t\.parquet: row 0 lacks column 'spec'"):
        contracts.write_rows([row], tmp_path / "t.parquet", "tasks")
    assert not list(tmp_path.iterdir()), "nothing may be written"


def test_mistyped_value_on_write_names_it(tmp_path):
    with pytest.raises(ContractError, match=r"column 'seed'"):
        contracts.write_rows([task_row(seed="seven")], tmp_path / "t.parquet", "tasks")
    with pytest.raises(ContractError, match=r"column 'instruction' is null"):
        contracts.write_rows([task_row(instruction=None)], tmp_path / "t.parquet", "tasks")
    table = contracts.to_table([task_row()], "tasks")
    nulls = table.set_column(table.schema.get_field_index("spec"), "spec",
                             pa.array([None], pa.string()))
    with pytest.raises(ContractError, match=r"null values in non-nullable column 'spec'"):
        contracts.write_table(nulls, tmp_path / "t.parquet", "tasks")
    assert not list(tmp_path.iterdir())


def test_truncated_file_names_file(tmp_path):
    path = contracts.write_rows([task_row()], tmp_path / "t.parquet", "tasks")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ContractError, match=r"t\.parquet: not a readable Parquet file"):
        contracts.read_table(path, "tasks")


def test_missing_and_mistyped_columns_on_read(tmp_path):
    table = contracts.to_table([task_row()], "tasks")
    pq.write_table(table.drop_columns(["instruction"]), tmp_path / "a.parquet")
    with pytest.raises(ContractError, match=r"a\.parquet: .*missing column 'instruction'"):
        contracts.read_table(tmp_path / "a.parquet", "tasks")
    wrong = table.set_column(table.schema.get_field_index("seed"), "seed",
                             pa.array(["7"], pa.string()))
    pq.write_table(wrong, tmp_path / "b.parquet")
    with pytest.raises(ContractError, match=r"b\.parquet: .*column 'seed' has type string"):
        contracts.read_table(tmp_path / "b.parquet", "tasks")
    pq.write_table(table.append_column("extra", pa.array([1])), tmp_path / "c.parquet")
    with pytest.raises(ContractError, match=r"unexpected column 'extra'"):
        contracts.read_table(tmp_path / "c.parquet", "tasks")


def test_wrong_contract_and_missing_file(tmp_path):
    path = contracts.write_rows([task_row()], tmp_path / "t.parquet", "tasks")
    with pytest.raises(ContractError, match=r"contract 'expert_trajectories'.*missing column 'turns'"):
        contracts.read_table(path, "expert_trajectories")
    with pytest.raises(ContractError, match="no such file"):
        contracts.read_table(tmp_path / "nope.parquet", "tasks")
    with pytest.raises(KeyError, match="no data contract named 'nope'"):
        contracts.schema("nope")


def test_failed_write_keeps_previous_file(tmp_path, monkeypatch):
    path = contracts.write_rows([task_row(0)], tmp_path / "t.parquet", "tasks")
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(contracts.pq, "write_table", boom)
    with pytest.raises(OSError):
        contracts.write_rows([task_row(1)], path, "tasks")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"], "no temporary file left"
