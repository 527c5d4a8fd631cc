"""The learning half of a step: a scored StepBatch in, the policy updated and pushed to the
engine, what it measured out (`Learned`). In order: the update's tensors (old and reference
log-probs, importance masking, KL-shaped rewards, advantages), the update (ppo_epochs x
mini-batches, update.py), the engine-trainer mismatch figures, the weight push, the batch's
figures."""

from __future__ import annotations

import dataclasses
import time
from types import MappingProxyType

import numpy as np
import torch

from grouprl.algorithms import (
    TURN_SUMS,
    compute_advantages,
    kl_estimate,
    logprob_mismatch,
    turn_mismatch_sums,
)
from grouprl.config import Config
from grouprl.devices import release_cached_memory
from grouprl.trainer.metric_parts import merge
from grouprl.trainer.parallel import state_gb
from grouprl.trainer.parts import LearnParts
from grouprl.trainer.step_batch import Learned, StepBatch
from grouprl.trainer.update import StepTensors, build_step_tensors


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux reports KiB


class Learner:
    """Turns a StepBatch into an update of the policy and pushes the new weights to the engine."""

    def __init__(self, cfg: Config, parts: LearnParts):
        """`parts`: what learn reads (the policy and reference, updater, optimizer and
        scheduler, the engine the weights go to, the ranks)."""
        self.cfg, self.p = cfg, parts
        self.ranks = parts.ranks
        self.updating = False  # between the first optimizer step and the push: weights in between

    def ref_log_probs(self, tensors):
        p = self.p
        return p.reference.log_probs(p.updater, p.model, p.policy, tensors)

    def learn(self, batch: StepBatch) -> Learned:
        """Advantages, the update (ppo_epochs x mini-batches), the mismatch figures and the push:
        what learning measured, this rank's (the trainer reduces the step's metrics over the
        ranks), and each real trajectory's advantage for the logs."""
        p = self.p
        t_start = time.perf_counter()
        # several ranks on a CPU: what generation gathered whole goes back first (the malloc heap
        # would keep it resident into the update); on CUDA the push releases the allocator's cache
        if p.device.type == "cpu" and p.ranks.distributed and self.cfg.actor.update_malloc_trim:
            release_cached_memory(p.device)
        p.meter.start()  # the update phase's peak (perf/peak_gb/update)
        tensors, rewards, kl_seq = self.step_tensors(batch)
        t_prep = time.perf_counter()
        self.updating = True
        with p.optimizer_parked.present():  # in host memory outside the update (actor.optimizer_offload)
            update = p.updater.update(p.policy, p.optimizer, p.scheduler, tensors, len(batch.groups), p.params)
        t_update = time.perf_counter()
        correction = {}
        if tensors.rollout_log_probs is not None:  # vLLM's own copy, or the hf engine's record
            # on policy the update took its own first pass's log-probs as old
            old = update.old_log_probs if update.old_log_probs is not None else tensors.old_log_probs
            correction = self.rollout_correction(tensors, old)
        pushed = self.push(batch)
        t_synced = time.perf_counter()
        self.updating = False
        advantages = tensors.advantages[: len(batch.real_trajectories)].tolist()
        times = {
            "time/old_ref_log_probs": t_prep - t_start,
            "time/update": t_update - t_prep,
            "time/weight_sync": t_synced - t_update,
            "perf/tokens_per_s": self.tokens(batch) / max(t_synced - batch.started, 1e-9),
            "perf/peak_rss_gb": peak_rss_gb(),
            "perf/state_gb": state_gb(p.model, p.optimizer),
        }
        if torch.cuda.is_available() and p.device.type == "cuda":
            times["perf/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1024**3
        figures = self.batch_figures(batch, advantages, rewards, kl_seq)
        metrics = merge(update.metrics, correction, pushed, figures, times, p.meter.measure("update"))
        return Learned(MappingProxyType(metrics), tuple(advantages), update.skipped_steps)

    def step_tensors(self, batch: StepBatch) -> tuple[StepTensors, torch.Tensor, torch.Tensor | None]:
        """The update's tensors, built once from what is known before it: the rows as sampled,
        their old and reference log-probs, the loss mask after importance masking, the
        advantages; and each row's reward (KL-penalised) and
        KL sum (None without algorithm.kl_coef)."""
        c, p = self.cfg, self.p
        trajectories = batch.trajectories
        sampled = build_step_tensors(
            trajectories, p.device, mask_truncated=c.rollout.mask_truncated, pad_token_id=p.engine.pad_token_id
        )
        # the trainer's own log-probs of the sampled tokens, when a loss is taken after a first
        # optimizer step or for a KL penalty; else the update's own first pass gives them (and,
        # against an engine with its own copy of the weights, keeps them for the mismatch metrics)
        old = None
        if p.updater.needs_old_log_probs(len(batch.groups), sampled) or c.algorithm.kl_coef > 0:
            old = p.updater.score_all(p.policy, sampled)
        # importance masking: what leaves the band leaves the loss mask (every term, every denominator)
        loss_mask, policy_mask = p.updater.reject(sampled, old)
        ref = self.ref_log_probs(sampled) if p.reference.active else None
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        kl_seq = None
        if c.algorithm.kl_coef > 0:  # KL as a reward penalty: r - beta * sum_t KL_t
            kl = kl_estimate(old, ref, c.algorithm.kl_penalty)
            kl_seq = (kl * loss_mask).sum(-1).cpu()
            rewards = rewards - c.algorithm.kl_coef * kl_seq
        advantages = self.advantages(rewards, len(batch.real_trajectories))
        tensors = dataclasses.replace(
            sampled,
            loss_mask=loss_mask,
            policy_mask=policy_mask,
            old_log_probs=old,
            ref_log_probs=ref,
            advantages=advantages.to(p.device),
        )
        return tensors, rewards, kl_seq

    def advantages(self, rewards: torch.Tensor, real_rows: int) -> torch.Tensor:
        """Each row's advantage within its group (n rows = one drawn prompt); a pad's is 0 (it is
        masked out of the loss anyway)."""
        a, n = self.cfg.algorithm, self.cfg.rollout.n_agent
        advantages = torch.zeros(len(rewards))
        if real_rows:
            advantages[:real_rows] = compute_advantages(
                a.adv_estimator,
                rewards[:real_rows],
                [k // n for k in range(real_rows)],
                norm_by_std=a.norm_adv_by_std,
                epsilon=a.adv_epsilon,
            )
        return advantages

    def push(self, batch: StepBatch) -> dict[str, float]:
        """The new weights to the engine (the next rollout samples from them), and how long the
        pushes that fed and follow this batch took (time/weight_push)."""
        c, p = self.cfg, self.p
        # the update's activations and gradients are gone: what the allocator keeps of them goes
        # back (CUDA's cached blocks, for vLLM's wake; a CPU's malloc heap, actor.update_malloc_trim)
        if p.device.type != "cpu" or c.actor.update_malloc_trim:
            release_cached_memory(p.device)
        p.engine.weights_updated(p.model)  # the next rollout samples from the new weights
        if batch.loaded is not None:  # asynchronous: the push into the generation copy, before the batch
            return {"time/weight_push": batch.loaded.push}
        # a synchronous run's pushes, wherever they ran (a sleeping engine pushes when it wakes)
        metrics = {}
        if batch.pushed_before is not None and not p.engine.reads_trainer_weights:
            metrics["time/weight_push"] = p.engine.push_seconds - batch.pushed_before
            metrics["perf/engine_freed_gb"] = p.engine.last_sleep_freed_bytes / 1024**3
        return metrics

    def tokens(self, batch: StepBatch) -> float:
        """The tokens this rank's real rows hold, prompts and responses (tokens per second add up
        over the ranks)."""
        n = self.cfg.rollout.n_agent
        generated = float(sum(len(t.response_ids) for t in batch.real_trajectories))
        return generated + sum(len(g.prompt) for g in batch.real_groups) * n

    def batch_figures(
        self, batch: StepBatch, advantages: list[float], rewards: torch.Tensor, kl_seq: torch.Tensor | None
    ) -> dict[str, float]:
        """The batch's advantages, lengths and KL over every rank's real rows (the same on every
        rank, whatever its share; pads left out), and this rank's generated tokens per second."""
        n = self.cfg.rollout.n_agent
        real = batch.real_trajectories
        own = {
            "adv": advantages,  # the real rows' (learn's)
            "length": [len(t.response_ids) for t in real],
            "truncated": [t.truncated for t in real],
            "flat": (rewards[: len(real)].view(-1, n).std(-1, unbiased=False) == 0).float().tolist(),
            "kl": kl_seq[: len(real)].tolist() if kl_seq is not None else [],
        }
        every = {key: [v for part in self.ranks.gather(own) for v in part[key]] for key in own}
        adv = torch.tensor(every["adv"])
        lengths = torch.tensor(every["length"], dtype=torch.float32)
        gen_tokens = float(sum(own["length"]))  # this rank's (tokens per second add up over the ranks)
        metrics = {
            "adv/mean": float(adv.mean()),
            "adv/std": float(adv.std()) if len(adv) > 1 else 0.0,
            "adv/max": float(adv.max()),
            "adv/min": float(adv.min()),
            "batch/zero_std_groups": float(torch.tensor(every["flat"]).mean()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_frac": float(np.mean(every["truncated"])),
            "perf/gen_tokens_per_s": gen_tokens / max(batch.metrics["time/generate"], 1e-9),
        }
        if kl_seq is not None:
            metrics["reward/kl_penalty"] = float(torch.tensor(every["kl"]).mean())
        return metrics

    def rollout_correction(self, tensors: StepTensors, old_log_probs: torch.Tensor) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's old ones (`old_log_probs`) on the
        policy's sampled tokens (gap, KL, chi-square; per turn for agents) and, with
        algorithm.rollout_is, what the correction did (mean weight, effective sample size,
        capped or masked share)."""
        a, p = self.cfg.algorithm, self.p
        old, rollout = old_log_probs.float(), tensors.rollout_log_probs.float()
        mask = tensors.policy_mask if tensors.policy_mask is not None else tensors.loss_mask
        found = logprob_mismatch(old, rollout, mask, a.mismatch_threshold)
        metrics = {
            f"rollout/{k if k.startswith(('kl_', 'chi2_')) else f'mismatch_{k}'}": float(v) for k, v in found.items()
        }
        if p.updater.rollout_is != "off":
            _, _, is_metrics = p.updater.correction(old_log_probs, tensors.rollout_log_probs, mask)
            metrics.update({f"rollout/is_{k}": v for k, v in is_metrics.items()})
        if self.cfg.agent.enabled:  # per policy turn, over every rank's tokens
            turns = self.cfg.agent.max_turns
            sums = turn_mismatch_sums(old, rollout, mask, tensors.loss_mask, turns)
            sums = torch.tensor(self.ranks.reduce(sums.flatten().tolist())).view(turns, len(TURN_SUMS))
            for k, row in enumerate(sums.tolist(), start=1):
                found = dict(zip(TURN_SUMS, row))
                if found["tokens"]:
                    n = found["tokens"]
                    metrics[f"rollout/mismatch_mean/turn_{k}"] = found["gap"] / n
                    metrics[f"rollout/kl_k1/turn_{k}"] = found["kl_k1"] / n
                    metrics[f"rollout/kl_k3/turn_{k}"] = found["kl_k3"] / n
                    if tensors.policy_mask is not None:  # mask mode: what the correction took out
                        metrics[f"rollout/is_masked_frac/turn_{k}"] = found["masked"] / n
        return metrics
