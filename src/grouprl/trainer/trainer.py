"""The training loop, top to bottom:

sample B prompts -> replicate n_agent times (group = prompt) -> generate -> reward ->
advantages -> ppo_epochs x mini-batches x micro-batches -> AdamW step -> log -> checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import yaml

from grouprl.algorithms import compute_advantages, kl_estimate, logprob_mismatch, turn_index
from grouprl.config import Config, to_dict
from grouprl.curriculum.filtering import prompts_to_draw, select_groups
from grouprl.curriculum.online import OnlineCurriculum
from grouprl.data import PromptSampler, Sample, encode_prompt, fit_prompt, load_samples, make_task
from grouprl.errors import DataError, UserError
from grouprl.rewards import CompositeReward
from grouprl.rewards.composite import JudgeUnavailableError, groups_to_drop, judges_down
from grouprl.rewards.streaming import StreamingRewards, batch_summary, combine
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.agent_prompts import protocol_prompt, with_protocol
from grouprl.rollout.engines import SamplingParams, build_engine, rollout_phase
from grouprl.rollout.engines.streams import RowStreams, mix_seed
from grouprl.rollout.tools.factory import build_tools
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.checkpoint import CheckpointManager, rng_state, set_rng_state
from grouprl.trainer.export import export_model
from grouprl.trainer.image_report import eval_rows, write_report
from grouprl.trainer.loggers import ConsoleLogger, RolloutWriter, make_loggers
from grouprl.trainer.models import (
    autocast,
    engine_may_differ,
    load_causal_lm,
    load_tokenizer,
    model_config,
    resolve_compute_dtype,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    resolve_rollout_dtype,
)
from grouprl.trainer.optim import build_optimizer, build_scheduler
from grouprl.trainer.parallel import (
    Ranks,
    device_mesh,
    gathered,
    inner,
    reduce_metrics,
    shard,
    state_gb,
    whole_state_dict,
)
from grouprl.trainer.update import PolicyUpdater, build_step_tensors
from grouprl.vision.families import is_vision_config
from grouprl.vision.processor import VisionProcessor

log = logging.getLogger(__name__)

EVALUATION_STREAM = 2**62  # a step number no run reaches: evaluation's own streams


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


def breakdown_value(sample: Sample, key: str) -> str | None:
    """The group a held-out sample counts in for trainer.val_breakdown (None: no key, or no value)."""
    if not key:
        return None
    value = sample.data_source if key == "data_source" else sample.extra_info.get(key)
    return None if value in (None, "") else str(value)


MAX_BREAKDOWN_GROUPS = 50


def drop_lines_after(path: Path, step: int) -> None:
    """Keep only the jsonl records of steps <= `step` (atomic rewrite; a torn last line goes too)."""
    if not path.is_file():
        return
    kept, changed = [], False
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line).get("step", 0) <= step
        except json.JSONDecodeError:
            keep = False
        changed |= not keep
        if keep:
            kept.append(line)
    if changed:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux reports KiB


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        seed_everything(cfg.trainer.seed)
        self.run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.experiment_name
        # Everything the user can get wrong in data or rewards fails here, before the model loads.
        self.train_samples, self.val_samples = load_data(cfg)
        self._check_breakdown()
        self.device = resolve_device(cfg.trainer.device)
        # torchrun / Ray ranks: each holds whole groups of every step (parallel.py)
        self.ranks = Ranks.from_env(self.device.type)
        # judges log to judge.jsonl; with several ranks each takes its share of a judge's cap
        self.reward = CompositeReward.from_config(
            self._reward_config(), run_dir=self.run_dir, rank=self.ranks.rank, world=self.ranks.world
        )
        if self.ranks.distributed:
            self._check_parallel()
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.ranks.local_rank)
                torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.compute_dtype = resolve_compute_dtype(cfg.actor.dtype, self.device, self.dtype)
        self.rollout_dtype = resolve_rollout_dtype(
            cfg.rollout.dtype, self.device, self.dtype, self.compute_dtype
        )
        # where the engine's numbers can differ from the update's (bf16, vLLM) it records its
        # log-probs, and importance correction is on unless switched off (algorithm.rollout_is)
        self.engine_differs = engine_may_differ(cfg.rollout.engine, self.dtype, self.compute_dtype, self.rollout_dtype)
        self.rollout_is = cfg.algorithm.rollout_is
        if self.rollout_is == "auto":
            self.rollout_is = "token" if self.engine_differs else "off"
        if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode == "token-mean":
            log.warning(
                "actor.policy_loss=gspo with loss_agg_mode=token-mean weighs a sequence by its length, "
                "which the GSPO paper does not (its ratio is one per sequence); seq-mean-token-mean is GSPO's"
            )
        model_path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(cfg.model, model_path)
        self._check_images(model_config(cfg.model, model_path))
        self.model = load_causal_lm(cfg.model, model_path, self.device, self.dtype)
        self.is_lora = cfg.model.lora.rank > 0
        # a VLM policy: the processor that turns prompts and observations with images into inputs
        self.vision = (
            VisionProcessor.load(
                model_path,
                self.model.config,
                self.tokenizer,
                min_pixels=cfg.data.image_min_pixels,
                max_pixels=cfg.data.image_max_pixels,
                trust_remote_code=cfg.model.trust_remote_code,
            )
            if is_vision_config(self.model.config)
            else None
        )
        self.family = self.vision.family if self.vision is not None else None
        self._image_stubs: dict[int, list] = {}  # id(sample) -> its images' token counts (no pixels)

        # an agent's prompts carry the tag protocol as their system message
        self.agent_prompt = (
            protocol_prompt(
                "none" if cfg.agent.answer_generator == "none" else "frozen", cfg.agent.system_prompt
            )
            if cfg.agent.enabled
            else None
        )
        self.train_prompts, self.prompt_stats = self._encode(self.train_samples, "training")
        self.val_prompts, _ = self._encode(self.val_samples, "held-out")
        if cfg.data.sampler == "curriculum":  # draws by difficulty bucket, learns from each group
            self.sampler = OnlineCurriculum.from_samples(
                self.train_samples, cfg.data.train_batch_size, cfg.curriculum, cfg.trainer.seed
            )
        else:
            self.sampler = PromptSampler(
                len(self.train_samples), cfg.data.train_batch_size, cfg.data.sampler, cfg.trainer.seed
            )
        self.total_steps = cfg.trainer.total_steps or self.sampler.steps_for_epochs(cfg.trainer.total_epochs)

        self.ref_model = self._make_reference()
        self._mesh = None  # several ranks: what FSDP shards over (actor.fsdp_size)
        # what the update runs: the model itself, or its FSDP2 root over several ranks
        self.policy = self._shard(self.model)
        if isinstance(self.ref_model, torch.nn.Module):
            self.ref_model = self._shard(self.ref_model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        mini_batches = cfg.data.train_batch_size // (cfg.actor.mini_batch_size or cfg.data.train_batch_size)
        self.optimizer = build_optimizer(self.params, cfg.actor.optim)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.actor.optim, self.total_steps * mini_batches * cfg.actor.ppo_epochs
        )
        self.engine = build_engine(
            cfg.rollout,
            self.model,
            self.tokenizer,
            model_path=model_path,
            seed=cfg.trainer.seed,
            dtype=self.rollout_dtype,
            vision=self.family,
            report_log_probs=cfg.rollout.check_log_probs or self.engine_differs or self.rollout_is != "off",
        )
        self.agent = (
            AgentLoop(self.engine, self.tokenizer, build_tools(cfg.agent), cfg.agent, vision=self.vision)
            if cfg.agent.enabled
            else None
        )
        # groups are scored in the background while the rest of the batch generates
        self.streaming = StreamingRewards(self.reward) if cfg.reward.streaming else None
        self.updater = PolicyUpdater(
            cfg.actor,
            temperature=cfg.rollout.temperature,
            pad_token_id=self.engine.pad_token_id,
            skip_nonfinite=cfg.trainer.skip_nonfinite_loss,
            compute_dtype=self.compute_dtype,
            rollout_is=self.rollout_is,
            rollout_is_cap=cfg.algorithm.rollout_is_cap,
            rollout_is_mode=cfg.algorithm.rollout_is_mode,
            rollout_is_lower=cfg.algorithm.rollout_is_lower or None,
            norm_length=self._norm_length(),
            vision=self.family,
            ranks=self.ranks,
        )
        self._rollout_calls = 0  # rollouts of the current step (a refill draws new streams)
        self._groups: list[int] = []  # this rank's groups of the step (their places in the batch)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.keep_last)
        self.step = 0
        self.history: list[dict] = []  # evaluation results by step
        self._eval_images: list[tuple[int, list[dict]]] = []  # (step, rows) of evaluations that drew images
        self._originals: list[dict] | None = None  # the held-out requests drawn as written
        self.best_metric = -math.inf
        self.counters = {
            "skipped_steps": 0,
            "reward_errors": 0,
            "dropped_groups": 0,
            "steps_without_update": 0,
        }
        # what a checkpoint taken on Ctrl-C must restore, and whether weights are mid-update (see fit)
        self._pre_step_state: dict | None = None
        self._updating = False
        self._resume()

    # ------------------------------------------------------------------ set-up helpers
    def _norm_length(self) -> float | None:
        """The constant seq-mean-token-sum-norm divides by: actor.loss_scale_factor, else the
        most policy tokens a response can hold (for agents: the response budget, else
        max_turns turns of max_response_length)."""
        c = self.cfg
        if c.actor.loss_agg_mode != "seq-mean-token-sum-norm":
            return None
        if c.actor.loss_scale_factor:
            return float(c.actor.loss_scale_factor)
        if c.agent.enabled:
            return float(c.agent.max_response_tokens or c.agent.max_turns * c.rollout.max_response_length)
        return float(c.rollout.max_response_length)

    def _check_breakdown(self) -> None:
        """trainer.val_breakdown names a key the held-out samples have, with few values; else a
        warning, once, and no per-group figures (a typo or an id-like key must not pass silently
        or flood the metrics)."""
        key = self.cfg.trainer.val_breakdown
        values = {breakdown_value(s, key) for s in self.val_samples} - {None}
        if key and self.val_samples and not values:
            log.warning("trainer.val_breakdown=%r: no held-out sample has it; no per-group accuracy", key)
        elif len(values) > MAX_BREAKDOWN_GROUPS:
            log.warning(
                "trainer.val_breakdown=%r has %d values in the held-out data (at most %d are logged "
                "per group); no per-group accuracy", key, len(values), MAX_BREAKDOWN_GROUPS,
            )
        self._breakdown = key if values and len(values) <= MAX_BREAKDOWN_GROUPS else ""

    def _encode(self, samples: list[Sample], what: str):
        d = self.cfg.data
        prompts: list[list[int] | None] = []
        skipped = truncated = 0
        for s in samples:
            messages = with_protocol(s.messages, self.agent_prompt) if self.agent_prompt else s.messages
            if self.vision is not None:
                ids, images = self.vision.encode(messages, s.images)
                # kept without pixels (processed again when drawn): a large dataset's page images
                # are not held in memory
                self._image_stubs[id(s)] = [replace(im, tensors={}, text="") for im in images]
            else:
                ids = encode_prompt(self.tokenizer, messages)
            fitted = fit_prompt(ids, d.max_prompt_length, d.prompt_overflow)
            if fitted is not None and len(fitted) < len(ids) and self.vision is not None:
                cut = ids[: len(ids) - len(fitted)]
                if any(t in self.family.never_sampled() for t in cut):  # never cut through an image
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
                "%s prompts over %d tokens: %d skipped, %d truncated",
                what,
                d.max_prompt_length,
                skipped,
                truncated,
            )
        return prompts, {"data/prompts_skipped": skipped, "data/prompts_truncated": truncated}

    def _check_images(self, config) -> None:
        """Images in the prompts need a policy that reads them (one line, before loading)."""
        with_images = next((s for s in self.train_samples + self.val_samples if s.images), None)
        if with_images is not None and not is_vision_config(config):
            raise DataError(
                f"the data has images (sample {with_images.uid!r}) but model.path "
                f"'{self.cfg.model.path}' is a text-only model ({getattr(config, 'model_type', '?')}); "
                "use a vision-language model, or data without images"
            )

    def _images_of(self, samples: list[Sample]) -> list[list] | None:
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

    def _reward_config(self):
        """cfg.reward with `builtin:` models (a local judge's, a reward model's) resolved to
        the folders from_pretrained reads."""
        r = self.cfg.reward

        def resolved(path: str) -> str:
            if not path.startswith("builtin:"):
                return path
            return resolve_model_path(dataclasses.replace(self.cfg.model, path=path, gguf_file=None))

        return dataclasses.replace(
            r,
            judges=[dataclasses.replace(j, model=resolved(j.model)) if j.backend == "local" else j for j in r.judges],
            models=[dataclasses.replace(m, path=resolved(m.path)) for m in r.models],
        )

    def _check_parallel(self) -> None:
        """What several ranks cannot do yet, and batch sizes that do not split into whole groups."""
        c, world = self.cfg, self.ranks.world
        self.ranks.share(c.data.train_batch_size)
        if c.actor.mini_batch_size:
            self.ranks.share(c.actor.mini_batch_size, "actor.mini_batch_size")
        if c.model.quantization != "none":  # FSDP shards plain tensors, not bitsandbytes' packed ones
            raise UserError(
                f"model.quantization={c.model.quantization} runs in one process only (this run has {world} ranks)"
            )
        if not c.model.freeze_vision_tower:  # the gradient sync pass is text only
            raise UserError(
                f"model.freeze_vision_tower=false runs in one process only for now (this run has {world} ranks)"
            )
        if c.rollout.engine != "hf":
            raise UserError(
                f"rollout.engine={c.rollout.engine} runs in one process only (this run has {world} ranks)"
            )

    def _shard(self, model):
        """FSDP2 over a model when there are several ranks (parallel.shard); the model otherwise."""
        if not self.ranks.distributed:
            return model
        compute = self.compute_dtype if self.compute_dtype not in (None, self.dtype) else None
        reduce = (
            torch.float32 if compute is not None and self.cfg.actor.fsdp_reduce_dtype == "float32" else None
        )
        if self._mesh is None:
            self._mesh = device_mesh(self.ranks, self.device.type, self.cfg.actor.fsdp_size)
        return shard(
            model,
            param_dtype=compute,
            reduce_dtype=reduce,
            offload=self.cfg.actor.fsdp_offload,
            mesh=self._mesh,
        )

    def _make_reference(self):
        """A frozen reference only when a KL coefficient needs it. With LoRA the reference is
        the base model with adapters disabled, not a second copy."""
        c = self.cfg
        if c.algorithm.kl_coef <= 0 and c.actor.kl_loss_coef <= 0:
            return None
        if self.is_lora:
            if c.algorithm.ref_refresh_steps:
                raise UserError("algorithm.ref_refresh_steps needs full fine-tuning (model.lora.rank=0)")
            return "adapters-disabled"
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _ref_log_probs(self, tensors):
        if self.ref_model == "adapters-disabled":
            with self.model.disable_adapter():
                return self.updater.score_all(self.policy, tensors)
        return self.updater.score_all(self.ref_model, tensors)

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "history": list(self.history),  # copies: a snapshot taken before a step stays as it was
            "best_metric": self.best_metric,
            "counters": dict(self.counters),
            "total_steps": self.total_steps,
        }

    def _resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        path = Path(t.resume_from_path) if t.resume_mode == "path" else self.checkpoints.latest()
        if path is None:
            return
        ref = self.ref_model if isinstance(self.ref_model, torch.nn.Module) else None
        state = CheckpointManager.load(path, self.policy, self.optimizer, self.scheduler, ref_model=ref)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.history = state["history"]
        self.best_metric = state["best_metric"]
        self.counters = state["counters"]
        self.engine.weights_updated(self.model)
        log.info("resumed from %s at step %d", path, self.step)

    def save_checkpoint(self, trainer_state: dict | None = None) -> Path:
        ref = self.ref_model if isinstance(self.ref_model, torch.nn.Module) else None
        state = trainer_state or self._trainer_state()
        path = self.checkpoints.save(
            state["step"],
            self.policy,
            self.optimizer,
            self.scheduler,
            state,
            ref_model=ref,
            write=self.ranks.main,
        )
        self.ranks.barrier()  # no rank goes on (or resumes) before the checkpoint is complete
        return path

    # ------------------------------------------------------------------ rollout
    def sampling_params(self, evaluation: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_response_length,
            temperature=r.val_temperature if evaluation else r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            stop=list(r.stop),
        )

    def rollout(
        self,
        samples: list[Sample],
        prompts: list[list[int]],
        n: int,
        evaluation=False,
        on_group: Callable[[list[Trajectory]], None] | None = None,
        first_group: int | list[int] = 0,
    ) -> list[Trajectory]:
        """n trajectories per prompt, prompt-major; `on_group(group)` gets each prompt's n
        trajectories as soon as they are all complete (streaming rewards). `first_group`: the
        index of `prompts[0]` in the step's whole batch (over all ranks)."""
        # every trajectory samples from its own stream, keyed by (seed, step, rollout call) and its
        # place in the step's batch: the tokens do not depend on batching, ranks or a resume;
        # evaluation has streams of its own, so evaluating does not change what training samples
        seed = self.cfg.trainer.seed
        if evaluation:
            stream_seed = mix_seed(seed, EVALUATION_STREAM)
        else:
            stream_seed, self._rollout_calls = (
                mix_seed(seed, self.step, self._rollout_calls),
                self._rollout_calls + 1,
            )
        groups = (
            first_group if isinstance(first_group, list) else [first_group + i for i in range(len(prompts))]
        )
        keys = [g * n + j for g in groups for j in range(n)]
        generator = RowStreams(stream_seed, keys)
        with gathered(self.policy):  # several ranks: generation runs on the whole weights
            return self._generate(samples, prompts, n, generator, on_group, self.sampling_params(evaluation))

    def _generate(self, samples, prompts, n, generator, on_group, params) -> list[Trajectory]:
        images = self._images_of(samples)
        with_images = {"images": images} if images is not None else {}
        if self.agent is not None:
            with autocast(self.device, self.rollout_dtype):
                return self.agent.run(
                    samples,
                    prompts,
                    n,
                    params,
                    generator,
                    on_group_done=(lambda i, group: on_group(group)) if on_group is not None else None,
                    **with_images,
                )

        made: dict[int, Trajectory] = {}

        def make(k: int, gen) -> Trajectory:
            i, j = divmod(k, n)
            made[k] = Trajectory(
                sample=samples[i],
                index=j,
                prompt_ids=prompts[i],
                response_ids=gen.token_ids,
                loss_mask=[1] * len(gen.token_ids),
                rollout_log_probs=gen.log_probs,
                response_text=gen.text,
                finish_reason=gen.finish_reason,
                prompt_images=images[i] if images is not None else [],
            )
            return made[k]

        def group_done(i: int, generations) -> None:
            on_group([make(i * n + j, gen) for j, gen in enumerate(generations)])

        with autocast(self.device, self.rollout_dtype):
            generations = self.engine.generate(
                prompts,
                n,
                params,
                generator,
                on_group_done=group_done if on_group is not None else None,
                **with_images,
            )
        return [made.get(k) or make(k, gen) for k, gen in enumerate(generations)]

    def _next_prompts(self, extra: int = 0) -> tuple[list[Sample], list[list[int]]]:
        """The step's prompts, or `extra` more of them (dynamic filtering) from the curriculum."""
        want = extra or self.cfg.data.train_batch_size
        samples, prompts = [], []
        first = not extra
        while len(samples) < want:  # skipped (over-long) prompts are redrawn
            if first:
                drawn, first = self.sampler.next_batch(), False
            else:  # a refill is part of the same step: the curriculum's draw() does not count a step
                drawn = (
                    self.sampler.draw(want - len(samples))
                    if hasattr(self.sampler, "draw")
                    else self.sampler.next_batch()
                )
            for i in drawn:
                if self.train_prompts[i] is not None and len(samples) < want:
                    samples.append(self.train_samples[i])
                    prompts.append(self.train_prompts[i])
        return samples, prompts

    def _rollout_and_score(self) -> tuple[list[Sample], list[list[int]], list[Trajectory], dict[str, float]]:
        """Generate and score the step's groups. With curriculum.dynamic_filter, over-sample prompts
        (at most max_oversample x B) and keep B groups whose rewards are not all equal.

        Groups a failed judge dropped (on_failure: drop_group) leave the batch on every rank alike
        (decided over every rank's groups), and the kept groups are shared out again, each rank
        its part of every mini-batch. A mini-batch whose kept groups do not split evenly over the
        ranks is padded: the ranks short of a group get a copy of a kept group with an all-zero
        loss mask, which adds no term to the loss and no token or row to its denominators, so the
        update is the one of one process on the kept groups. The pads come last in this rank's
        lists (`self._pads` of them); train_step leaves them out of everything it reports."""
        c, n = self.cfg, self.cfg.rollout.n_agent
        clock = {"generate": 0.0, "reward": 0.0, "reward_hidden": 0.0}
        self._pads = 0
        self.reward.judge_report()  # an evaluation's judge calls are not this step's

        def generate_and_score(samples, prompts, first_group=0):
            t0 = time.perf_counter()
            if self.streaming is not None:
                trajectories = self.rollout(
                    samples, prompts, n, on_group=self.streaming.submit, first_group=first_group
                )
                t1 = time.perf_counter()
                metrics = self.streaming.finish(t1)
                clock["reward_hidden"] += metrics.pop("time/reward_hidden")
                metrics.pop("time/reward_span")
                clock["reward"] += metrics.pop("time/reward")
            else:
                trajectories = self.rollout(samples, prompts, n, first_group=first_group)
                t1 = time.perf_counter()
                metrics = self.reward.score(trajectories)
                clock["reward"] += time.perf_counter() - t1
            clock["generate"] += t1 - t0
            if self.agent is not None:
                metrics.update(self.agent.stats)
            if self.reward.judges:  # a judge that stopped answering stops the run, on every rank alike
                r = c.reward
                why = judges_down(
                    self.ranks.gather(self.reward.judge_report()), r.max_consecutive_failures, r.max_failed_share
                )
                if why is not None:
                    pre = self._pre_step_state  # the last finished step's state: this step is redone
                    if pre is not None and pre["step"] > 0:
                        path = self.save_checkpoint(pre)
                        raise JudgeUnavailableError(
                            f"{why}; saved {path}: run the same command to resume once the judge answers"
                        )
                    raise JudgeUnavailableError(f"{why}; nothing trained yet to save")
            return trajectories, metrics

        def group_rewards() -> list[list[float]]:
            return [[t.reward for t in trajectories[g * n : (g + 1) * n]] for g in range(len(samples))]

        def share_out(kept):
            """This rank's part of every mini-batch of `kept` (the whole batch's (place, sample,
            prompt, group) in order), a short last mini-batch padded to a multiple of the ranks."""
            size = c.actor.mini_batch_size or len(kept)
            places = []
            for start in range(0, len(kept), size):
                k = -(-min(size, len(kept) - start) // self.ranks.world)  # this rank's part, rounded up
                places += [start + self.ranks.rank * k + i for i in range(k)]
            self._groups = [g for g in places if g < len(kept)]
            self._pads = len(places) - len(self._groups)
            chosen = [kept[g] for g in self._groups]
            if self._pads:  # the kept group with the fewest tokens to run, adding nothing to the loss
                _, sample, prompt, group = min(kept, key=lambda x: sum(len(t.response_ids) for t in x[3]))
                for _ in range(self._pads):
                    pad = [dataclasses.replace(t, loss_mask=[0] * len(t.loss_mask)) for t in group]
                    chosen.append((None, sample, prompt, pad))
            return [x[1] for x in chosen], [x[2] for x in chosen], [t for x in chosen for t in x[3]]

        samples, prompts = self._next_prompts()  # the whole step's, the same on every rank
        # this rank's whole groups: its part of every mini-batch, so that each optimizer step
        # sees the groups it sees in one process
        mine = self.ranks.share(len(samples), block=c.actor.mini_batch_size or len(samples))
        samples, prompts = [samples[g] for g in mine], [prompts[g] for g in mine]
        self._groups = mine
        trajectories, metrics = generate_and_score(samples, prompts, mine)
        curriculum = isinstance(self.sampler, OnlineCurriculum)
        if curriculum and c.curriculum.dynamic_filter:
            kept, metrics = self._filter_groups(samples, prompts, trajectories, metrics, generate_and_score)
            samples, prompts, trajectories = share_out(kept)
        else:
            # a judge failed under on_failure=drop_group: the group leaves the batch on every rank
            dropped = set()
            if self.reward.drops:
                dropped = set().union(*self.ranks.gather(groups_to_drop(trajectories)))
            if curriculum:
                # every scored group teaches the tracker, on every rank in the same order
                mine = [
                    (g, s.uid, r)
                    for g, s, r in zip(self._groups, samples, group_rewards())
                    if s.uid not in dropped
                ]
                for _, uid, group in sorted(x for part in self.ranks.gather(mine) for x in part):
                    self.sampler.update(uid, group)
            if dropped:
                own = sum(s.uid in dropped for s in samples)  # summed over the ranks in the metrics
                mine = [
                    (g, s, p, trajectories[i * n : (i + 1) * n])
                    for i, (g, s, p) in enumerate(zip(self._groups, samples, prompts))
                ]
                batch = sorted((x for part in self.ranks.gather(mine) for x in part), key=lambda x: x[0])
                kept = [x for x in batch if x[1].uid not in dropped]
                samples, prompts, trajectories = share_out(kept)
                for key in ("reward/dropped", "reward/dropped_groups"):  # batch/dropped_groups says it
                    metrics.pop(key, None)
                metrics.update(batch_summary([t for x in kept for t in x[3]]))
                metrics["batch/dropped_groups"] = float(own)
                self.counters["dropped_groups"] += len(batch) - len(kept)
        if curriculum:
            metrics.update(self.sampler.metrics())
        metrics["time/generate"], metrics["time/reward"] = clock["generate"], clock["reward"]
        if self.streaming is not None:  # reward work that overlapped generation (not waited for)
            metrics["time/reward_hidden"] = clock["reward_hidden"]
        return samples, prompts, trajectories, metrics

    def _filter_groups(self, samples, prompts, trajectories, metrics, generate_and_score):
        """curriculum.dynamic_filter: over-sample prompts (at most max_oversample x B) until B
        groups whose rewards are not all equal, over every rank's groups; a group a failed judge
        dropped (on_failure=drop_group) counts as drawn, never as kept. Refills are split over
        the ranks like the first draw. Returns the kept groups of the whole batch in draw order,
        as (place, sample, prompt, trajectories), for the caller to share out again (each rank
        its part of every mini-batch, so the run equals one process's), and the step's metrics."""
        c, n, B = self.cfg, self.cfg.rollout.n_agent, self.cfg.data.train_batch_size
        scored = [(len(trajectories), metrics)]  # every scoring's metrics: counts add up
        own = list(self._groups)  # the places of the groups this rank generated

        def whole(places, samples, prompts, trajectories):  # every rank's groups, in batch order
            mine = [(g, samples[i], prompts[i], trajectories[i * n : (i + 1) * n]) for i, g in enumerate(places)]
            return sorted((x for part in self.ranks.gather(mine) for x in part), key=lambda x: x[0])

        def rewards():  # a dropped group's: none (no signal)
            dropped = groups_to_drop([t for *_, group in batch for t in group])
            return [[] if sample.uid in dropped else [t.reward for t in group] for _, sample, _, group in batch]

        batch = whole(self._groups, samples, prompts, trajectories)
        while (k := prompts_to_draw(rewards(), B, c.curriculum.max_oversample)) > 0:
            more_samples, more_prompts = self._next_prompts(extra=k)  # the same on every rank
            part = list(self.ranks.split(k))
            picked = [more_samples[i] for i in part], [more_prompts[i] for i in part]
            more, more_metrics = generate_and_score(*picked, part)
            scored.append((len(more), more_metrics))
            own += [len(batch) + i for i in part]
            batch += whole([len(batch) + i for i in part], *picked, more)
        found = rewards()
        for (_, sample, _, _), group in zip(batch, found):  # every scored group teaches the tracker
            if group:
                self.sampler.update(sample.uid, group)
        usable = [g for g, group in enumerate(found) if group]
        selection = select_groups([found[g] for g in usable], B)
        self.sampler.note_selection(selection)
        kept = [batch[usable[g]] for g in selection.keep]
        counted = ("reward/errors", "reward/gated/", "judge/")  # over every scoring of the step
        metrics = combine([(w, {k: v for k, v in m.items() if k.startswith(counted)}) for w, m in scored])
        metrics.update(batch_summary([t for x in kept for t in x[3]]))
        metrics["batch/generated_groups"] = float(len(batch))
        metrics["batch/zero_std_dropped"] = float(selection.zero_variance_dropped)
        if len(usable) < len(batch):
            metrics["batch/dropped_groups"] = float(sum(not found[g] for g in own))  # summed over the ranks
            self.counters["dropped_groups"] += len(batch) - len(usable)
        return kept, metrics

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[dict[str, float], list[Trajectory]]:
        c = self.cfg
        n = c.rollout.n_agent
        t0 = time.perf_counter()
        if not self.checkpoints.swept:
            # this process's first step: the temp folders of writes a killed run left unfinished go,
            # removed by the first rank before any rank writes (the step's collectives follow)
            self.checkpoints.sweep((self.run_dir / "final", self.run_dir / "best"), remove=self.ranks.main)
            self.ranks.barrier()
        # what a checkpoint taken before this step's update must restore (see fit's interrupt path)
        self._pre_step_state, self._updating = self._trainer_state(), False
        self._rollout_calls = 0
        pushed = getattr(self.engine, "push_seconds", None)  # an engine with its own copy of the weights
        with rollout_phase(self.engine):  # an engine that sleeps between rollouts wakes here
            samples, prompts, trajectories, metrics = self._rollout_and_score()
        t_reward = time.perf_counter()
        real = len(trajectories) - self._pads * n  # this rank's rows before its pads (_rollout_and_score)

        def reduced(metrics: dict[str, float]) -> dict[str, float]:
            """One value per metric over the ranks (reduce_metrics); reward and judge metrics are
            combined from every rank's (counts summed, means averaged where a rank has one), so a
            key only some ranks have (a judge's scores where one rank's calls all failed) is no error."""
            if not self.ranks.distributed:
                return reduce_metrics(metrics, self.ranks)
            scored = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(("reward/", "judge/"))]}
            return {**reduce_metrics(metrics, self.ranks), **combine(self.ranks.gather((1.0, scored)))}

        if not trajectories:  # every group dropped (judge failures), on every rank alike
            log.warning("step %d: every group was dropped (judge failures); no update", self.step + 1)
            metrics = reduced(metrics)
            self.step += 1
            self.counters["steps_without_update"] += 1
            self.counters["reward_errors"] += int(metrics.get("reward/errors", 0))
            self._pre_step_state = self._trainer_state()
            return metrics, trajectories

        tensors = build_step_tensors(
            trajectories,
            self.device,
            mask_truncated=c.rollout.mask_truncated,
            pad_token_id=self.engine.pad_token_id,
        )
        need_ref = self.ref_model is not None
        # the trainer's own log-probs of the sampled tokens, when a loss is taken after a first
        # optimizer step or for a KL penalty; else the update's own first pass gives them (and,
        # against an engine with its own copy of the weights, keeps them for the mismatch metrics)
        if self.updater.needs_old_log_probs(len(samples), tensors) or c.algorithm.kl_coef > 0:
            tensors.old_log_probs = self.updater.score_all(self.policy, tensors)
        # importance masking: what leaves the band leaves the loss mask (every term, every denominator)
        self.updater.reject(tensors)
        if need_ref:
            tensors.ref_log_probs = self._ref_log_probs(tensors)
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        kl_seq = None
        if c.algorithm.kl_coef > 0:  # KL as a reward penalty: r - beta * sum_t KL_t
            kl = kl_estimate(tensors.old_log_probs, tensors.ref_log_probs, c.algorithm.kl_penalty)
            kl_seq = (kl * tensors.loss_mask).sum(-1).cpu()
            rewards = rewards - c.algorithm.kl_coef * kl_seq
        group_ids = [k // n for k in range(real)]  # a group = one drawn prompt
        advantages = torch.zeros(len(trajectories))  # a pad's: masked out of the loss anyway
        if real:
            advantages[:real] = compute_advantages(
                c.algorithm.adv_estimator,
                rewards[:real],
                group_ids,
                norm_by_std=c.algorithm.norm_adv_by_std,
                epsilon=c.algorithm.adv_epsilon,
            )
        for t, a in zip(trajectories, advantages.tolist()):
            t.advantage = a
        tensors.advantages = advantages.to(self.device)
        t_prep = time.perf_counter()

        self._updating = True
        metrics.update(
            self.updater.update(
                self.policy, self.optimizer, self.scheduler, tensors, len(samples), self.params
            )
        )
        t_update = time.perf_counter()
        if tensors.rollout_log_probs is not None:  # vLLM's own copy, or the hf engine's check
            metrics.update(self._rollout_correction(tensors))
        self.engine.weights_updated(self.model)  # the next rollout samples from the new weights
        t_synced = time.perf_counter()
        metrics["time/weight_sync"] = t_synced - t_update
        if pushed is not None:  # pushes, wherever they ran (a sleeping engine pushes when it wakes)
            metrics["time/weight_push"] = self.engine.push_seconds - pushed
            metrics["perf/engine_freed_gb"] = getattr(self.engine, "last_sleep_freed_bytes", 0) / 1024**3
        self.step += 1
        self._updating = False
        if (
            c.algorithm.ref_refresh_steps
            and self.step % c.algorithm.ref_refresh_steps == 0
            and self.ref_model is not None
        ):
            inner(self.ref_model).load_state_dict(self.model.state_dict())

        trajectories, prompts = trajectories[:real], prompts[: real // n]  # the pads' work is done
        # the batch's figures over every rank's rows: the same on every rank, whatever its share
        own = {
            "adv": advantages[:real].tolist(),
            "length": [len(t.response_ids) for t in trajectories],
            "truncated": [t.truncated for t in trajectories],
            "flat": (rewards[:real].view(-1, n).std(-1, unbiased=False) == 0).float().tolist(),
            "kl": kl_seq[:real].tolist() if kl_seq is not None else [],
        }
        every = {key: [v for part in self.ranks.gather(own) for v in part[key]] for key in own}
        adv = torch.tensor(every["adv"])
        lengths = torch.tensor(every["length"], dtype=torch.float32)
        if kl_seq is not None:
            metrics["reward/kl_penalty"] = float(torch.tensor(every["kl"]).mean())
        gen_tokens = float(sum(own["length"]))  # this rank's (tokens per second add up over the ranks)
        all_tokens = gen_tokens + sum(len(p) for p in prompts) * n
        self.counters["skipped_steps"] += int(metrics.get("actor/skipped_steps", 0))
        metrics.update(
            {
                "adv/mean": float(adv.mean()),
                "adv/std": float(adv.std()) if len(adv) > 1 else 0.0,
                "adv/max": float(adv.max()),
                "adv/min": float(adv.min()),
                "batch/zero_std_groups": float(torch.tensor(every["flat"]).mean()),
                "response/length_mean": float(lengths.mean()),
                "response/length_max": float(lengths.max()),
                "response/truncated_frac": float(np.mean(every["truncated"])),
                "time/old_ref_log_probs": t_prep - t_reward,
                "time/update": t_update - t_prep,
                "time/step": t_synced - t0,
                "perf/gen_tokens_per_s": gen_tokens / max(metrics["time/generate"], 1e-9),
                "perf/tokens_per_s": all_tokens / max(t_synced - t0, 1e-9),
                "perf/peak_rss_gb": peak_rss_gb(),
                "perf/state_gb": state_gb(self.model, self.optimizer),
                **self.reward.step_metrics(),  # reward models: items, batches, busy time, queue
                "train/epoch": float(self.sampler.epoch),
                **self.prompt_stats,
            }
        )
        if torch.cuda.is_available() and self.device.type == "cuda":
            metrics["perf/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1024**3
        metrics = reduced(metrics)  # one value per metric over the ranks
        self.counters["reward_errors"] += int(metrics.get("reward/errors", 0))  # every rank's
        # the step is complete: an interrupt from here on (evaluation, logging, saving) must save
        # this step's state with this step's weights, not the state from before it
        self._pre_step_state = self._trainer_state()
        return metrics, trajectories

    def _rollout_correction(self, tensors) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's old ones on the policy's sampled
        tokens (gap, KL, chi-square; per turn for agents) and, with algorithm.rollout_is, what
        the correction did (mean weight, effective sample size, capped or masked share)."""
        a = self.cfg.algorithm
        old, rollout = tensors.old_log_probs.float(), tensors.rollout_log_probs.float()
        mask = tensors.policy_mask if tensors.policy_mask is not None else tensors.loss_mask
        found = logprob_mismatch(old, rollout, mask, a.mismatch_threshold)
        metrics = {
            f"rollout/{k if k.startswith(('kl_', 'chi2_')) else f'mismatch_{k}'}": float(v)
            for k, v in found.items()
        }
        if self.rollout_is != "off":
            _, _, is_metrics = self.updater.correction(tensors, mask)
            metrics.update({f"rollout/is_{k}": v for k, v in is_metrics.items()})
        if self.agent is not None:  # per policy turn, over every rank's tokens
            turns = turn_index(mask)  # [N, R]
            log_w = (old - rollout).clamp(-20, 20)
            gap, k3 = log_w.abs(), torch.exp(log_w) - 1 - log_w
            sums = []
            for k in range(1, self.cfg.agent.max_turns + 1):
                here = turns == k
                sums += [float(gap[here].sum()), float(k3[here].sum()), float(here.sum())]
            sums = self.ranks.reduce(sums)
            for k in range(1, self.cfg.agent.max_turns + 1):
                gap_sum, k3_sum, count = sums[3 * (k - 1) : 3 * k]
                if count:
                    metrics[f"rollout/mismatch_mean/turn_{k}"] = gap_sum / count
                    metrics[f"rollout/kl_k3/turn_{k}"] = k3_sum / count
        return metrics

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(
        self, answers: Path | None = None, progress: Callable[[int, int], None] | None = None
    ) -> dict[str, float]:
        """Answers to the held-out prompts (rollout.val_temperature; 0 = greedy), scored:
        val/accuracy (reward.val_metric), val/reward, each component, and accuracy per
        trainer.val_breakdown value. `answers`: a folder for answers.jsonl and metrics.json
        (`evaluation`'s format); `progress(done, total)` after each chunk of this rank's share."""
        from grouprl.trainer.evaluation import (
            answer_record,
            metrics_of,
            rows_of,
            skipped_record,
            write_answers,
        )

        keep = [i for i, p in enumerate(self.val_prompts) if p is not None]
        if not keep:
            return {}
        t0 = time.perf_counter()
        batch = self.cfg.rollout.gen_batch_size or 64
        mine = self.ranks.split(len(keep))  # several ranks: each answers its block
        trajectories: list[Trajectory] = []
        with gathered(self.policy), rollout_phase(self.engine):
            for start in range(mine.start, mine.stop, batch):
                chunk = keep[start : min(start + batch, mine.stop)]
                trajectories += self.rollout(
                    [self.val_samples[i] for i in chunk],
                    [self.val_prompts[i] for i in chunk],
                    1,
                    evaluation=True,
                    first_group=start,
                )
                if progress is not None:
                    progress(start + len(chunk) - mine.start, len(mine))
        self.reward.score(trajectories)
        # the reward draws images: keep them for the report (decided over every rank: it gathers)
        if self.ranks.reduce([float(any(t.artifacts for t in trajectories))], "max")[0]:
            self._keep_eval_images(trajectories)
        self.reward.step_metrics()  # reward-model counters stay the training steps' own
        metric, key = self.cfg.reward.val_metric, self._breakdown
        rows = rows_of(trajectories, metric, lambda sample: breakdown_value(sample, key))
        rows = [row for part in self.ranks.gather(rows) for row in part]  # blocks in rank order: keep's order
        out = {**metrics_of(rows), "time/eval": time.perf_counter() - t0}
        if answers is not None:
            records = [answer_record(t, metric) for t in trajectories]
            records = iter([r for part in self.ranks.gather(records) for r in part])
            if self.ranks.main:
                answered = set(keep)
                write_answers(
                    answers,
                    [next(records) if i in answered else skipped_record(s) for i, s in enumerate(self.val_samples)],
                    {"model": self.cfg.model.path, "step": self.step, "samples": len(self.val_samples),
                     "answered": len(keep), **out},
                )
        self.history.append({"step": self.step, **out})
        return out

    def _keep_eval_images(self, trajectories: list[Trajectory]) -> None:
        """This evaluation's images and scores (every rank's), and once, those of the held-out
        requests drawn as written (same seeds), for the before/after report."""

        def prompt_of(t):
            return str(t.sample.messages[-1].get("content", ""))

        rows = [r for part in self.ranks.gather(eval_rows(trajectories, prompt_of)) for r in part]
        self._eval_images.append((self.step, rows))
        if self._originals is None:
            as_written = [
                Trajectory(sample=t.sample, index=t.index, prompt_ids=t.prompt_ids, response_text=prompt_of(t))
                for t in trajectories
            ]
            self.reward.score(as_written)
            self._originals = [r for part in self.ranks.gather(eval_rows(as_written, prompt_of)) for r in part]

    def _maybe_save_best(self, val: dict[str, float]) -> None:
        if not self.cfg.trainer.save_best or "val/accuracy" not in val:
            return
        if val["val/accuracy"] > self.best_metric:
            self.best_metric = val["val/accuracy"]
            self._export(self.run_dir / "best", merge_lora=False, meta={"step": self.step, **val})

    def _export(self, target: Path, *, merge_lora: bool, meta: dict) -> None:
        """A Hugging Face folder of the policy, whole (gathered from the ranks), written once."""
        state = whole_state_dict(self.model) if self.ranks.distributed else None  # every rank gathers
        if self.ranks.main:
            export_model(
                self.model,
                self.tokenizer,
                target,
                merge_lora=merge_lora,
                meta=meta,
                processor=self.vision,
                state_dict=state,
            )
        self.ranks.barrier()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        c = self.cfg.trainer
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # lines a crashed run wrote after its last checkpoint are dropped: the resumed run redoes them
        # (resume_mode=disable starts the logs afresh)
        keep_until = -1 if c.resume_mode == "disable" else self.step
        main = self.ranks.main  # with several ranks, the first one writes the logs
        if main:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                drop_lines_after(self.run_dir / name, keep_until)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        loggers = (
            make_loggers(
                c.loggers,
                self.run_dir,
                total_steps=self.total_steps,
                start_step=self.step,
                project=c.project_name,
                experiment=c.experiment_name,
                config=to_dict(self.cfg),
            )
            if main
            else []
        )
        console = next((lg for lg in loggers if isinstance(lg, ConsoleLogger)), None)
        say = console.print if console else print if main else lambda *a: None
        rollouts = (
            RolloutWriter(self.run_dir / "rollouts.jsonl", c.experiment_name)
            if c.log_rollouts and main
            else None
        )
        prompt_text = {}
        chunks = console.chunk if console else None  # progress inside an evaluation
        try:
            if c.val_before_train and self.step == 0 and self.val_samples:
                val = self.evaluate(progress=chunks)
                say(f"baseline eval: {_fmt(val)}")
                for lg in loggers:
                    lg.log(val, self.step)
                self._maybe_save_best(val)
            started = time.perf_counter()  # max_time_minutes counts training, not the baseline
            while self.step < self.total_steps:
                if c.max_time_minutes and time.perf_counter() - started > c.max_time_minutes * 60:
                    say(
                        f"time limit of {c.max_time_minutes:g} min reached at step {self.step} "
                        "(training time; the baseline evaluation is not counted)"
                    )
                    break
                metrics, trajectories = self.train_step()
                if c.log_rollouts:  # every rank's trajectories, in the batch's order
                    for t in trajectories:
                        prompt_text.setdefault(t.uid, t.sample.messages[-1].get("content", ""))
                    lines = RolloutWriter.lines(
                        c.experiment_name, self.step, trajectories, prompt_text, self.run_dir / "images"
                    )
                    n = self.cfg.rollout.n_agent  # in the batch's order: by group, then sample
                    groups = self._groups if self.ranks.distributed else range(len(lines) // n + 1)
                    mine = [(groups[k // n], k % n, line) for k, line in enumerate(lines)]
                    if rollouts:
                        rollouts.write_lines(
                            [x[2] for x in sorted(y for part in self.ranks.gather(mine) for y in part)]
                        )
                    else:
                        self.ranks.gather(mine)
                if (
                    c.test_freq
                    and self.step % c.test_freq == 0
                    and self.step < self.total_steps
                    and self.val_samples
                ):
                    val = self.evaluate(progress=chunks)
                    metrics.update(val)
                    self._maybe_save_best(val)
                for lg in loggers:
                    lg.log(metrics, self.step)
                if c.save_freq and self.step % c.save_freq == 0:
                    self.save_checkpoint()
            if self.val_samples and (not self.history or self.history[-1]["step"] != self.step):
                val = self.evaluate(progress=chunks)
                for lg in loggers:
                    lg.log(val, self.step)
                self._maybe_save_best(val)
            self.save_checkpoint()
            if c.save_final:
                self._export(self.run_dir / "final", merge_lora=True, meta={"step": self.step})
        except KeyboardInterrupt:
            # Interrupted while generating or scoring, the weights are those of the last finished
            # step: save them with the state from before this step, so nothing finished is lost
            # and a resumed run redraws the same batch. Interrupted after a step (evaluating,
            # logging, saving), `_pre_step_state` is that step's own state (set at the end of
            # train_step). Mid-update, the weights are in between.
            pre = self._pre_step_state
            if self._updating:
                say("interrupted during an update: resume from the last saved checkpoint")
            elif pre is not None and pre["step"] > 0:
                path = self.save_checkpoint(pre)
                say(f"interrupted: saved {path}; run the same command to resume")
            else:
                say("interrupted before a step finished: nothing new to save")
            raise
        finally:
            for lg in loggers:
                lg.close()
            if rollouts:
                rollouts.close()
            if self.streaming is not None:
                self.streaming.close()
                self.streaming = None
            self.reward.close()
        summary = self.summary()
        if main and self._originals is not None and len(self._eval_images) >= 2:
            (first, before), (last, after) = self._eval_images[0], self._eval_images[-1]
            summary["image_report"] = write_report(
                self.run_dir / "report", self._originals, before, after, (first, last)
            )
            say(summary["image_report"] + f" (report: {self.run_dir / 'report' / 'grid.png'})")
        if main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        say(summary["line"])
        self.ranks.close()
        return summary

    def summary(self) -> dict:
        first = self.history[0] if self.history else {}
        last = self.history[-1] if self.history else {}
        # a baseline is an evaluation of the starting model (none with val_before_train=false)
        base = first.get("val/accuracy") if first.get("step") == 0 else None
        final = last.get("val/accuracy")
        if base is not None and final is not None:
            line = f"eval accuracy: baseline {base:.2f} -> final {final:.2f} ({final - base:+.2f}) after {self.step} steps"
        elif final is not None:
            line = f"eval accuracy: final {final:.2f} after {self.step} steps (no baseline evaluation)"
        else:
            line = f"trained {self.step} steps (no held-out split to evaluate)"
        return {
            "line": line,
            "steps": self.step,
            "baseline": base,
            "final": final,
            "history": self.history,
            "counters": self.counters,
            "run_dir": str(self.run_dir),
        }


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.split('/', 1)[-1]}={v:.3f}" for k, v in metrics.items() if not k.startswith("time/"))
