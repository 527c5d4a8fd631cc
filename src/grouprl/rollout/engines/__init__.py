"""Rollout engines behind one interface (`base.RolloutEngine`): `hf`, the built-in decode loop
over the trainer's own transformers model. The agent loop and the trainer talk to the
interface only."""

from grouprl.rollout.engines.base import (
    Generation,
    ReprefillSession,
    RolloutEngine,
    SamplingParams,
    Session,
)

__all__ = ["Generation", "ReprefillSession", "RolloutEngine", "SamplingParams", "Session", "build_engine"]


def build_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The engine `cfg.engine` names (cfg: the rollout config) over the policy `model`."""
    if cfg.engine == "hf":
        from grouprl.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer, share_prompt_prefill=cfg.share_prompt_prefill, max_batch=cfg.gen_batch_size)
    raise ValueError(f"unknown rollout engine {cfg.engine!r}")  # config validation names the choices
