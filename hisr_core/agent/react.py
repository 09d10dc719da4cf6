"""ReAct responses: ``"Thought: <text>\nAction: <command>"``.

Every policy, expert and parser in the project agrees on this format; the action is the text
after the last ``Action:`` up to the end of its line.
"""

from __future__ import annotations

import re

_ACTION = re.compile(r"(?:^|\n)\s*Action:[ \t]*([^\n]*)")
_LABEL = re.compile(r"(?:^|\n)\s*Action:")


def format_response(thought: str, action: str) -> str:
    """The response text for one turn; neither part may contain a newline."""
    if "\n" in thought or "\n" in action:
        raise ValueError("thought and action must be single lines")
    return f"Thought: {thought}\nAction: {action}"


def parse_action(response: str) -> str | None:
    """The action of a response, lower-cased and whitespace-normalised; None if there is none."""
    matches = _ACTION.findall(response)
    if not matches:
        return None
    action = " ".join(matches[-1].split()).lower()
    return action or None


def action_label_end(partial: str) -> int | None:
    """The index just past the first ``Action:`` label of a (partial) response, where its
    command starts (after one space); None while there is no label yet."""
    m = _LABEL.search(partial)
    return m.end() if m else None


def replace_action(response: str, action: str) -> str:
    """``response`` with the command of its last ``Action:`` line replaced by ``action``."""
    if "\n" in action:
        raise ValueError("an action is a single line")
    last = None
    for last in _ACTION.finditer(response):
        pass
    if last is None:
        raise ValueError("the response has no Action: line")
    return response[:last.start(1)] + action + response[last.end(1):]
