import pytest

from hisr_core.config import Params, ParamsError, load_params, parse_params


def test_defaults_validate():
    p = parse_params({})
    assert p.env.name == "household" and p.expert.n_train > 0


def test_project_params_file_is_valid():
    p = load_params("params.yaml")
    assert isinstance(p, Params)


def test_virtualhome_profile_is_valid_and_keeps_its_outputs_apart():
    p = load_params("profiles/virtualhome.yaml")
    assert p.env.name == "virtualhome" and p.expert.slip_rate == 0.0
    assert p.tracking.mlflow_uri == "sqlite:///data/virtualhome/mlflow/mlflow.db"
    assert p.segment.llm.cache_dir.startswith("data/virtualhome/")


def test_alfworld_profile_is_valid_and_keeps_its_outputs_apart():
    p = load_params("profiles/alfworld.yaml")
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
        parse_params({"hindsight": {"lr": 0.0, "lora": {"enabled": True}}})
    assert parse_params({"hindsight": {"lr": 0.0}}).hindsight.lr == 0.0


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
