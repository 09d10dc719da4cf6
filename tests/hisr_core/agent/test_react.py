import pytest

from hisr_core.agent.react import format_response, parse_action, replace_action


def test_round_trip():
    r = format_response("I need a mug.", "go to cabinet 1")
    assert r == "Thought: I need a mug.\nAction: go to cabinet 1"
    assert parse_action(r) == "go to cabinet 1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thought: x\nAction:   Take  Apple 1 from Fridge 1  ", "take apple 1 from fridge 1"),
        ("Action: look", "look"),
        ("Thought: no action here", None),
        ("Thought: x\nAction:   ", None),
        ("Thought: x\nAction: open drawer 1\nAction: open drawer 2", "open drawer 2"),
        ("Thought: the Action: word inline\nAction: look", "look"),
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_multiline_parts_rejected():
    with pytest.raises(ValueError):
        format_response("a\nb", "look")


def test_replace_action_rewrites_the_last_action_line_only():
    text = "Thought: go on.\nAction: go to the desk 1\nAction: take it\n"
    assert replace_action(text, "go to desk 1") == "Thought: go on.\nAction: go to the desk 1\nAction: go to desk 1\n"
    assert parse_action(replace_action("Thought: x\nAction:", "look")) == "look"
    with pytest.raises(ValueError, match="no Action"):
        replace_action("Thought: x", "look")
