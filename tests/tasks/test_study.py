"""The powered study in pieces (tasks/study.py, scripts/study.py): which pieces exist, when one
is done, which seeds a machine may add to, what fits in a time budget; the per-task outcomes
file every evaluation leaves for git; and the report reading a study's committed files only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hisr_core import contracts
from hisr_core.config import load_params, parse_params
from tasks.evaluate import OUTCOMES_FILE, read_outcomes, write_outcomes
from tasks.report import comparison_rows, gather
from tasks.study import (
    fit,
    own_pieces,
    pieces,
    record_seed,
    runnable,
    to_split,
    upstream_fingerprint,
)
from tests.household_data import rollout_rows

ROOT = Path(__file__).resolve().parents[2]


def _params(variants=("ppo", "hisr"), seeds=(0, 1)):
    return parse_params({"sweep": {"variants": list(variants), "seeds": list(seeds)}})


def test_study_profile_changes_no_key_the_upstream_stages_read():
    # The study reads the default pipeline's folders: the profile may not change their keys.
    study, default = load_params(ROOT / "profiles/study.yaml"), load_params(ROOT / "params.yaml")
    for section in ("env", "expert", "model", "sft", "rollout", "evaluate", "collect", "segment",
                    "sprm", "hindsight", "rewards"):
        assert getattr(study, section) == getattr(default, section), section
    assert study.ppo.iterations == 60 and study.sweep.seeds == [0, 1, 2]
    assert study.sweep.variants == ["ppo", "grpo", "no_both", "hisr"]


def test_pieces_run_seed_by_seed_in_protocol_order():
    names = [p.name for p in pieces(_params())]
    assert names == ["sft@0", "start_curve@0", "ppo@ppo-0", "evaluate@ppo-0", "ppo@hisr-0",
                     "evaluate@hisr-0", "sft@1", "start_curve@1", "ppo@ppo-1", "evaluate@ppo-1",
                     "ppo@hisr-1", "evaluate@hisr-1"]
    ev = pieces(_params())[3]
    assert ev.files == ("eval/ppo/seed0/metrics.json", "eval/ppo/seed0/outcomes.csv")


def test_a_piece_is_done_when_all_its_files_exist(tmp_path):
    run = pieces(_params())[2]
    (tmp_path / "ppo/ppo/seed0").mkdir(parents=True)
    (tmp_path / "ppo/ppo/seed0/metrics.json").write_text("{}")
    assert not run.done(tmp_path)  # no curve yet
    (tmp_path / "ppo/ppo/seed0/curve.csv").write_text("iteration\n")
    assert run.done(tmp_path)


def test_seeds_started_on_another_upstream_are_left_out(tmp_path):
    todo = pieces(_params())
    record_seed(tmp_path, 0, {"upstream": "aaaa", "cpu": "AMD EPYC", "decode": "sdpa"})
    record_seed(tmp_path, 0, {"upstream": "bbbb"})  # written once: the first piece's
    assert json.loads((tmp_path / "seed0.json").read_text())["upstream"] == "aaaa"
    ready, why = runnable(todo, tmp_path, "bbbb")
    assert {p.seed for p in ready} == {1}
    assert len(why) == 1 and "seed 0 was started on upstream aaaa (cpu AMD EPYC, decode sdpa)" \
        in why[0] and "HISR_DECODE_KERNEL=0" in why[0]
    ready, why = runnable(todo, tmp_path, "aaaa")
    assert len(ready) == len(todo) and why == []


def test_a_started_seeds_pieces_are_its_upstreams_own(tmp_path):
    # Seed 0 started on aaaa with its sft evaluation in; seed 1 started on bbbb; seed 2 on aaaa
    # but its sft evaluation is missing (it needs evaluate_sft, so dvc repro).
    todo = pieces(_params(seeds=(0, 1, 2)))
    for seed, upstream in ((0, "aaaa"), (1, "bbbb"), (2, "aaaa")):
        record_seed(tmp_path, seed, {"upstream": upstream})
    for seed in (0, 1):
        for f in todo[6 * seed].files:  # the seed's sft piece
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / f).write_text("x")
    own = own_pieces(todo, tmp_path, "aaaa")
    assert [p.name for p in own] == ["start_curve@0", "ppo@ppo-0", "evaluate@ppo-0",
                                     "ppo@hisr-0", "evaluate@hisr-0"]
    assert own_pieces(todo, tmp_path, "cccc") == []


def test_fit_keeps_a_ppo_run_with_its_evaluation():
    todo = pieces(_params())  # sft 1, start curve 12, ppo 45 + eval 5, hisr 60 + eval 5
    assert [p.name for p in fit(todo, 62)] == ["sft@0", "start_curve@0"]
    assert [p.name for p in fit(todo, 63)] == ["sft@0", "start_curve@0", "ppo@ppo-0",
                                               "evaluate@ppo-0"]
    assert len(fit(todo, 127)) == 4 and len(fit(todo, 128)) == 6 and fit(todo, 0.5) == []
    assert len(fit(todo, 63, slower=2.0)) == 2  # 2 + 24 + 100 minutes on a machine half as fast


def test_a_resumed_run_is_planned_for_what_is_left_of_it():
    todo = pieces(_params())  # sft 1, start curve 12, ppo 45 + eval 5, hisr 60 + eval 5
    assert [p.name for p in fit(todo, 40)] == ["sft@0", "start_curve@0"]
    # Two thirds of ppo@ppo-0's iterations are behind it: 15 + 5 minutes are left.
    done = {"ppo@ppo-0": 2 / 3}
    assert todo[2].minutes(2.0, 2 / 3) == pytest.approx(30.0)
    assert [p.name for p in fit(todo, 33, done=done)] == ["sft@0", "start_curve@0",
                                                          "ppo@ppo-0", "evaluate@ppo-0"]


def test_a_run_longer_than_what_is_left_is_split_when_enough_time_is_left():
    todo = pieces(_params())
    plan = fit(todo, 40)  # sft and the start curve (13 minutes); ppo@ppo-0 needs 50
    assert to_split(todo, plan, 40) is todo[2]  # 40 - 13 - its evaluation's 5 = 22 >= 20
    assert to_split(todo, plan, 37) is None  # 19 minutes would be left for it
    assert to_split(todo, plan, 40, least=25) is None
    assert to_split(todo, fit(todo, 1), 1) is None  # the next piece is not a PPO run
    assert to_split(todo, fit(todo, 500), 500) is None  # nothing is left to split


def test_the_runner_stops_a_piece_with_sigterm_when_its_time_is_up(tmp_path):
    # The real signal path of scripts/study.py's run(), with a child that, like a PPO run,
    # finishes its step and writes a checkpoint on SIGTERM.
    import importlib.util
    import sys
    import time

    spec = importlib.util.spec_from_file_location("study_script", ROOT / "scripts/study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    mark = tmp_path / "checkpoint"
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('ok'),"
             " sys.exit(143)))\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")
    t0 = time.monotonic()
    assert study.run([sys.executable, "-c", child, str(mark)], until=t0 + 5.0) is False
    assert mark.read_text() == "ok" and time.monotonic() - t0 < 30
    assert study.run([sys.executable, "-c", "pass"], until=time.monotonic() + 30) is True
    with pytest.raises(Exception, match="returned non-zero exit status 3"):
        study.run([sys.executable, "-c", "raise SystemExit(3)"])


def test_upstream_fingerprint_follows_the_models_bytes(tmp_path):
    with pytest.raises(FileNotFoundError, match="dvc repro rewards"):
        upstream_fingerprint(tmp_path)
    for rel in ("sft/pi_ref", "sprm/model", "sprm/turn_model", "hindsight/pi_hind"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "model.safetensors").write_bytes(b"w")
    first = upstream_fingerprint(tmp_path)
    assert first == upstream_fingerprint(tmp_path) and len(first) == 16
    (tmp_path / "sft/pi_ref/model.safetensors").write_bytes(b"v")
    assert upstream_fingerprint(tmp_path) != first


def test_outcomes_file_round_trip(tmp_path):
    fields = contracts.schema("episodes").names
    split = {"valid_seen": rollout_rows(3, "valid_seen"), "valid_unseen": rollout_rows(4)}
    paths = []
    for name, rows in split.items():
        episodes = [{k: r[k] for k in fields if k in r} for r in rows]
        paths.append(contracts.write_rows(episodes, tmp_path / f"{name}.parquet", "episodes"))
    write_outcomes(paths, tmp_path / OUTCOMES_FILE)
    back = read_outcomes(tmp_path / OUTCOMES_FILE)
    assert back == {name: {r["task_id"]: float(r["won"]) for r in rows}
                    for name, rows in split.items()}
    assert sorted(back["valid_unseen"].values()) == [0.0, 0.0, 1.0, 1.0]  # both outcomes
    (tmp_path / "bad.csv").write_text("split,task_id\nvalid_seen,t\n")
    with pytest.raises(ValueError, match="no column 'n_turns'"):
        read_outcomes(tmp_path / "bad.csv")


def test_report_pairs_each_seed_with_its_own_sft_from_committed_files(tmp_path):
    params = _params(variants=("ppo",), seeds=(0, 1))
    for name, won in (("sft/seed0", "1,0"), ("sft/seed1", "0,0"), ("ppo/seed0", "1,1")):
        folder = tmp_path / "eval" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"eval": {}}))
        a, b = won.split(",")
        (folder / OUTCOMES_FILE).write_text("split,task_id,won,score,n_turns\n"
                                            f"valid_unseen,t1,{a},1,3\nvalid_unseen,t2,{b},0,4\n")
    (tmp_path / "ppo/sft/seed0").mkdir(parents=True)  # a start curve, not a policy's curve
    (tmp_path / "ppo/sft/seed0/curve.csv").write_text("iteration,rollout_success\n1,0.5\n")
    found = gather(params, tmp_path)
    assert found.outcomes["sft"]["valid_unseen"] == {0: {"t1": 1.0, "t2": 0.0},
                                                     1: {"t1": 0.0, "t2": 0.0}}
    assert found.outcomes["ppo"]["valid_unseen"] == {0: {"t1": 1.0, "t2": 1.0}}
    assert "sft" not in found.curves and found.starts[0][0]["rollout_success"] == 0.5
    assert found.missing == ["evaluate ppo/seed1"]
    # ppo seed 0 against sft seed 0 only (50 points); against both sft seeds it would be 75.
    _, _, diffs = comparison_rows(found.outcomes, "valid_unseen")
    assert diffs["ppo", "sft"][0] == pytest.approx(0.5) and diffs["ppo", "sft"][3] == [0]
