"""The agent's tools from config: `agent.tools` names, `agent.retriever` says where search goes."""

from __future__ import annotations

from grouprl.config import AgentConfig
from grouprl.errors import ConfigError
from grouprl.rollout.tools.base import Tool

KNOWN_TOOLS = ("search", "bbox")


def build_tools(cfg: AgentConfig, max_pixels: int = 0) -> dict[str, Tool]:
    """action tag -> Tool. search: the HTTP service at agent.retriever.url, else the index at
    agent.retriever.index loaded in-process (no server needed). `max_pixels` (data.image_max_pixels,
    0 = none): the most pixels of a page the search shows and of a crop."""
    unknown = sorted(set(cfg.tools) - set(KNOWN_TOOLS))
    if unknown:
        raise ConfigError(f"agent.tools: unknown tool {unknown[0]!r}; known: {', '.join(KNOWN_TOOLS)}")
    tools: dict[str, Tool] = {}
    if "search" in cfg.tools:
        from grouprl.rollout.tools.search import SearchTool

        r = cfg.retriever
        if r.url:
            from grouprl.retriever.client import RetrievalClient

            backend, in_flight = RetrievalClient(r.url, timeout=r.timeout_s), r.max_in_flight
        elif r.index:
            from grouprl.retriever.index import Retriever

            backend, in_flight = Retriever.load(r.index), 1  # searched on this machine's cores: one batch at a time
        else:
            raise ConfigError(
                "agent.tools has search: set agent.retriever.index (in-process) or agent.retriever.url"
            )
        tools["search"] = SearchTool(
            backend,
            top_k=r.top_k,
            max_consecutive_failures=r.max_consecutive_failures,
            max_pixels=max_pixels,
            max_in_flight=in_flight,
        )
    if "bbox" in cfg.tools:
        from grouprl.rollout.tools.crop import CropTool

        tools["bbox"] = CropTool(max_pixels=max_pixels)
    return tools
