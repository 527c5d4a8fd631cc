"""What a tool is to the agent loop: an async callable from an action's argument text and the
calling sample's state to an observation.

The agent loop owns one `AgentState` per trajectory (B x n_agent of them, created after group
replication), parses the policy's action tag, and awaits `tools[tag](argument, state)`; the
tool calls of one turn run concurrently. A tool never raises for a mistake the policy or the
outside world made (bad argument, server down, missing file): it returns an Observation with
`error` set, which the loop shows to the policy and counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from grouprl.data.sample import Sample


@dataclass
class Observation:
    """A tool's answer, shown to the policy as the next (non-trained) message."""

    text: str  # what the policy reads next
    images: list[Any] = field(default_factory=list)  # PIL images or paths, for VLM policies
    error: str | None = None  # why the call failed (short, no secrets); None = success
    retrieved: list[dict[str, Any]] = field(default_factory=list)  # search hits: {id, score, text, image}


@dataclass
class AgentState:
    """Everything one trajectory's tools may read or update between turns."""

    sample: Sample
    index: int  # position inside the group (0..n_agent-1)
    turn: int = 0  # policy turns taken so far
    retrieved: list[dict[str, Any]] = field(default_factory=list)  # every hit, in retrieval order
    retrieved_ids: list[str] = field(default_factory=list)  # unique doc ids, first-retrieval order
    current_image: Any = None  # the image the last observation showed (path or PIL image): what <bbox> crops
    current_image_size: tuple[int, int] | None = None  # (width, height) as shown to the policy
    crops: list[Any] = field(default_factory=list)  # crops taken so far (PIL images)
    errors: dict[str, int] = field(default_factory=dict)  # error counts by kind
    finished: bool = False
    finish_reason: str = ""  # "complete" | "answer" | "max_turns" | "length"

    def count_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def add_hits(self, hits: list[dict[str, Any]]) -> None:
        """Record search hits; `retrieved_ids` keeps each doc once, at its first rank."""
        for hit in hits:
            self.retrieved.append(hit)
            if hit["id"] not in self.retrieved_ids:
                self.retrieved_ids.append(hit["id"])


class Tool(Protocol):
    """Handles one action tag, e.g. name = "search" for <search>query</search>."""

    name: str

    async def __call__(self, argument: str, state: AgentState) -> Observation: ...
