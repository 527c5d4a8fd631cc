"""What the agent reads besides tool results: the protocol system prompt, the corrective
messages for turns without a valid action, the last-turn notice, and the answer generator's
prompt."""

from __future__ import annotations

from typing import Any

PROTOCOL = """You answer questions by searching a collection of documents and images.
Each of your turns is optional reasoning in <think>...</think> followed by exactly one action:
- <search>query</search> searches the collection; the results come back as the next message.
- <bbox>[x1, y1, x2, y2]</bbox> crops the last image shown to you (pixel coordinates) to look closer.
- <search_complete>true</search_complete> ends the search when the evidence is enough to answer.
Write one action per turn and stop after its closing tag."""

PROTOCOL_SELF_ANSWER = """You answer questions by searching a collection of documents and images.
Each of your turns is optional reasoning in <think>...</think> followed by exactly one action:
- <search>query</search> searches the collection; the results come back as the next message.
- <bbox>[x1, y1, x2, y2]</bbox> crops the last image shown to you (pixel coordinates) to look closer.
- <answer>...</answer> gives your final answer and ends the episode.
Write one action per turn and stop after its closing tag."""

REMINDER = "Each turn: optional <think>...</think>, then exactly one action tag, closed."

CORRECTIONS = {
    "no_action": "Your last turn had no action. " + REMINDER,
    "unclosed_tag": "Your <{argument}> tag was not closed before the turn ended. " + REMINDER,
    "malformed_tag": "Your last turn had a closing tag without its opening tag. " + REMINDER,
    "empty_argument": "Your <{argument}> action was empty; write what to {verb} inside the tag.",
    "bad_search_complete": "End the search with exactly <search_complete>true</search_complete>.",
    "unknown_action": "The <{argument}> action is not available here. " + REMINDER,
    "answer_not_allowed": (
        "The final answer is written for you once you end the search: "
        "use <search_complete>true</search_complete> when the evidence is enough."
    ),
    "answer_required": "The search is complete; now give your final answer in <answer>...</answer>.",
}

LAST_TURN = {
    "complete": "This is your last turn: end it with <search_complete>true</search_complete>.",
    "answer": "This is your last turn: give your final answer in <answer>...</answer>.",
}

ANSWER_SYSTEM = (
    "Answer the question using the evidence gathered by a search assistant. "
    "Reply with the answer only, inside <answer>...</answer>."
)


def correction(kind: str, argument: str = "") -> str:
    """The corrective observation for an invalid turn of this kind."""
    verb = {"search": "search for", "bbox": "crop"}.get(argument, "write")
    return CORRECTIONS[kind].format(argument=argument, verb=verb)


def protocol_prompt(answer_generator: str, override: str | None = None) -> str:
    if override is not None:
        return override
    return PROTOCOL_SELF_ANSWER if answer_generator == "none" else PROTOCOL


def with_protocol(messages: list[dict[str, Any]], system_prompt: str) -> list[dict[str, Any]]:
    """`messages` with the protocol as its system message: prepended, or joined before an
    existing system message's text."""
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content", "")
        if isinstance(content, list):  # multimodal content parts
            content = [{"type": "text", "text": system_prompt + "\n\n"}, *content]
        else:
            content = f"{system_prompt}\n\n{content}"
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": system_prompt}, *messages]


def answer_messages(question: str, evidence: list[str]) -> list[dict[str, str]]:
    """The frozen answer generator's prompt: the question and the observations gathered."""
    shown = "\n\n".join(f"[{i + 1}] {text}" for i, text in enumerate(evidence)) or "(no evidence was found)"
    return [
        {"role": "system", "content": ANSWER_SYSTEM},
        {"role": "user", "content": f"Question: {question}\n\nEvidence:\n{shown}"},
    ]
