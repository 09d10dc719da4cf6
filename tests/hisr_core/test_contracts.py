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


def episode_row(**over):
    turn = {"observation": "o", "response": "Thought: t\nAction: look", "action": "look",
            "admissible": True, "parsed": True, "prompt_tokens": 10, "response_tokens": 4,
            "entropy": 0.5, "distance_before": 3, "distance_after": 3}
    row = {**traj_row(turns=[turn, {**turn, "distance_before": 3, "distance_after": 2}]),
           "sample": 0, "policy": "pi_ref", "truncated": False, "outcome": 1.0,
           "drop_reason": ""}
    row.update(over)
    return row


def _without_distances(name):
    """Contract ``name`` as it was before turns carried the oracle distance."""
    keep = [f for f in contracts.EPISODE_TURN if not f.name.startswith("distance_")]
    turns = pa.list_(pa.field("item", pa.struct(keep), nullable=False))
    return pa.schema([pa.field(f.name, turns, nullable=False) if f.name == "turns" else f
                      for f in contracts.schema(name)])


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


@pytest.mark.parametrize(("name", "stage"), [("rollouts", "collect"),
                                             ("episodes", "evaluate_sft or evaluate"),
                                             ("segmented", "segment, after collect")])
def test_old_file_without_turn_distances_names_the_field_and_the_stage(tmp_path, name, stage):
    old = _without_distances(name)
    row = {**episode_row(), "segmenter": "turn", "segments": [], "fallback": False,
           "fallback_reason": ""}
    row["turns"] = [{k: v for k, v in t.items() if not k.startswith("distance_")}
                    for t in row["turns"]]
    path = tmp_path / "old.parquet"
    pq.write_table(pa.Table.from_pylist([{f.name: row[f.name] for f in old}], schema=old), path)
    with pytest.raises(ContractError) as err:
        contracts.read_table(path, name)
    message = str(err.value)
    assert "column 'turns' lacks field 'turns.distance_before' (expected int32)" in message
    assert "lacks field 'turns.distance_after'" in message
    assert message.endswith(f"rerun the stage that writes it ({stage})")


def test_episode_turns_round_trip_and_a_turn_without_distance_is_refused(tmp_path):
    path = contracts.write_rows([episode_row()], tmp_path / "r.parquet", "rollouts")
    assert contracts.read_rows(path, "rollouts") == [episode_row()]
    row = episode_row()
    del row["turns"][1]["distance_after"]
    with pytest.raises(ContractError, match=r"row 0, column 'turns': "
                       r"turns\[1\]\.distance_after is missing or null"):
        contracts.write_rows([row], tmp_path / "bad.parquet", "rollouts")
    with pytest.raises(ContractError, match=r"turns\[0\]\.distance_before is missing or null"):
        contracts.to_table([episode_row(turns=[{**row["turns"][0], "distance_before": None}])],
                           "episodes")
