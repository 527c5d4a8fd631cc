"""What `setup.build` makes, grouped by who reads it: the run's own things at the top (settings,
run folder, memory plan and meter, tokenizer, step count), then what each stage is given and
nothing more.

    Parts.collect   CollectParts   step.Collector: draw, rollout, score
    Parts.learn     LearnParts     learner.Learner: tensors, advantages, update, push
    Parts.evaluate  EvalParts      evaluation.Evaluator: the held-out answers, scored
    Parts.ahead     Ahead          pipeline.RolloutPipeline (rollout.max_staleness > 0): the
                                   generation copy and the engine and runner over it

Several hold the same object (the reward, the engine, the ranks): each stage names what it
reads, the objects are built once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only
    from grouprl.config import Config
    from grouprl.data import Sample
    from grouprl.data.sampler import Sampler
    from grouprl.rewards import CompositeReward
    from grouprl.rewards.streaming import StreamingRewards
    from grouprl.rollout.agent import AgentLoop
    from grouprl.rollout.engines import RolloutEngine
    from grouprl.rollout.single_turn import SingleTurn
    from grouprl.trainer.memory import PeakMeter, Plan
    from grouprl.trainer.offload import ParkedOptimizer
    from grouprl.trainer.parallel import Ranks
    from grouprl.trainer.reference import Reference
    from grouprl.trainer.update import PolicyUpdater
    from grouprl.vision.processor import VisionProcessor


@dataclass(frozen=True)
class CollectParts:
    """What collect reads: the training prompts and the sampler that draws them, the engine and
    the runner over it, the rewards, this process's ranks and device."""

    ranks: Ranks  # the asynchronous rollout's: a group of its own (Ahead.ranks)
    device: torch.device
    engine: RolloutEngine
    runner: AgentLoop | SingleTurn  # the agent loop, or single-turn generation, over `engine`
    policy: torch.nn.Module  # what the engine reads its weights from (gathered for a rollout over several ranks)
    rollout_dtype: torch.dtype | None  # generation's autocast where the engine computes with `policy`
    encoder: Any  # setup.PromptEncoder (setup imports this module): a VLM's prompt images, processed when drawn
    sampler: Sampler  # PromptSampler, or the online curriculum
    train_samples: list[Sample]
    train_prompts: list[list[int] | None]  # their token ids (None: over the length limit, never drawn)
    prompt_stats: dict[str, float]  # prompts skipped and truncated, logged with every step
    reward: CompositeReward
    streaming: StreamingRewards | None  # groups scored while the rest of the batch generates


@dataclass(frozen=True)
class LearnParts:
    """What learn reads: the policy and its reference, the updater, optimizer and scheduler, the
    engine the new weights go to, this process's ranks, device and memory meter."""

    ranks: Ranks
    device: torch.device
    meter: PeakMeter  # the update phase's peak
    engine: RolloutEngine  # what the new weights are pushed to
    model: torch.nn.Module  # the policy's own module
    policy: torch.nn.Module  # what the update runs: the model, or its FSDP2 root over several ranks
    params: list[torch.nn.Parameter]  # the trainable ones
    reference: Reference  # the KL term's: a frozen copy, the LoRA policy's adapters disabled, or none
    updater: PolicyUpdater
    optimizer: torch.optim.Optimizer
    scheduler: Any
    optimizer_parked: ParkedOptimizer  # AdamW's state in host memory outside the update


@dataclass(frozen=True)
class EvalParts:
    """What held-out evaluation reads besides the collector's rollout: the held-out samples and
    their prompts, the engine and the weights it answers with, the rewards, the ranks."""

    ranks: Ranks
    engine: RolloutEngine  # the trainer's own (asynchronous runs: on the current weights)
    policy: torch.nn.Module
    reward: CompositeReward
    samples: list[Sample]
    prompts: list[list[int] | None]  # their token ids (None: over the length limit, not answered)
    breakdown: str  # trainer.val_breakdown, or "" when the held-out data cannot use it


@dataclass(frozen=True)
class Ahead:
    """The generation side of asynchronous training: a copy of the policy (`generation_copy`,
    loaded with the weights of the version a batch needs), the engine that samples from it (the
    built-in engine over the copy, vLLM, which pushes from it into its own, or either in an
    engine process of its own, rollout.engine_process, fed from the copy over gloo) and the
    rollout runner over that engine. The trainer's own engine then serves evaluation, on the
    current weights."""

    generation_copy: torch.nn.Module
    engine: RolloutEngine
    runner: AgentLoop | SingleTurn
    ranks: Ranks  # the same ranks over a group of the rollout threads' own (Ranks.fork)


@dataclass(frozen=True)
class Parts:
    """What `build` made: the run's own things, and each stage's parts."""

    cfg: Config  # the run's settings, those that depend on the devices settled (memory.plan_run)
    plan: Plan | None  # the memory plan (None: trainer.memory_check=off)
    meter: PeakMeter  # each phase's measured peak
    run_dir: Path
    ranks: Ranks
    tokenizer: Any
    vision: VisionProcessor | None  # a VLM's processor (exported with the model), None for text
    total_steps: int
    collect: CollectParts
    learn: LearnParts
    evaluate: EvalParts
    # rollout.max_staleness > 0: what generates ahead of the update, on a thread of its own
    ahead: Ahead | None = None
