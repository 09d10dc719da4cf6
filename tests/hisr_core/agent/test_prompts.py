"""Prompt building: masks come from pieces, and decode to exactly the responses."""

from __future__ import annotations

import pytest

from hisr_core.agent.models import train_tokenizer
from hisr_core.agent.prompts import PromptBuilder, system_text
from hisr_core.envs.base import ADMISSIBLE_MARKER
from tests import hf_fixtures

TURNS = [
    ("You are in the middle of a room.\n\nYour task is to: put a mug in shelf.",
     "Thought: I need a mug; mugs are usually in cabinets.\nAction: go to cabinet 1"),
    ("You arrive at cabinet 1. The cabinet 1 is closed.",
     "Thought: It is closed.\nAction: open cabinet 1"),
    ("You open the cabinet 1. In it, you see a mug 1.",
     "Thought: Found one.\nAction: take mug 1 from cabinet 1"),
    ("You pick up the mug 1 from the cabinet 1.", "Thought: Now the shelf.\nAction: go to shelf 1"),
    ("You arrive at shelf 1. On the shelf 1, you see nothing.",
     "Thought: Put it here.\nAction: put mug 1 in/on shelf 1"),
]
SYSTEM = system_text("put a mug in shelf", ["go to {recep}", "take {obj} from {recep}"])
CORPUS = [SYSTEM] + [o for o, _ in TURNS] + [r for _, r in TURNS]

def builtin_tokenizer():
    return train_tokenizer(CORPUS * 3, vocab_size=400)


def chat_tokenizer():
    """A tokenizer with a chat template, built offline (no hub)."""
    return hf_fixtures.chat_tokenizer(CORPUS * 3)


def plain_eos_tokenizer():
    """Like GPT-2: no chat template, role markers are ordinary text, EOS ends a turn."""
    return hf_fixtures.plain_eos_tokenizer(CORPUS * 3)


TOKENIZERS = {"builtin": builtin_tokenizer, "chat_template": chat_tokenizer,
              "plain_eos": plain_eos_tokenizer}


def masked_text(tokenizer, enc):
    ids = [t for t, m in zip(enc.input_ids, enc.response_mask, strict=True) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_masked_tokens_decode_exactly_to_responses(name):
    tok = TOKENIZERS[name]()
    enc = PromptBuilder(tok).encode(SYSTEM, TURNS)
    assert masked_text(tok, enc) == "".join(r for _, r in TURNS)
    assert len(enc.input_ids) == len(enc.response_mask) == len(enc.turn_ids)
    # Unmasked tokens hold every observation and the system text.
    unmasked = tok.decode([t for t, m in zip(enc.input_ids, enc.response_mask) if not m],
                          skip_special_tokens=True)
    for obs, _ in TURNS:
        assert obs in unmasked
    assert SYSTEM in unmasked


def test_chat_template_pieces_match_template_rendering():
    tok = chat_tokenizer()
    enc = PromptBuilder(tok).encode(SYSTEM, TURNS)
    msgs = [{"role": "system", "content": SYSTEM}]
    for o, r in TURNS:
        msgs += [{"role": "user", "content": o}, {"role": "assistant", "content": r}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(enc.input_ids, skip_special_tokens=False) == rendered
    # The end-of-turn marker is learned, so generation knows when to stop.
    builder = PromptBuilder(tok)
    assert builder.stop_ids == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_generation_prompt_ends_with_assistant_header_and_window():
    tok = builtin_tokenizer()
    builder = PromptBuilder(tok, history=2)
    enc = builder.prompt(SYSTEM, TURNS[:4], "You arrive at shelf 1.")
    assert enc.turns == (2, 3, 4)
    assert enc.input_ids[-len(builder.assistant_prefix):] == builder.assistant_prefix
    assert sum(enc.response_mask) == 0
    text = tok.decode(enc.input_ids, skip_special_tokens=True)
    assert TURNS[1][1] not in text and TURNS[2][1] in text and TURNS[3][1] in text


def test_max_tokens_drops_whole_old_turns_never_half_a_response():
    tok = builtin_tokenizer()
    full = PromptBuilder(tok).prompt(SYSTEM, TURNS, "next")
    builder = PromptBuilder(tok, max_tokens=len(full.input_ids) - 5)
    enc = builder.prompt(SYSTEM, TURNS, "next")
    assert len(enc.input_ids) <= builder.max_tokens and enc.turns[0] > 0
    text = tok.decode(enc.input_ids, skip_special_tokens=True)
    for k, (_, r) in enumerate(TURNS):
        assert (r in text) == (k in enc.turns)


def test_training_sequences_match_inference_windows():
    tok = builtin_tokenizer()
    builder = PromptBuilder(tok, history=2)
    seqs = builder.training_sequences(SYSTEM, TURNS)
    # Every response is trained exactly once.
    assert "".join(masked_text(tok, s) for s in seqs) == "".join(r for _, r in TURNS)
    assert [s.turns for s in seqs] == [(0, 1, 2), (1, 2, 3), (2, 3, 4)]
    # The context of the last trained turn equals the generation prompt at that turn.
    last = seqs[-1]
    prompt = builder.prompt(SYSTEM, TURNS[:4], TURNS[4][0])
    assert last.input_ids[: len(prompt.input_ids)] == prompt.input_ids


def test_training_sequences_all_history_is_one_sequence():
    tok = builtin_tokenizer()
    seqs = PromptBuilder(tok).training_sequences(SYSTEM, TURNS)
    assert len(seqs) == 1 and seqs[0].turns == tuple(range(len(TURNS)))


def test_too_long_single_turn_is_an_error():
    with pytest.raises(ValueError, match="max_tokens"):
        PromptBuilder(builtin_tokenizer(), max_tokens=10).training_sequences(SYSTEM, TURNS)


def test_turns_not_learned_stay_in_context_without_loss():
    tok = builtin_tokenizer()
    learn = [True, False, True, True, True]
    for builder in (PromptBuilder(tok), PromptBuilder(tok, history=2)):
        seqs = builder.training_sequences(SYSTEM, TURNS, learn)
        trained = "".join(masked_text(tok, s) for s in seqs)
        assert trained == "".join(r for (_, r), on in zip(TURNS, learn) if on)
        text = tok.decode(seqs[0].input_ids, skip_special_tokens=True)
        assert TURNS[1][1] in text, "the unlearned response is still context"


LISTED = [(o + ADMISSIBLE_MARKER + f"go to shelf 1, look {k}", r) for k, (o, r) in enumerate(TURNS)]


def lists_shown(tok, enc):
    return tok.decode(enc.input_ids, skip_special_tokens=True).count(ADMISSIBLE_MARKER.strip())


def test_past_admissible_false_shows_only_the_newest_list():
    tok = builtin_tokenizer()
    keep, drop = PromptBuilder(tok, history=2), PromptBuilder(tok, history=2, past_admissible=False)
    assert lists_shown(tok, keep.prompt(SYSTEM, LISTED[:3], LISTED[3][0])) == 3
    prompt = drop.prompt(SYSTEM, LISTED[:3], LISTED[3][0])
    text = tok.decode(prompt.input_ids, skip_special_tokens=True)
    assert lists_shown(tok, prompt) == 1 and text.rstrip().endswith("look 3")
    assert TURNS[2][0] in text and "look 2" not in text, "a past observation keeps its text"
    # Training: every response in its own sequence, its observation listed as at inference.
    seqs = drop.training_sequences(SYSTEM, LISTED)
    assert [s.turns[-1] for s in seqs] == list(range(len(LISTED)))
    for k, s in enumerate(seqs):
        assert masked_text(tok, s) == LISTED[k][1]
        assert lists_shown(tok, s) == 1
        want = drop.prompt(SYSTEM, LISTED[:k], LISTED[k][0]).input_ids
        assert s.input_ids[:len(want)] == want


def test_grammar_false_leaves_the_command_templates_out_of_every_system_message():
    from hisr_core.config import ModelParams
    from hisr_core.train.sft import encode_trajectories

    tok = builtin_tokenizer()
    grammar = ["go to {recep}", "take {obj} from {recep}"]
    shown, hidden = PromptBuilder(tok), PromptBuilder.of(tok, ModelParams(grammar=False))
    assert shown.system("put a mug in shelf", grammar) == SYSTEM
    assert "Commands:" in SYSTEM and "take {obj}" in SYSTEM
    text = hidden.system("put a mug in shelf", grammar)
    assert "Commands:" not in text and "{recep}" not in text
    assert text.endswith("Action: <command>\nYour task is to: put a mug in shelf")
    # Training sequences (and so pi_ref) see the system message the builder writes.
    row = {"instruction": "put a mug in shelf",
           "turns": [{"observation": o, "response": r} for o, r in TURNS]}
    for builder, want in ((shown, True), (hidden, False)):
        seq = encode_trajectories([row], builder, grammar)[0]
        decoded = tok.decode(seq.input_ids, skip_special_tokens=True)
        assert ("take {obj} from {recep}" in decoded) is want
        assert "Your task is to: put a mug in shelf" in decoded
