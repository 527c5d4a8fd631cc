"""Tools the agent loop calls: search, crop. See base.py for the interface."""

from grouprl.rollout.tools.base import AgentState, Observation, Tool

__all__ = ["AgentState", "Observation", "Tool"]
