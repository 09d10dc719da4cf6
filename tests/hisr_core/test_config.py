from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from hisr_core.config import (
    BASE_KEY,
    Params,
    ParamsError,
    load_params,
    merge_params,
    parse_params,
    section_dict,
)

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))


def test_defaults_are_the_project_params_file():
    # One source of defaults: a params file that leaves a key out gets the pipeline's value.
    assert parse_params({}) == load_params(ROOT / "params.yaml")


def test_profiles_are_found():
    assert {p.name for p in PROFILES} >= {"alfworld.yaml", "virtualhome.yaml"}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profile_is_an_overlay_of_params_yaml_that_validates(profile):
    chain = [profile.resolve()]  # an overlay of params.yaml, or of a profile that is one
    while chain[-1] != ROOT / "params.yaml" and len(chain) < 4:
        raw = yaml.safe_load(chain[-1].read_text())
        chain.append((chain[-1].parent / raw[BASE_KEY]).resolve())
    assert chain[-1] == ROOT / "params.yaml", chain
    assert all(p.parent == ROOT / "profiles" for p in chain[:-1]), chain
    params = load_params(profile)
    assert isinstance(params, Params) and params != load_params(ROOT / "params.yaml")


def _repeats(overlay: dict, under: dict, model: type[BaseModel] = Params, at: str = ""):
    """Keys of ``overlay`` whose value equals ``under``'s (nested blocks of settings walked,
    as :func:`merge_params` merges them)."""
    for key, value in overlay.items():
        ann = model.model_fields[key].annotation
        if isinstance(value, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _repeats(value, under[key], ann, f"{at}{key}.")
        elif value == under[key]:
            yield f"{at}{key}"


def test_repeats_are_found_at_any_depth():
    under = section_dict(parse_params({}))
    overlay = {"env": {"name": "alfworld", "max_turns": 40},
               "model": {"lora": {"r": 8, "alpha": 4}}, "evaluate": {"splits": ["valid_seen"]}}
    assert list(_repeats(overlay, under)) == ["env.max_turns", "model.lora.r"]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_profile_lists_only_keys_it_changes(profile):
    raw = yaml.safe_load(profile.read_text())
    base = section_dict(load_params(profile.parent / raw.pop(BASE_KEY)))
    assert list(_repeats(raw, base)) == [], f"{profile.name} repeats its base's values"


def test_virtualhome_profile_is_valid_and_keeps_its_outputs_apart():
    p = load_params(ROOT / "profiles/virtualhome.yaml")
    assert p.env.name == "virtualhome" and p.expert.slip_rate == 0.0
    assert p.tracking.mlflow_uri == "sqlite:///data/virtualhome/mlflow/mlflow.db"
    assert p.segment.llm.cache_dir.startswith("data/virtualhome/")


def test_alfworld_profile_is_valid_and_keeps_its_outputs_apart():
    p = load_params(ROOT / "profiles/alfworld.yaml")
    assert p.env.name == "alfworld"
    assert p.env.options == {"data_dir": "data/alfworld/games", "show_admissible": True}
    assert p.tracking.mlflow_uri == "sqlite:///data/alfworld/mlflow/mlflow.db"
    assert p.segment.llm.cache_dir.startswith("data/alfworld/")


def test_unknown_key_names_it_and_suggests_nearest():
    with pytest.raises(ParamsError) as e:
        parse_params({"expert": {"n_trian": 5}})
    msg = str(e.value)
    assert "unknown key 'expert.n_trian'" in msg
    assert "did you mean 'expert.n_train'" in msg


def test_unknown_section_suggests_nearest():
    with pytest.raises(ParamsError, match=r"unknown key 'exprt'.*did you mean 'expert'"):
        parse_params({"exprt": {}})


def test_negative_count_names_key():
    with pytest.raises(ParamsError, match=r"expert\.n_train: .*greater than or equal to 1"):
        parse_params({"expert": {"n_train": -3}})


def test_wrong_type_names_key():
    with pytest.raises(ParamsError, match=r"env\.max_turns: .*integer.*'forty'"):
        parse_params({"env": {"max_turns": "forty"}})


def test_hindsight_lora_with_frozen_weights_is_refused():
    with pytest.raises(ParamsError, match=r"hindsight.*lora.*lr > 0"):
        parse_params({"hindsight": {"reads": "block", "lr": 0.0, "lora": {"enabled": True}}})
    assert parse_params({"hindsight": {"lr": 0.0}}).hindsight.lr == 0.0


@pytest.mark.parametrize("change", [{"lr": 1e-3}, {"gate_lr": 0.1}, {"reader_rank": 4},
                                    {"lr": 1e-3, "lora": {"enabled": True}}])
def test_reading_the_episode_refuses_what_would_train_beside_the_copy_head(change):
    with pytest.raises(ParamsError, match=r"reads: episode.*set " + next(iter(change))):
        parse_params({"hindsight": change})
    assert parse_params({"hindsight": {"reads": "block", **change}}).hindsight.reads == "block"
    with pytest.raises(ParamsError, match="pointer_rank > 0"):
        parse_params({"hindsight": {"pointer_rank": 0}})


def test_several_errors_reported_together():
    with pytest.raises(ParamsError) as e:
        parse_params({"env": {"max_turns": 0}, "expert": {"seed": -1}})
    assert "env.max_turns" in str(e.value) and "expert.seed" in str(e.value)


def test_not_a_mapping_and_bad_yaml(tmp_path):
    with pytest.raises(ParamsError, match="expected a mapping"):
        parse_params([1, 2])
    bad = tmp_path / "p.yaml"
    bad.write_text("env: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(bad)
    with pytest.raises(ParamsError, match="cannot read"):
        load_params(tmp_path / "missing.yaml")


def test_tracking_uri_rejects_credentials():
    with pytest.raises(ParamsError, match="tracking.mlflow_uri"):
        parse_params({"tracking": {"mlflow_uri": "http://user:pw@host:5000"}})


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann)

    walk(Params)


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_overlay_merges_sections_key_by_key_and_replaces_other_values(tmp_path, monkeypatch):
    _write(tmp_path / "params.yaml", {
        "env": {"name": "household", "max_turns": 12, "options": {"show_admissible": True}},
        "model": {"history": 2, "lora": {"enabled": True, "r": 4}},
        "evaluate": {"splits": ["valid_seen", "valid_unseen"], "n_tasks": 7}})
    overlay = _write(tmp_path / "profiles" / "p.yaml", {
        BASE_KEY: "../params.yaml",
        "env": {"max_turns": 30, "options": {}},
        "model": {"lora": {"alpha": 32}},
        "evaluate": {"splits": ["valid_unseen"]}})
    monkeypatch.chdir(ROOT)  # the base is found relative to the overlay, not the working dir
    p = load_params(overlay)
    assert (p.env.name, p.env.max_turns, p.env.options) == ("household", 30, {})
    assert p.model.history == 2
    assert (p.model.lora.enabled, p.model.lora.r, p.model.lora.alpha) == (True, 4, 32)
    assert (p.evaluate.splits, p.evaluate.n_tasks) == (["valid_unseen"], 7)


def test_merge_params_leaves_its_inputs_alone():
    base, overlay = {"model": {"lora": {"r": 4}}}, {"model": {"lora": {"r": 8}}}
    assert merge_params(base, overlay) == {"model": {"lora": {"r": 8}}}
    assert base == {"model": {"lora": {"r": 4}}} and overlay == {"model": {"lora": {"r": 8}}}


def test_overlay_chain_and_its_errors_name_the_files(tmp_path):
    _write(tmp_path / "params.yaml", {"env": {"max_turns": 12}})
    _write(tmp_path / "mid.yaml", {BASE_KEY: "params.yaml", "expert": {"n_train": 5}})
    top = _write(tmp_path / "top.yaml", {BASE_KEY: "mid.yaml", "expert": {"seed": 3}})
    p = load_params(top)
    assert (p.env.max_turns, p.expert.n_train, p.expert.seed) == (12, 5, 3)

    with pytest.raises(ParamsError, match=r"(?s)top\.yaml over .*mid\.yaml over .*params\.yaml: "
                                          r"invalid parameters:.*unknown key 'expert\.sed'"):
        load_params(_write(tmp_path / "top.yaml", {BASE_KEY: "mid.yaml", "expert": {"sed": 3}}))
    gone = _write(tmp_path / "gone.yaml", {BASE_KEY: "nope.yaml"})
    with pytest.raises(ParamsError, match=r"gone\.yaml: its base 'nope\.yaml': .*nope\.yaml: "
                                          r"cannot read parameters file"):
        load_params(gone)
    with pytest.raises(ParamsError, match=r"bad\.yaml: base must be the path .*got 3"):
        load_params(_write(tmp_path / "bad.yaml", {BASE_KEY: 3}))
    _write(tmp_path / "a.yaml", {BASE_KEY: "b.yaml"})
    with pytest.raises(ParamsError, match="leads back to a file of its own chain"):
        load_params(_write(tmp_path / "b.yaml", {BASE_KEY: "a.yaml"}))
    with pytest.raises(ParamsError, match="unknown key 'base'"):
        parse_params({BASE_KEY: "params.yaml"})  # only a file names a base


def test_sampling_fields_are_shared_with_each_stage_default_and_bound():
    from hisr_core.config import CollectParams, EvaluateParams, PpoParams, SamplingParams

    for section in (EvaluateParams, CollectParams, PpoParams):
        assert issubclass(section, SamplingParams)
    p = parse_params({})
    assert (p.evaluate.temperature, p.collect.temperature, p.ppo.temperature) == (0.0, 1.0, 1.0)
    with pytest.raises(ParamsError) as e:
        parse_params({"evaluate": {"temperature": -1}, "collect": {"top_p": 0},
                      "ppo": {"temperature": 0}})
    msg = str(e.value)
    assert "evaluate.temperature: Input should be greater than or equal to 0" in msg
    assert "collect.top_p: Input should be greater than 0" in msg
    assert "ppo.temperature: Value error, must be > 0: PPO learns from sampled rollouts" in msg
    assert parse_params({"collect": {"temperature": 0}}).collect.temperature == 0
