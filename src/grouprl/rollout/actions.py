"""Reading one policy turn: an optional <think>...</think> and then one action tag.

Actions: <search>query</search>, <bbox>[x1, y1, x2, y2]</bbox>,
<search_complete>true</search_complete>, <answer>...</answer>. A turn's generation stops at the
closing tag of an action, so a well-formed turn holds exactly one. When a turn holds more than
one (the stop token carried extra text, or the turn ran to EOS), the first complete action is
taken and the turn is flagged `multiple_actions`. Tags inside a closed <think> block are
reasoning, not actions.

    >>> parse_action("<think>need the year</think><search>founding year</search>").argument
    'founding year'
    >>> parse_action("<search>a").error
    'unclosed_tag'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ACTION_TAGS = ("search", "bbox", "search_complete", "answer")
STOP_STRINGS = tuple(f"</{tag}>" for tag in ACTION_TAGS)  # `</think>` alone does not end a turn

_ACTION = re.compile(r"<(search_complete|search|bbox|answer)>(.*?)</\1>", re.DOTALL)
_OPEN = re.compile(r"<(search_complete|search|bbox|answer)>")
_CLOSE = re.compile(r"</(search_complete|search|bbox|answer)>")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclass
class Action:
    """What one turn asked for. `error` names why the action cannot be carried out (a key of
    the corrective messages in agent_prompts); `kind` is then the tag it concerns, if any."""

    kind: str | None
    argument: str = ""
    # no_action | unclosed_tag | malformed_tag | empty_argument | bad_search_complete
    error: str | None = None
    multiple: bool = False  # more than one action in the turn (the first was taken)

    @property
    def valid(self) -> bool:
        return self.kind is not None and self.error is None


def parse_action(text: str) -> Action:
    """The first complete action of a turn's text (see the module docstring)."""
    visible = _THINK.sub(" ", text)  # reasoning may quote tags; only what follows counts
    matches = list(_ACTION.finditer(visible))
    if not matches:
        opened = _OPEN.search(visible)
        if opened:
            return Action(opened.group(1), error="unclosed_tag")
        if _CLOSE.search(visible):
            return Action(None, error="malformed_tag")
        return Action(None, error="no_action")
    first = matches[0]
    kind, argument = first.group(1), first.group(2).strip()
    action = Action(kind, argument, multiple=len(matches) > 1)
    if kind == "search_complete":
        if argument.lower() != "true":
            action.error = "bad_search_complete"
    elif not argument:
        action.error = "empty_argument"
    return action
