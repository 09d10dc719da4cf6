"""Tests of the ``alfworld`` environment on ALFWorld's game files.

Name parsing and option checks run everywhere; playing games needs the ``alfworld`` extra and
the game archives in the shared data folder next to the repository (``../shared/data/alfworld``),
and is skipped with the reason when either is missing. A session fixture unpacks 20 ``train``
and 20 ``valid_seen`` games into a temporary folder (a few seconds).
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest

from hisr_core.agent.react import parse_action
from hisr_core.envs import NOTHING_HAPPENS, environment_class, make_environment, registered
from hisr_core.envs import alfworld as alf
from hisr_core.envs.alfworld_data import unpack
from hisr_core.segment.segmenter import by_rule

SOURCE = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "alfworld"
N_GAMES = 20
MAX_TURNS = 60  # recorded episodes take 17 actions on average


def test_registered_with_task_types_and_verbs():
    assert "alfworld" in registered()
    cls = environment_class("alfworld")
    assert cls.task_types == ("PICK", "CLEAN", "HEAT", "COOL", "LOOK", "PICK2")
    for verb in ("take", "put", "open", "close", "heat", "cool", "clean", "use", "toggle"):
        assert verb in cls.state_changing_verbs
    for verb in ("go", "examine", "look", "inventory"):
        assert verb not in cls.state_changing_verbs


def test_task_type_from_folder_name():
    assert alf.task_type_of("pick_and_place_simple-Pen-None-Desk-310") == "PICK"
    assert alf.task_type_of("pick_clean_then_place_in_recep-Apple-None-Fridge-1") == "CLEAN"
    assert alf.task_type_of("pick_heat_then_place_in_recep-Egg-None-Fridge-2") == "HEAT"
    assert alf.task_type_of("pick_cool_then_place_in_recep-Pan-None-Shelf-1") == "COOL"
    assert alf.task_type_of("look_at_obj_in_light-Bowl-None-DeskLamp-301") == "LOOK"
    assert alf.task_type_of("pick_two_obj_and_place-Book-None-Sofa-201") == "PICK2"
    with pytest.raises(ValueError, match="no known ALFWorld task type"):
        alf.task_type_of("pick_and_slice-Apple-None-Table-1")


def test_observation_cleaning():
    first = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. You see "
             "a desk 1.\n\nYour task is to: put a pen in desk.")
    clean = alf.clean_observation(first, first=True)
    assert clean.startswith("You are in the middle of a room.")
    assert alf.instruction_of(clean) == "put a pen in desk"
    assert alf.clean_observation("You arrive at loc 7. On the desk 1, you see a pen 2.") == \
        "On the desk 1, you see a pen 2."


def test_rule_segmenter_cuts_after_state_changes():
    verbs = environment_class("alfworld").state_changing_verbs
    actions = ["go to desk 1", "take pen 1 from desk 1", "go to sinkbasin 1",
               "clean pen 1 with sinkbasin 1", "go to shelf 1", "put pen 1 in/on shelf 1"]
    assert [(s.first, s.last) for s in by_rule(actions, verbs)] == [(0, 1), (2, 3), (4, 5)]


def test_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown option"):
        make_environment("alfworld", max_turns=10, data_dir=str(tmp_path), colour=True)
    with pytest.raises(ValueError, match="needs env.options.data_dir"):
        make_environment("alfworld", max_turns=10)
    with pytest.raises(ValueError, match="has no json_2.1.1 folder"):
        make_environment("alfworld", max_turns=10, data_dir=str(tmp_path))
    (tmp_path / "json_2.1.1").mkdir()
    with pytest.raises(TypeError, match="show_admissible"):
        make_environment("alfworld", max_turns=10, data_dir=str(tmp_path),
                         show_admissible="yes")
    with pytest.raises(TypeError, match="oracle"):
        make_environment("alfworld", max_turns=10, data_dir=str(tmp_path), oracle="yes")


# ---- playing games ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    pytest.importorskip("alfworld", reason="needs the alfworld extra")
    if not (SOURCE / "train.tar.gz").is_file():
        pytest.skip(f"ALFWorld game archives not found in {SOURCE.resolve()}")
    dest = tmp_path_factory.mktemp("alfworld")
    counts = unpack(SOURCE, dest, ("train", "valid_seen"), limit=N_GAMES)
    assert counts == {"train": N_GAMES, "valid_seen": N_GAMES}
    return dest


@functools.cache
def _env(data_dir: Path, show_admissible: bool = False):
    return make_environment("alfworld", max_turns=MAX_TURNS, data_dir=str(data_dir),
                            show_admissible=show_admissible)


def test_make_tasks_is_deterministic_and_relocatable(data_dir):
    env = _env(data_dir)
    a, b = env.make_tasks("train", 100, 3), env.make_tasks("train", 100, 3)
    assert a == b and len(a) == N_GAMES
    assert {t.task_type for t in a} <= set(alf.TASK_TYPES)
    # The game is named relative to data_dir, so a task list moves with its data.
    assert all(t.instruction and t.spec.startswith('{"game":"json')
               and not Path(json.loads(t.spec)["game"]).is_absolute() for t in a)
    assert env.make_tasks("valid_unseen", 0, 0) == []
    with pytest.raises(ValueError, match="no ALFWorld games for split 'valid_unseen'"):
        env.make_tasks("valid_unseen", 5, 0)


@pytest.mark.slow
def test_recorded_train_episodes_are_all_won(data_dir):
    env = _env(data_dir)
    tasks = env.make_tasks("train", N_GAMES, 0)
    assert len(tasks) == N_GAMES
    for task in tasks:
        ep = env.expert_play(task)
        assert ep.won and ep.score == 1.0, task.task_id
        assert all(t.admissible for t in ep.turns), task.task_id
        first = ep.turns[0].observation
        assert first.startswith("You are in the middle of a room")
        assert f"Your task is to: {task.instruction}" in first
        for turn in ep.turns:
            assert parse_action(turn.response) == turn.action
            assert turn.response.startswith("Thought: ")
            assert not turn.observation.startswith("You arrive at loc")


@pytest.mark.slow
def test_expert_slips_are_refused_by_the_game_then_the_recording_wins(data_dir):
    from hisr_core.envs.base import MAX_SLIPS

    env = _env(data_dir, show_admissible=True)
    n_slipped = 0
    for task in env.make_tasks("train", 10, 0):
        ep = env.expert_play(task, slip_rate=0.3)
        assert ep.won and len(ep.turns) <= MAX_TURNS, task.task_id
        game = Path(data_dir) / json.loads(task.spec)["game"]
        # Slips change nothing: the other turns are the recorded actions, in order.
        assert [t.action for t in ep.turns if t.admissible] == alf.read_expert_actions(game)[1]
        slips = [k for k, t in enumerate(ep.turns) if not t.admissible]
        assert len(slips) <= MAX_SLIPS
        n_slipped += bool(slips)
        for k in slips:
            assert k > 0 and ep.turns[k + 1].admissible
            after = ep.turns[k + 1].observation
            # The game's own answer, with the same admissible commands as before the slip.
            assert after.startswith(NOTHING_HAPPENS + "\nAdmissible actions: ")
            assert after.split("\nAdmissible actions: ")[1] == \
                ep.turns[k].observation.split("\nAdmissible actions: ")[1]
            assert ep.turns[k + 1].response.startswith(
                ("Thought: That did not work.", "Thought: Nothing happened",
                 "Thought: That command did nothing"))
    assert n_slipped >= 5
    with pytest.raises(ValueError, match="slip_rate"):
        env.expert_play(task, slip_rate=1.5)


def test_valid_seen_games_load_and_step(data_dir):
    env = _env(data_dir, show_admissible=True)
    tasks = env.make_tasks("valid_seen", 3, 0)
    assert len(tasks) == 3
    for task in tasks:
        assert task.split == "valid_seen" and task.task_type in alf.TASK_TYPES
        ep = env.start(task)
        obs = ep.reset()
        adm = ep.admissible_commands()
        assert "look" in adm and any(a.startswith("go to ") for a in adm)
        assert "\nAdmissible actions: " in obs and f"Your task is to: {task.instruction}" in obs
        go = next(a for a in adm if a.startswith("go to "))
        res = ep.step(go)
        assert res.admissible and not res.won and not res.done and res.score == 0.0
        assert "\nAdmissible actions: " in res.observation
        bad = ep.step("fly to the moon")
        assert not bad.admissible and bad.observation.startswith(NOTHING_HAPPENS)
        assert ep.turns == 2
        ep.close()


def test_valid_seen_expert_follows_the_planner_and_wins(data_dir):
    env = _env(data_dir)
    for task in env.make_tasks("valid_seen", 3, 0):
        ep = env.expert_play(task)
        assert ep.won and ep.score == 1.0, task.task_id
        assert all(t.admissible for t in ep.turns) and len(ep.turns) <= MAX_TURNS
        assert ep.turns[0].response.startswith("Thought: ")


def test_oracle_distance_falls_to_zero_along_the_recorded_episode(data_dir):
    env = make_environment("alfworld", max_turns=MAX_TURNS, data_dir=str(data_dir), oracle=True)
    for task in env.make_tasks("train", 3, 0):
        ep = env.start(task)
        ep.reset()
        distances = [ep.distance_to_goal()]
        for action in alf.read_expert_actions(data_dir / json.loads(task.spec)["game"])[1]:
            distances.append(ep.step(action).distance)
        ep.close()
        # The recording searches: places without the object leave the distance as it was.
        assert distances[0] > 0 and distances[-1] == 0 and ep.won, task.task_id
        assert all(b <= a for a, b in itertools.pairwise(distances)), (task.task_id, distances)
        assert distances[-distances[0] - 1:] == list(range(distances[0], -1, -1)), distances


def test_oracle_distance_drops_by_one_along_the_planners_plan(data_dir):
    task = _env(data_dir).make_tasks("valid_seen", 1, 0)[0]
    ep = alf.AlfWorldEpisode(task, MAX_TURNS, data_dir, planner=True, oracle=True)
    ep.reset()
    assert ep.distance_to_goal() == len(ep.plan) > 0
    for k, action in enumerate(ep.plan):
        assert ep.step(action).distance == len(ep.plan) - k - 1
    assert ep.won
    ep.close()
    # Without the option the distance is unknown until the game is won.
    plain = _env(data_dir).start(task)
    plain.reset()
    assert plain.distance_to_goal() == -1
    assert [plain.step(a).distance for a in ep.plan][-2:] == [-1, 0]
    plain.close()


def test_games_step_in_worker_processes(data_dir):
    # Slow environments step in worker processes (rollout.env_workers); the workers rebuild
    # the environment from its name and options and must give what the episode gives here.
    from hisr_core.envs.workers import EnvWorkers

    env = _env(data_dir)
    task = env.make_tasks("train", 1, 0)[0]
    actions = alf.read_expert_actions(data_dir / json.loads(task.spec)["game"])[1]
    with EnvWorkers("alfworld", MAX_TURNS, {"data_dir": str(data_dir)}, 1) as workers:
        first, distance = workers.start([("a", task)])[0]
        assert f"Your task is to: {task.instruction}" in first and distance == -1
        for action in actions:
            res = workers.receive_steps(workers.send_steps([("a", action)]))["a"]
            assert res.admissible, action
        assert res.won and res.done and res.distance == 0
