"""A run's parts, built from the config: data and prompts, ranks, precision, the policy and its
reference, sharding, the engine and rollout, rewards, sampler, optimizer and updater.

`build(cfg)` builds them in the order that lets a user's mistake fail early: everything about
the data and the rewards is checked before a model loads. It returns them grouped by who reads
them (parts.py): the run's own, and what collect (step.py), learn (learner.py), evaluation
(evaluation.py) and asynchronous generation (pipeline.py) are each given.
"""

from __future__ import annotations

import copy
import functools
import logging
import random
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from grouprl.config import Config
from grouprl.curriculum.online import OnlineCurriculum
from grouprl.data import PromptSampler, Sample, encode_prompt, fit_prompt, load_samples, make_task
from grouprl.data.sampler import Sampler
from grouprl.devices import host_share, own_device
from grouprl.errors import DataError, UserError
from grouprl.rewards import CompositeReward
from grouprl.rewards.streaming import StreamingRewards
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.agent_prompts import protocol_prompt, with_protocol
from grouprl.rollout.engines import RolloutEngine, build_engine
from grouprl.rollout.engines.process import EngineProcess
from grouprl.rollout.observation_fit import check_limit
from grouprl.rollout.single_turn import SingleTurn
from grouprl.rollout.tools.factory import build_tools
from grouprl.trainer.evaluation import breakdown_value, reward_config
from grouprl.trainer.memory import PeakMeter, longest, plan_run
from grouprl.trainer.models import (
    LoadedPolicy,
    autocast,
    cast_frozen_linears,
    engine_may_differ,
    load_causal_lm,
    load_policy,
    load_tokenizer,
    load_vision,
    model_config,
    resolve_compute_dtype,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    resolve_rollout_dtype,
    shape_stable_attention,
)
from grouprl.trainer.offload import ParkedModule, ParkedOptimizer, parks_beside, wanted
from grouprl.trainer.optim import build_optimizer, build_scheduler
from grouprl.trainer.parallel import Ranks, device_mesh, load_into, shard
from grouprl.trainer.parts import Ahead, CollectParts, EvalParts, LearnParts, Parts
from grouprl.trainer.pipeline import trainable_names
from grouprl.trainer.reference import Reference
from grouprl.trainer.slices import Checkpoint
from grouprl.trainer.update import PolicyUpdater
from grouprl.vision.families import is_vision_config
from grouprl.vision.processor import VisionProcessor

log = logging.getLogger(__name__)

MAX_BREAKDOWN_GROUPS = 50


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_data(cfg: Config) -> tuple[list[Sample], list[Sample]]:
    """Training and held-out samples, from files or the built-in task."""
    d = cfg.data
    if d.train_files:
        train = load_samples(d.train_files)
        val = load_samples(d.val_files) if d.val_files else []
    else:
        train = make_task(d.task, d.task_train_size, d.task_seed, "train", few_shot=d.few_shot)
        val = (
            make_task(d.task, d.task_val_size, d.task_seed, "val", few_shot=d.few_shot)
            if d.task_val_size
            else []
        )
    if d.val_max_samples:
        val = val[: d.val_max_samples]
    if d.system_prompt is not None:
        for s in train + val:
            if s.messages and s.messages[0].get("role") == "system":
                s.messages[0] = {"role": "system", "content": d.system_prompt}
            else:
                s.messages.insert(0, {"role": "system", "content": d.system_prompt})
    return train, val


def breakdown_key(key: str, val_samples: list[Sample]) -> str:
    """trainer.val_breakdown if the held-out samples have it, with few values; else a warning,
    once, and "" (no per-group figures: a typo or an id-like key must not pass silently or
    flood the metrics)."""
    values = {breakdown_value(s, key) for s in val_samples} - {None}
    if key and val_samples and not values:
        log.warning("trainer.val_breakdown=%r: no held-out sample has it; no per-group accuracy", key)
    elif len(values) > MAX_BREAKDOWN_GROUPS:
        log.warning(
            "trainer.val_breakdown=%r has %d values in the held-out data (at most %d are logged "
            "per group); no per-group accuracy", key, len(values), MAX_BREAKDOWN_GROUPS,
        )
    return key if values and len(values) <= MAX_BREAKDOWN_GROUPS else ""


def check_parallel(cfg: Config, ranks: Ranks) -> None:
    """What several ranks cannot do yet, and batch sizes that do not split into whole groups."""
    world = ranks.world
    ranks.share(cfg.data.train_batch_size)
    if cfg.actor.mini_batch_size:
        ranks.share(cfg.actor.mini_batch_size, "actor.mini_batch_size")
    engine_device = cfg.rollout.engine_device
    if cfg.rollout.engine_process and engine_device and torch.device(engine_device).type != "cpu":
        raise UserError(
            f"rollout.engine_device={engine_device} would be every rank's engine device ({world} ranks): "
            "leave it empty (each rank's engine process on that rank's device) or use cpu"
        )
    if cfg.model.quantization != "none":  # FSDP shards plain tensors, not bitsandbytes' packed ones
        raise UserError(
            f"model.quantization={cfg.model.quantization} runs in one process only (this run has {world} ranks)"
        )


def check_images(cfg: Config, samples: list[Sample], config) -> None:
    """Images in the prompts need a policy that reads them (one line, before loading)."""
    with_images = next((s for s in samples if s.images), None)
    if with_images is not None and not is_vision_config(config):
        raise DataError(
            f"the data has images (sample {with_images.uid!r}) but model.path "
            f"'{cfg.model.path}' is a text-only model ({getattr(config, 'model_type', '?')}); "
            "use a vision-language model, or data without images"
        )


def norm_length(cfg: Config) -> float | None:
    """The constant seq-mean-token-sum-norm divides by: actor.loss_scale_factor, else the most
    policy tokens a response can hold (for agents: the response budget, else max_turns turns
    of max_response_length)."""
    if cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm":
        return None
    if cfg.actor.loss_scale_factor:
        return float(cfg.actor.loss_scale_factor)
    if cfg.agent.enabled:
        return float(cfg.agent.max_response_tokens or cfg.agent.max_turns * cfg.rollout.max_response_length)
    return float(cfg.rollout.max_response_length)


class PromptEncoder:
    """Prompts as token ids (chat template, an agent's protocol in front, fitted to
    data.max_prompt_length) and, for a VLM policy, their processed images."""

    def __init__(self, cfg: Config, tokenizer, vision: VisionProcessor | None):
        self.cfg, self.tokenizer, self.vision = cfg, tokenizer, vision
        # an agent's prompts carry the tag protocol as their system message
        self.agent_prompt = (
            protocol_prompt("none" if cfg.agent.answer_generator == "none" else "frozen", cfg.agent.system_prompt)
            if cfg.agent.enabled
            else None
        )
        self._image_stubs: dict[int, list] = {}  # id(sample) -> its images' token counts (no pixels)

    def encode(self, samples: list[Sample], what: str) -> tuple[list[list[int] | None], dict[str, float]]:
        """Each sample's prompt ids (None: over the length limit and skipped), and the counts."""
        d = self.cfg.data
        prompts: list[list[int] | None] = []
        skipped = truncated = 0
        for s in samples:
            messages = with_protocol(s.messages, self.agent_prompt) if self.agent_prompt else s.messages
            if self.vision is not None:
                ids, images = self.vision.encode(messages, s.images)
                # kept without pixels (processed again when drawn): a large dataset's page images
                # are not held in memory
                self._image_stubs[id(s)] = [replace(im, tensors={}, text="", source=None) for im in images]
            else:
                ids = encode_prompt(self.tokenizer, messages)
            if not ids:  # nothing to condition on: a tokenizer that does not know the text, an empty question
                raise DataError(
                    f"the {what} prompt of sample {s.uid!r} has no tokens: the tokenizer of "
                    f"{self.cfg.model.tokenizer_path or self.cfg.model.path} gives none for it"
                )
            fitted = fit_prompt(ids, d.max_prompt_length, d.prompt_overflow)
            if fitted is not None and len(fitted) < len(ids) and self.vision is not None:
                cut = ids[: len(ids) - len(fitted)]
                if any(t in self.vision.family.never_sampled() for t in cut):  # never cut through an image
                    fitted = None
            if fitted is None:
                skipped += 1
            elif len(fitted) < len(ids):
                truncated += 1
            prompts.append(fitted)
        if samples and skipped == len(samples):
            raise DataError(
                f"every {what} prompt is longer than data.max_prompt_length={d.max_prompt_length} tokens; "
                "raise it or set data.prompt_overflow=truncate"
            )
        if skipped or truncated:
            log.warning(
                "%s prompts over %d tokens: %d skipped, %d truncated", what, d.max_prompt_length, skipped, truncated
            )
        return prompts, {"data/prompts_skipped": skipped, "data/prompts_truncated": truncated}

    def images_of(self, samples: list[Sample]) -> list[list] | None:
        """The samples' prompt images, processed (pixels included), for a VLM policy."""
        if self.vision is None:
            return None
        out = []
        for s in samples:
            images = [self.vision.prepare_image(image) for image in s.images]
            stubs = self._image_stubs.get(id(s), [])
            if [(i.num_tokens, i.grid) for i in images] != [(i.num_tokens, i.grid) for i in stubs]:
                raise RuntimeError(f"the images of sample {s.uid!r} processed differently than when encoded")
            out.append(images)
        return out


def make_sampler(cfg: Config, train_samples: list[Sample]) -> Sampler:
    if cfg.data.sampler == "curriculum":  # draws by difficulty bucket, learns from each group
        return OnlineCurriculum.from_samples(train_samples, cfg.data.train_batch_size, cfg.curriculum, cfg.trainer.seed)
    return PromptSampler(len(train_samples), cfg.data.train_batch_size, cfg.data.sampler, cfg.trainer.seed)


def make_reference(cfg: Config, model: torch.nn.Module, is_lora: bool, skeleton=None):
    """A frozen reference only when a KL coefficient needs it. With LoRA the reference is the base
    model with adapters disabled, not a second copy. `skeleton`: builds the model without its
    weights (several ranks: the reference is sharded and loads as the policy does)."""
    if cfg.algorithm.kl_coef <= 0 and cfg.actor.kl_loss_coef <= 0:
        return None
    if is_lora:  # (the config refuses algorithm.ref_refresh_steps with LoRA)
        return "adapters-disabled"
    ref = (skeleton() if skeleton is not None else copy.deepcopy(model)).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def reference_of(ref_model: torch.nn.Module | str | None, device, parked: bool) -> Reference:
    """make_reference's answer as the Reference the learner and checkpoints use; a frozen copy
    goes to host memory now where actor.reference_offload asks (its pass brings it back)."""
    if ref_model is None:
        return Reference("none")
    if isinstance(ref_model, str):
        return Reference("adapters")
    parking = ParkedModule(ref_model, device, enabled=parked)
    parking.out()
    return Reference("frozen", ref_model, parking)


def generation_engine(cfg: Config, model_path: str, device: str, dtype, rollout_dtype, share_cores: bool = False):
    """What the rollout engine process runs (rollout.engine_process): a copy of the policy loaded
    as the trainer loads it, on `device`, the configured engine over it, and the precision each
    request runs in. Returns (engine, model, context). `share_cores`: the trainer computes on the
    same CPU cores, so the engine takes half of them (each taking all, they fight: 1.30x the step)."""
    device = own_device(device)  # cuda:N alone visible here (vLLM would take cuda:0): it is cuda:0 now
    if share_cores:
        torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    shape_stable_attention(device)
    loaded = load_policy(cfg, device, dtype, path=model_path)
    model, tokenizer, family = cast_frozen_linears(loaded.model.requires_grad_(False), rollout_dtype), loaded.tokenizer, loaded.family
    engine = build_engine(
        cfg.rollout, model, tokenizer, model_path=model_path, seed=cfg.trainer.seed, dtype=rollout_dtype,
        vision=family, report_log_probs=True, device=device,
    )  # fmt: skip
    return engine, model, lambda: autocast(device, rollout_dtype)


class Sharder:
    """FSDP2 over a model when there are several ranks (parallel.shard); the model otherwise."""

    def __init__(self, cfg: Config, ranks: Ranks, device: torch.device, dtype, compute_dtype):
        self.cfg, self.ranks, self.device = cfg, ranks, device
        self.compute = compute_dtype if compute_dtype not in (None, dtype) else None
        self.mesh = None  # what FSDP shards over (actor.fsdp_size)

    def __call__(self, model: torch.nn.Module, source: dict | None = None) -> torch.nn.Module:
        """`source`: rank 0's whole weights ({} elsewhere) for a model built without them."""
        if not self.ranks.distributed:
            return model
        a = self.cfg.actor
        reduce = torch.float32 if self.compute is not None and a.fsdp_reduce_dtype == "float32" else None
        if self.mesh is None:
            self.mesh = device_mesh(self.ranks, self.device.type, a.fsdp_size)
        # on a CPU the shards live in host memory already: offloading is for accelerators
        offload = a.fsdp_offload and self.device.type != "cpu"
        return shard(
            model, param_dtype=self.compute, reduce_dtype=reduce, offload=offload, mesh=self.mesh, source=source,
            device=self.device,
        )  # fmt: skip


@dataclass
class Precision:
    """The run's dtypes: the parameters', the update's autocast (None: the parameters') and
    generation's autocast."""

    dtype: torch.dtype
    compute: torch.dtype | None
    rollout: torch.dtype | None

    @classmethod
    def resolve(cls, cfg: Config, device: torch.device) -> Precision:
        dtype = resolve_dtype(cfg.model.dtype, device)
        compute = resolve_compute_dtype(cfg.actor.dtype, device, dtype)
        return cls(dtype, compute, resolve_rollout_dtype(cfg.rollout.dtype, device, dtype, compute))


def place_ranks(cfg: Config) -> tuple[torch.device, Ranks]:
    """This process's device and its ranks (torchrun / Ray: each holds whole groups of every
    step, parallel.py)."""
    device = resolve_device(cfg.trainer.device)
    ranks = Ranks.from_env(device.type)
    if ranks.distributed:
        check_parallel(cfg, ranks)
        if device.type == "cuda":
            device = torch.device("cuda", ranks.local_rank)
            torch.cuda.set_device(device)
    return device, ranks


def correction(cfg: Config, precision: Precision) -> tuple[bool, str]:
    """Whether the engine's numbers can differ from the update's (bf16, vLLM; asynchronous
    training samples from older weights), and algorithm.rollout_is with auto resolved: where they
    can differ the engine records its log-probs and importance correction is on unless off."""
    p = precision
    differs = engine_may_differ(cfg.rollout.engine, p.dtype, p.compute, p.rollout) or cfg.rollout.max_staleness > 0
    rollout_is = cfg.algorithm.rollout_is
    if rollout_is == "auto":
        rollout_is = "token" if differs else "off"
    return differs, rollout_is


@dataclass
class Models:
    """The policy as loaded, what the update runs, the reference, and the generation copy."""

    loaded: LoadedPolicy
    policy: torch.nn.Module  # the model, or its FSDP2 root over several ranks
    ref_model: torch.nn.Module | str | None
    generation_copy: torch.nn.Module | None  # rollout.max_staleness: the copy generation samples from


def load_models(
    cfg: Config, ranks: Ranks, device: torch.device, precision: Precision, path: str, tokenizer, vision=None
) -> Models:
    """The policy, its reference and generation copy. Over several ranks every rank builds them
    with their parameters on the meta device and reads only its shards' slices of the checkpoint
    (slices.py), straight to where they live: no whole host copy, nothing broadcast (a checkpoint
    that cannot be read in slices: rank 0 reads it whole and broadcasts it, `fill_from_rank0`).
    `vision`: a VLM's processor, already loaded."""
    dtype = precision.dtype
    loaded = load_policy(cfg, device, dtype, path=path, tokenizer=tokenizer, weights=not ranks.distributed, vision=vision)
    model = loaded.model
    source = None
    if ranks.distributed:
        source = Checkpoint.of(model, path, torch.initial_seed())
        if source is None:  # rank 0 reads the whole model into host memory and broadcasts it
            if ranks.main:
                model = loaded.model = load_causal_lm(cfg.model, path, torch.device("cpu"), dtype)
            source = dict(model.state_dict()) if ranks.main else {}
    attention = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in attention and cfg.actor.shared_prefix:
        log.info(
            "model.attn_implementation=%s: generation and evaluation attend through it; the update's "
            "shared-prefix passes through sdpa (their block masks are 4-D, a flash kernel takes padding "
            "masks only; actor.shared_prefix=false runs whole sequences through %s)", attention, attention
        )
    # what a copy starts from: the model itself in one process; on several ranks a skeleton that
    # loads as the policy does (its own slices), never a copy of a whole model
    skeleton = functools.partial(load_causal_lm, cfg.model, path, device, weights=False)
    # the frozen reference of a run that computes in bf16, sharded: kept in bf16 (FSDP would
    # gather it in bf16 all the same), half the memory of float32 shards
    ref_dtype = precision.compute or dtype
    ref_model = make_reference(cfg, model, cfg.model.lora.rank > 0, functools.partial(skeleton, ref_dtype) if ranks.distributed else None)
    if isinstance(ref_model, torch.nn.Module) and not ranks.distributed:  # FSDP gathers it in the compute dtype
        cast_frozen_linears(ref_model, precision.compute)  # scored under the update's autocast only
    # rollout.max_staleness > 0: generation ahead of the update samples from a whole copy of the
    # policy on each rank, loaded with the weights of each batch's version (its linear weights in
    # the generation's precision: no cast at every decode step)
    generation_copy = None
    if cfg.rollout.max_staleness:
        if ranks.distributed:
            generation_copy = skeleton(dtype).requires_grad_(False)
            load_into(generation_copy, source, device)
        else:
            generation_copy = copy.deepcopy(model).requires_grad_(False)
        cast_frozen_linears(generation_copy, precision.rollout)
    sharder = Sharder(cfg, ranks, device, dtype, precision.compute)
    policy = sharder(model, source)
    if isinstance(ref_model, torch.nn.Module):
        ref_model = sharder(ref_model, source)
    return Models(loaded, policy, ref_model, generation_copy)


def runner_over(cfg: Config, engine: RolloutEngine, tokenizer, vision, answer_dtype: torch.dtype) -> AgentLoop | SingleTurn:
    """The rollout runner over `engine`: the agent loop (its tools from agent.*; an `hf:` answer
    generator in the policy's precision, `answer_dtype`), or single-turn generation."""
    if not cfg.agent.enabled:
        return SingleTurn(engine)
    tools = build_tools(cfg.agent, cfg.data.image_max_pixels)
    return AgentLoop(engine, tokenizer, tools, cfg.agent, vision=vision, answer_dtype=answer_dtype)


def make_engines(cfg: Config, models: Models, device: torch.device, precision: Precision, ranks: Ranks, report: bool):
    """The trainer's engine and the rollout runner over it, and with rollout.max_staleness what
    generates ahead of the update (Ahead): the copy, the engine that samples from it, and its
    runner; the trainer's own built-in engine, on the current weights, then serves evaluation."""
    loaded, tokenizer, family = models.loaded, models.loaded.tokenizer, models.loaded.family
    model, path = loaded.model, loaded.path
    ahead = None
    if cfg.rollout.max_staleness:
        generation_copy = models.generation_copy
        if cfg.rollout.engine_address:  # an engine service's process, on another machine
            load = functools.partial(generation_engine, cfg, path, dtype=precision.dtype, rollout_dtype=precision.rollout)
            ahead_engine = EngineProcess(generation_copy, tokenizer, load, trainable_names(model), device, address=cfg.rollout.engine_address)
        elif cfg.rollout.engine_process:  # its own process (and device), fed over torch.distributed
            where = cfg.rollout.engine_device or str(device)
            share = torch.device(where).type == "cpu" and device.type == "cpu"
            load = functools.partial(generation_engine, cfg, path, where, precision.dtype, precision.rollout, share)
            ahead_engine = EngineProcess(generation_copy, tokenizer, load, trainable_names(model), device, engine_device=where)
        else:
            ahead_engine = build_engine(
                cfg.rollout, generation_copy, tokenizer, model_path=path, seed=cfg.trainer.seed, dtype=precision.rollout,
                vision=family, report_log_probs=True, device=device,
            )  # fmt: skip
        # the rollout threads' collectives (judge failures, dropped groups, refills) go over a
        # group of their own, so that they never interleave with the update's
        runner = runner_over(cfg, ahead_engine, tokenizer, loaded.vision, precision.dtype)
        ahead = Ahead(generation_copy, ahead_engine, runner, ranks.fork())
        engine = build_engine(replace(cfg.rollout, engine="hf"), model, tokenizer, vision=family, report_log_probs=report)
    else:
        engine = build_engine(
            cfg.rollout, model, tokenizer, model_path=path, seed=cfg.trainer.seed, dtype=precision.rollout,
            vision=family, report_log_probs=report, device=device,
            sharded=models.policy if models.policy is not model else None,  # each rank's engine, fed layer by layer
        )  # fmt: skip
    return engine, runner_over(cfg, engine, tokenizer, loaded.vision, precision.dtype), ahead


def make_updater(
    cfg: Config, pad_token_id: int, precision: Precision, rollout_is: str, family, ranks: Ranks, device: torch.device
) -> PolicyUpdater:
    # FSDP's offload: the optimizer steps the shards in host memory, with this rank's share of
    # the node's cores (torchrun's ranks run one thread: right for the GPU, not for AdamW on a CPU)
    host_step = not parks_beside(cfg.actor.fsdp_offload, ranks.distributed, device)
    return PolicyUpdater(
        cfg.actor,
        temperature=cfg.rollout.temperature,
        pad_token_id=pad_token_id,
        skip_nonfinite=cfg.trainer.skip_nonfinite_loss,
        compute_dtype=precision.compute,
        rollout_is=rollout_is,
        rollout_is_cap=cfg.algorithm.rollout_is_cap,
        rollout_is_mode=cfg.algorithm.rollout_is_mode,
        rollout_is_lower=cfg.algorithm.rollout_is_lower or None,
        norm_length=norm_length(cfg),
        vision=family,
        ranks=ranks,
        step_threads=host_share(ranks.local_world) if host_step else None,
    )


def build(cfg: Config) -> Parts:
    seed_everything(cfg.trainer.seed)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name
    # Everything the user can get wrong in data or rewards fails here, before the model loads.
    train_samples, val_samples = load_data(cfg)
    breakdown = breakdown_key(cfg.trainer.val_breakdown, val_samples)
    device, ranks = place_ranks(cfg)
    # judges log to judge.jsonl; with several ranks each takes its share of a judge's cap; built
    # once the rank's device is set (a local judge or reward model on "auto" takes this rank's)
    reward = CompositeReward.from_config(reward_config(cfg), run_dir=run_dir, rank=ranks.rank, world=ranks.world)
    shape_stable_attention(device)
    precision = Precision.resolve(cfg, device)
    if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode == "token-mean":
        log.warning(
            "actor.policy_loss=gspo with loss_agg_mode=token-mean weighs a sequence by its length, "
            "which the GSPO paper does not (its ratio is one per sequence); seq-mean-token-mean is GSPO's"
        )
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(cfg.model, model_path)
    config = model_config(cfg.model, model_path)
    check_images(cfg, train_samples + val_samples, config)
    if cfg.agent.enabled:  # the observation limit holds an observation's turn markers (in tokens)
        check_limit(tokenizer, cfg.agent)
    # the prompts as token ids (a VLM's images processed, no weight read yet): the memory plan
    # takes the longest of them
    vision = load_vision(cfg, model_path, config, tokenizer)
    encoder = PromptEncoder(cfg, tokenizer, vision)
    train_prompts, prompt_stats = encoder.encode(train_samples, "training")
    val_prompts, _ = encoder.encode(val_samples, "held-out")
    # the memory plan from config.json, the settings and the data's longest prompt: a run that
    # would not fit stops here, before anything loads (settings that depend on the devices first)
    cfg, plan = plan_run(cfg, config, run_dir, write=ranks.main, longest_prompt=longest(train_prompts + val_prompts))
    engine_differs, rollout_is = correction(cfg, precision)
    models = load_models(cfg, ranks, device, precision, model_path, tokenizer, vision)
    model = models.loaded.model
    sampler = make_sampler(cfg, train_samples)
    total_steps = cfg.trainer.total_steps or sampler.steps_for_epochs(cfg.trainer.total_epochs)
    params = [p for p in model.parameters() if p.requires_grad]
    a = cfg.actor
    mini_batches = cfg.data.train_batch_size // (a.mini_batch_size or cfg.data.train_batch_size)
    optimizer = build_optimizer(params, a.optim)
    scheduler = build_scheduler(optimizer, a.optim, total_steps * mini_batches * a.ppo_epochs)
    # what lives in host memory between its uses (actor.reference_offload / optimizer_offload)
    # nothing to park under FSDP's own offload: the shards and AdamW's state live in host memory
    beside = parks_beside(a.fsdp_offload, ranks.distributed, device)
    reference = reference_of(models.ref_model, device, wanted(a.reference_offload, device) and beside)
    optimizer_parked = ParkedOptimizer(optimizer, device, enabled=bool(a.optimizer_offload) and beside)
    optimizer_parked.out()  # (no state before the first step)
    report = cfg.rollout.check_log_probs or engine_differs or rollout_is != "off"
    engine, runner, ahead = make_engines(cfg, models, device, precision, ranks, report)
    meter = PeakMeter(device)
    collect = CollectParts(
        ranks=ranks, device=device, engine=engine, runner=runner, policy=models.policy, rollout_dtype=precision.rollout,
        encoder=encoder, sampler=sampler, train_samples=train_samples, train_prompts=train_prompts,
        prompt_stats=prompt_stats, reward=reward, streaming=StreamingRewards(reward) if cfg.reward.streaming else None,
    )  # fmt: skip
    learn = LearnParts(
        ranks=ranks, device=device, meter=meter, engine=engine, model=model, policy=models.policy, params=params,
        reference=reference, optimizer=optimizer, scheduler=scheduler, optimizer_parked=optimizer_parked,
        updater=make_updater(cfg, engine.pad_token_id, precision, rollout_is, models.loaded.family, ranks, device),
    )  # fmt: skip
    evaluate = EvalParts(
        ranks=ranks, engine=engine, policy=models.policy, reward=reward, samples=val_samples, prompts=val_prompts,
        breakdown=breakdown,
    )  # fmt: skip
    return Parts(
        cfg=cfg, plan=plan, meter=meter, run_dir=run_dir, ranks=ranks, tokenizer=tokenizer, vision=vision,
        total_steps=total_steps, collect=collect, learn=learn, evaluate=evaluate, ahead=ahead,
    )  # fmt: skip
