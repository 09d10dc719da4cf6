import pytest

from hisr_core.agent.models import (
    BUILTIN_SIZES,
    build_builtin,
    builtin_size,
    check_model_source,
    count_parameters,
    load_model,
    load_tokenizer,
)

TEXTS = ["You arrive at cabinet 1. The cabinet 1 is closed.",
         "Thought: I need a mug.\nAction: open cabinet 1"] * 20


def test_builtin_tiny_saves_and_loads_like_any_hf_model(tmp_path):
    out = build_builtin("builtin:tiny", TEXTS, seed=0, out_dir=tmp_path / "m")
    model, tok = load_model(out), load_tokenizer(out)
    assert count_parameters(model) < 1_000_000
    assert type(model).__name__ == "LlamaForCausalLM"
    text = "Thought: I need a mug.\nAction: open cabinet 1"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|pad|>"
    # Unseen words still round-trip (byte-level BPE).
    assert tok.decode(tok("zebra 42 ünïcode")["input_ids"]) == "zebra 42 ünïcode"


def test_same_seed_same_weights(tmp_path):
    a = load_model(build_builtin("builtin:tiny", TEXTS, 3, tmp_path / "a"))
    b = load_model(build_builtin("builtin:tiny", TEXTS, 3, tmp_path / "b"))
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))


def test_small_is_a_few_million_parameters():
    s = BUILTIN_SIZES["small"]
    per_layer = 2 * s.hidden_size * s.hidden_size + 2 * s.hidden_size * (
        s.hidden_size * s.num_key_value_heads // s.num_attention_heads) + 3 * s.hidden_size * s.intermediate_size
    assert 1_000_000 < s.num_hidden_layers * per_layer < 10_000_000


@pytest.mark.parametrize(("source", "message"), [
    ("builtin:huge", "unknown builtin model 'builtin:huge'"),
    ("data/models/missing", "'data/models/missing': no such folder"),
    ("./missing", "'./missing': no such folder"),
])
def test_bad_model_source_named(source, message):
    with pytest.raises(ValueError, match=message):
        check_model_source(source)
    if source.startswith("builtin"):
        with pytest.raises(ValueError):
            builtin_size(source)


def test_folder_without_config_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_source(str(tmp_path))


def test_hub_id_not_cached_offline_rejected(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        check_model_source("some-org/some-model-not-cached")
