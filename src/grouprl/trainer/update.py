"""The policy update: ppo_epochs x mini-batches x micro-batches, one optimizer step per
mini-batch.

Micro-batch losses are weighted so that their sum equals the loss of the whole mini-batch
under the chosen aggregation mode (token-mean over all the mini-batch's tokens, not a mean
of micro-batch means), so gradient accumulation does not change the objective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from grouprl import cpu
from grouprl.algorithms import aggregate_loss, kl_estimate, policy_loss, rollout_correction
from grouprl.config import ActorConfig
from grouprl.devices import host_threads
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer import lockstep
from grouprl.trainer.head_stats import head_grad_into_param
from grouprl.trainer.logprobs import (
    OPENING_MIN_TOKENS,
    Prefix,
    ResponseBatch,
    block_masks,
    prefix_forward,
    prompt_keys,
    response_log_probs,
    shared_opening,
    unique_prompts,
)
from grouprl.trainer.micro_batches import PrefixUnit, plan_micro_batches
from grouprl.trainer.parallel import Ranks, full_tensor, reshard_root, run, set_gradient_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTensors:
    """A step's trajectories as padded tensors; rows stay in trajectory order (groups contiguous).
    Frozen: a stage that adds to them (the learner's old and reference log-probs, the masks
    after importance masking, the advantages) makes new ones with `dataclasses.replace`."""

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] real tokens
    loss_mask: torch.Tensor  # [N, R] policy tokens that enter the loss
    advantages: torch.Tensor | None = None  # [N]: the learner's, once the rewards are known
    old_log_probs: torch.Tensor | None = None  # [N, R]
    ref_log_probs: torch.Tensor | None = None  # [N, R]
    rollout_log_probs: torch.Tensor | None = None  # [N, R] the engine's, when it reports them
    # [N, R] the policy's sampled tokens before importance masking took some out of loss_mask
    # (algorithm.rollout_is_mode=mask); None when nothing was masked
    policy_mask: torch.Tensor | None = None
    # VLM policies: each row's images (prompt's, response's), the very inputs generation ran
    prompt_images: list[list] | None = None
    response_images: list[list] | None = None

    def rows(self, index: list[int]) -> ResponseBatch:
        idx = torch.tensor(index, device=self.response_ids.device)
        pick = lambda rows: [rows[i] for i in index] if rows is not None else None  # noqa: E731
        return ResponseBatch(
            [self.prompt_ids[i] for i in index],
            self.response_ids[idx],
            self.response_mask[idx],
            prompt_images=pick(self.prompt_images),
            response_images=pick(self.response_images),
        )


def build_step_tensors(
    trajectories: list[Trajectory], device, *, mask_truncated: bool, pad_token_id: int, width: int = 0,
    advantages: list[float] | None = None,
) -> StepTensors:
    """`width`: pad the responses to at least this length (the longest of every rank's);
    `advantages`: each row's, where already known (the learner adds them once it has the rewards)."""
    n = len(trajectories)
    width = max(1, width, max(len(t.response_ids) for t in trajectories))
    response_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    reported = all(t.rollout_log_probs is not None for t in trajectories)
    rollout_log_probs = torch.zeros((n, width), dtype=torch.float32) if reported else None
    for i, t in enumerate(trajectories):
        r = len(t.response_ids)
        if r == 0:
            continue
        response_ids[i, :r] = torch.tensor(t.response_ids)
        response_mask[i, :r] = 1
        if not (mask_truncated and t.truncated):
            loss_mask[i, :r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        if rollout_log_probs is not None:
            rollout_log_probs[i, :r] = torch.tensor(t.rollout_log_probs, dtype=torch.float32)
    with_images = any(t.prompt_images or t.response_images for t in trajectories)
    return StepTensors(
        prompt_images=[list(t.prompt_images) for t in trajectories] if with_images else None,
        response_images=[list(t.response_images) for t in trajectories] if with_images else None,
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=response_ids.to(device),
        response_mask=response_mask.to(device),
        loss_mask=loss_mask.to(device),
        rollout_log_probs=rollout_log_probs.to(device) if rollout_log_probs is not None else None,
        advantages=torch.tensor(advantages, dtype=torch.float32, device=device) if advantages is not None else None,
    )


@dataclass(frozen=True)
class Update:
    """What one update measured, and the log-probs it took as old when it was given none (on
    policy: its own first pass's, detached), for the mismatch metrics; None otherwise."""

    metrics: dict[str, float]
    old_log_probs: torch.Tensor | None = None  # [N, R]
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient


def batch_total(mode: str, mask: torch.Tensor) -> float:
    """What a mini-batch's loss is divided by: its loss tokens (token-mean), its non-empty rows
    (sequence means), nothing (seq-mean-token-sum-norm: a sum over tokens / a constant)."""
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "seq-mean-token-sum-norm":
        return 1.0
    return float((mask.sum(-1) > 0).sum())  # seq means count non-empty rows


def micro_batch_weight(mode: str, micro_mask: torch.Tensor, mini_total: float) -> float:
    """Factor that turns a micro-batch's aggregated loss into its share of the mini-batch loss
    (`mini_total`: batch_total of the whole mini-batch, over every rank)."""
    if mode == "seq-mean-token-sum-norm":  # shares add up (the same constant divisor)
        return 1.0
    return batch_total(mode, micro_mask) / max(mini_total, 1.0)


# Metrics that are token means over the micro-batch (not terms of the loss): the mini-batch's
# value is their token-weighted mean, whatever the aggregation mode.
TOKEN_MEAN_METRICS = frozenset({"actor/clipfrac", "actor/clipfrac_lower", "actor/ppo_kl"})


def split(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


class PolicyUpdater:
    """Owns nothing but the arithmetic of one update; the trainer owns model and optimizer."""

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        temperature: float,
        pad_token_id: int,
        skip_nonfinite: bool = True,
        compute_dtype: torch.dtype | None = None,
        rollout_is: str = "off",
        rollout_is_cap: float = 2.0,
        rollout_is_mode: str = "truncate",
        rollout_is_lower: float | None = None,
        norm_length: float | None = None,
        vision=None,
        ranks: Ranks | None = None,
        step_threads: int | None = None,
    ):
        """`rollout_is` ("off" | "token" | "sequence" | "geometric"): importance weights of an
        engine's samples (`StepTensors.rollout_log_probs`) against the old log-probs multiply
        each token's policy-gradient loss: capped at `rollout_is_cap` (`rollout_is_mode`
        "truncate"), or (mode "mask") tokens or sequences whose ratio leaves
        [`rollout_is_lower` (None: 1 / cap), `rollout_is_cap`] leave the loss (`reject`, before
        the update). `norm_length`: seq-mean-token-sum-norm's constant divisor. `step_threads`:
        the CPU threads the gradient clip and optimizer step run with (FSDP's offload: they run on
        host shards; None: the process's)."""
        if cfg.micro_batch_tokens == "auto":  # a run settles it for its device (memory.settle_for_devices)
            cfg = dataclasses.replace(cfg, micro_batch_tokens=0)  # an updater on its own counts rows
        self.cfg = cfg
        # several ranks: this one holds a block of whole groups of the step; loss weights are
        # global (over every rank's rows), gradients summed by FSDP's reduction
        self.ranks = ranks or Ranks()
        self.vision = vision  # the VLM family of the policy (grouprl.vision), None for text
        self.rollout_is, self.rollout_is_cap = rollout_is, rollout_is_cap
        self.rollout_is_mode, self.rollout_is_lower = rollout_is_mode, rollout_is_lower
        self.norm_length = norm_length
        self.compute_dtype = compute_dtype  # autocast dtype of forward passes (None = parameter dtype)
        self.skip_nonfinite = skip_nonfinite
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_token_id = pad_token_id
        self.step_threads = step_threads

    def log_probs(
        self,
        model,
        tensors: StepTensors | ResponseBatch,
        index: list[int] | None = None,
        *,
        with_entropy=False,
        prefix: Prefix | None = None,
        unit: PrefixUnit | None = None,
        opening: Prefix | None = None,
        vision=None,
    ):
        """Rows `index` of `tensors` (or a ResponseBatch as it is); with `prefix` (the prompts of
        `unit`, already run) only the responses run; with `opening` (see `opening_forward`) the
        prompts' common opening is not run again. `vision`: the family to run with (a pass's
        precomputed image features, lockstep.py), default the policy's."""
        batch = tensors.rows(index) if isinstance(tensors, StepTensors) else tensors
        with self._autocast(model):
            return run(
                model,
                response_log_probs,
                batch,
                shared_prefix=self.cfg.shared_prefix,
                temperature=self.temperature,
                with_entropy=with_entropy,
                chunk_size=self.cfg.logits_chunk_size,
                pad_token_id=self.pad_token_id,
                prefix=prefix,
                prefix_index=[unit.prompt_of_row[r] for r in index] if prefix is not None else None,
                opening=opening,
                vision=vision if vision is not None else self.vision,
            )

    def _autocast(self, model):
        """Mixed precision for forward passes only; backward runs outside, as autocast advises."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=next(model.parameters()).device.type, dtype=self.compute_dtype)

    def _prefix(self, model, unit: PrefixUnit, tensors: StepTensors, opening: Prefix | None = None, vision=None) -> Prefix:
        vision = vision if vision is not None else self.vision
        images = None
        if vision is not None and tensors.prompt_images is not None:
            row_of = {u: r for r, u in unit.prompt_of_row.items()}
            images = [tensors.prompt_images[row_of[u]] for u in range(len(unit.prompts))]
        with self._autocast(model):
            return run(model, prefix_forward, unit.prompts, self.pad_token_id, opening, vision, images)

    def opening_forward(self, model, tensors: StepTensors, rows: list[int]) -> Prefix | None:
        """The opening that the distinct prompts of `rows` share (a system prompt, example turns),
        run once for all their groups and micro-batches; None when off or too short to matter."""
        if not (self.cfg.shared_prefix and self.cfg.shared_opening):
            return None
        tokens = shared_opening([tensors.prompt_ids[r] for r in rows])
        if self.vision is not None:  # text only: it ends before the first image
            image = self.vision.image_token_id
            tokens = tokens[: next((i for i, t in enumerate(tokens) if t == image), len(tokens))]
            tokens = tokens if len(tokens) >= OPENING_MIN_TOKENS else []
        if not tokens:
            return None
        with self._autocast(model):
            return run(model, prefix_forward, [tokens], self.pad_token_id)

    def plan(self, tensors: StepTensors, rows: list[int]) -> list[PrefixUnit]:
        """Micro-batches of `rows` by row count or token budget (see micro_batches.py)."""
        return plan_micro_batches(
            rows,
            tensors.prompt_ids,
            tensors.response_mask.sum(-1).tolist(),
            max_rows=self.cfg.micro_batch_size,
            max_tokens=self.cfg.micro_batch_tokens,
            shared_prefix=self.cfg.shared_prefix,
            keys=prompt_keys(tensors.prompt_ids, tensors.prompt_images),
        )

    @torch.no_grad()
    def score_all(self, model, tensors: StepTensors) -> torch.Tensor:
        """Log-probs of every row without gradient (old or reference policy), [N, R], in the
        log-prob dtype (float32 for a bf16/fp32 model, float64 for a float64 one)."""
        with block_masks(model, self.cfg.shared_prefix):
            if self.ranks.distributed:  # sharded: passes in step with the other ranks'
                return self._score_in_step(model, tensors)
            with cpu.lean_scoring(model, self.cfg):
                return self._score_all(model, tensors)

    def _score_all(self, model, tensors: StepTensors) -> torch.Tensor:
        out = None
        rows = list(range(len(tensors.prompt_ids)))
        opening = self.opening_forward(model, tensors, rows)
        for unit in self.plan(tensors, rows):
            prefix = self._prefix(model, unit, tensors, opening) if len(unit.micro_batches) > 1 else None
            for index in unit.micro_batches:
                lp, _ = self.log_probs(model, tensors, index, prefix=prefix, unit=unit, opening=opening)
                if out is None:
                    out = lp.new_zeros(tensors.loss_mask.shape)
                out[index] = lp
        return out

    def _score_in_step(self, model, tensors: StepTensors) -> torch.Tensor:
        """`_score_all` on several ranks: one pass per micro-batch, as many on every rank
        (lockstep.py); the root's weights given back after (no backward does it)."""
        rows = list(range(len(tensors.prompt_ids)))
        micros = [m for unit in self.plan(tensors, rows) for m in unit.micro_batches]
        count, with_images = lockstep.pass_count(self.ranks, len(micros), self._with_images(tensors, rows))
        out = None
        for i in range(count):
            batch = tensors.rows(micros[i]) if i < len(micros) else self._pad_batch(tensors)
            images = self._pass_images(model, batch if i < len(micros) else None, with_images)
            lp, _ = self.log_probs(model, batch, vision=images.family if images else None)
            if i < len(micros):
                if out is None:
                    out = lp.new_zeros(tensors.loss_mask.shape)
                out[micros[i]] = lp
        reshard_root(model)
        return out

    def _pad_batch(self, tensors: StepTensors) -> ResponseBatch:
        return lockstep.pad_batch(self.pad_token_id, tensors.response_ids.device)

    def _pass_images(self, model, batch: ResponseBatch | None, with_images) -> lockstep.PassImages | None:
        """A pass's image features, computed first, when any rank's rows have images."""
        if not with_images:
            return None
        return lockstep.PassImages(model, self.vision, batch, self._autocast(model))

    def needs_old_log_probs(self, num_prompts: int, tensors: StepTensors | None = None) -> bool:
        """True when some loss is computed after an optimizer step: a second epoch, or a second
        mini-batch (also a last, smaller one: 3 prompts in mini-batches of 2 take two steps);
        or when importance masking must know, before the update, which samples leave the loss."""
        mini = self.cfg.mini_batch_size // self.ranks.world or num_prompts
        return self.cfg.ppo_epochs > 1 or mini < num_prompts or (tensors is not None and self.masks(tensors))

    def masks(self, tensors: StepTensors) -> bool:
        """Importance masking applies to these tensors (mask mode, the engine's log-probs known)."""
        return self.rollout_is != "off" and self.rollout_is_mode == "mask" and tensors.rollout_log_probs is not None

    def correction(self, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor):
        """(weights, keep, metrics) of the importance correction of the engine's samples
        (`rollout_log_probs`) against `old_log_probs`, over `mask`."""
        return rollout_correction(
            self.rollout_is,
            self.rollout_is_mode,
            old_log_probs.float(),
            rollout_log_probs.float(),
            mask,
            upper=self.rollout_is_cap,
            lower=self.rollout_is_lower,
        )

    def reject(
        self, tensors: StepTensors, old_log_probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss mask the update takes and the mask as sampled (`policy_mask`, None when
        nothing is masked), for tensors whose old log-probs are `old_log_probs`. Mask mode: the
        sampled tokens (or sequences) whose ratio pi_old / pi_rollout leaves the band leave the
        loss mask before the update, so they leave every term of the loss and its denominator
        (token or sequence count). `tensors` are read, never written."""
        if not self.masks(tensors):
            return tensors.loss_mask, None
        _, keep, _ = self.correction(old_log_probs, tensors.rollout_log_probs, tensors.loss_mask)
        return tensors.loss_mask * keep.to(tensors.loss_mask.dtype), tensors.loss_mask

    def update(self, model, optimizer, scheduler, tensors: StepTensors, num_prompts: int, params) -> Update:
        """ppo_epochs x mini-batches of `tensors` (this rank's rows of `num_prompts` groups), one
        optimizer step each; `tensors` are read, never written."""
        cfg = self.cfg
        n_rows = len(tensors.prompt_ids)
        mini_prompts = cfg.mini_batch_size // self.ranks.world  # this rank's share of a mini-batch
        if mini_prompts and mini_prompts < num_prompts:
            rows_per_mini = mini_prompts * (n_rows // max(num_prompts, 1))
        else:  # the whole batch in one step, even if groups are uneven (n_rows % num_prompts != 0)
            rows_per_mini = n_rows
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        # on-policy (no old log-probs given): the first pass's detached log-probs are the old
        # ones; against an engine's samples they are recorded, for the mismatch metrics
        recorded = None
        if tensors.old_log_probs is None and tensors.rollout_log_probs is not None:
            recorded = tensors.loss_mask.new_zeros(tensors.loss_mask.shape, dtype=torch.float32)
        with self._updating(model) as before_backward:
            model.train()
            lr_used = scheduler.get_last_lr()[0]  # the lr of this step's first optimizer step
            for _epoch in range(cfg.ppo_epochs):
                # groups stay whole inside a mini-batch: rows are in group order and the size is a
                # multiple of n_agent
                for mini in split(list(range(n_rows)), rows_per_mini):
                    optimizer.zero_grad(set_to_none=True)
                    micro_metrics = self._gradients(model, tensors, mini, before_backward, recorded)
                    with host_threads(self.step_threads):
                        grad_norm = self._clip(params)
                        finite = math.isfinite(grad_norm) and all(math.isfinite(v) for v in micro_metrics.values())
                        if finite or not self.skip_nonfinite:
                            optimizer.step()
                    if finite or not self.skip_nonfinite:
                        scheduler.step()
                    else:  # a NaN/inf loss or gradient would poison the weights: skip, warn, count
                        log.warning("non-finite loss or gradient norm (%s); optimizer step skipped", grad_norm)
                        sums["actor/skipped_steps"] += 1
                    optimizer.zero_grad(set_to_none=True)  # freed now, not held through the next rollout
                    for k, v in micro_metrics.items():
                        sums[k] += v
                        counts[k] += 1
                    sums["actor/grad_norm"] += grad_norm if math.isfinite(grad_norm) else 0.0
                    counts["actor/grad_norm"] += 1
        out = {k: v / counts[k] if counts.get(k) else v for k, v in sums.items()}
        out.setdefault("actor/skipped_steps", 0.0)
        out["actor/lr"] = lr_used
        return Update(out, recorded, int(sums.get("actor/skipped_steps", 0)))

    @contextlib.contextmanager
    def _updating(self, model):
        """Around an update: sdpa (flash kernels take no block masks); on a CPU the layers keep
        fewer activations and freed memory goes back to the OS (grouprl.cpu: it yields what runs
        before each backward; under FSDP the devices run inside the layers it wraps, which it
        gathers for their backward as for any); in one process the head's weight gradient goes
        straight into .grad (logprobs.py; FSDP reduces the gradient autograd gives it)."""
        with block_masks(model, self.cfg.shared_prefix), cpu.lean_update(model, self.cfg) as before_backward:
            if self.ranks.distributed:
                yield before_backward
                return
            with head_grad_into_param():
                yield before_backward

    def _gradients(
        self, model, tensors: StepTensors, mini: list[int], before_backward, recorded: torch.Tensor | None
    ) -> dict[str, float]:
        """One mini-batch's gradients, accumulated over its micro-batches (several ranks: reduced
        into the shards), and its metrics (the mini-batch's values, over every rank).
        `recorded`: where the on-policy old log-probs go (None: not kept)."""
        mini_mask = tensors.loss_mask[mini]
        # the mini-batch's tokens / rows over every rank: the loss weights are global
        totals = self.ranks.reduce([batch_total(self.cfg.loss_agg_mode, mini_mask), batch_total("token-mean", mini_mask)])
        micro_metrics: dict[str, float] = defaultdict(float)
        if self.ranks.distributed:
            self._passes_in_step(model, tensors, mini, recorded, totals, micro_metrics, before_backward)
            keys = sorted(micro_metrics)  # each rank's metrics are its share of the mini-batch's
            return defaultdict(float, zip(keys, self.ranks.reduce([micro_metrics[k] for k in keys])))
        # the opening all prompts share runs once: every micro-batch backpropagates into its
        # leaves, then the opening once, after all of them (likewise a group's prompt)
        opening = self.opening_forward(model, tensors, mini)
        opened = opening.detached() if opening is not None else None
        for unit in self.plan(tensors, mini):
            # a group split over several micro-batches runs its prompt once: the micro-batches
            # backpropagate into the prefix's leaves, then the prefix once
            prefix = self._prefix(model, unit, tensors, opened) if len(unit.micro_batches) > 1 else None
            leaves = prefix.detached() if prefix is not None else None
            for micro in unit.micro_batches:
                loss, m = self._micro_loss(model, tensors, micro, leaves, unit, opened, recorded)
                weight = self._account(micro_metrics, tensors, micro, m, totals)
                if weight > 0:
                    before_backward()
                    (loss * weight).backward()
            if prefix is not None:
                prefix.backward_from(leaves)
                del prefix, leaves
        if opening is not None:
            opening.backward_from(opened)
        return micro_metrics

    def _passes_in_step(
        self, model, tensors: StepTensors, mini: list[int], recorded, totals, micro_metrics, before_backward
    ) -> None:
        """Several ranks: each micro-batch one pass, as many passes on every rank (the others'
        padded with passes of zero weight) and, when any rank's rows have images, the tower run
        first in every pass (lockstep.py); each pass's backward reduce-scatters its gradients
        into the shards (every actor.fsdp_reduce_every passes). FSDP averages over the ranks:
        the weights are times the world size."""
        micros = [m for unit in self.plan(tensors, mini) for m in unit.micro_batches]
        count, with_images = lockstep.pass_count(self.ranks, len(micros), self._with_images(tensors, mini))
        every = self.cfg.fsdp_reduce_every or count
        pad = self._pad_tensors(tensors) if count > len(micros) else None
        try:
            for i in range(count):
                set_gradient_sync(model, (i + 1) % every == 0 or i == count - 1)
                rows, source = (micros[i], tensors) if i < len(micros) else ([0], pad)
                images = self._pass_images(model, source.rows(rows) if source is tensors else None, with_images)
                vision = images.family if images is not None else None
                unit = self._pass_unit(source, rows)
                # the prompts run first, on their own: their weights' gradients are reduced by their
                # own backward, after the responses' (one graph through both would hold every
                # layer's response gradients whole until the prompts' backward reached it)
                prefix = self._prefix(model, unit, source, vision=vision) if self.cfg.shared_prefix else None
                leaves = prefix.detached() if prefix is not None else None
                loss, m = self._micro_loss(model, source, rows, leaves, unit, None, recorded if source is tensors else None, vision)
                if source is tensors:
                    loss = loss * (self._account(micro_metrics, tensors, rows, m, totals) * self.ranks.world)
                else:
                    loss = loss * 0.0
                if loss.requires_grad:  # nothing trainable ran: no rank has a gradient to reduce
                    before_backward()
                    loss.backward()
                if prefix is not None:
                    prefix.backward_from(leaves)
                    del prefix, leaves
                if images is not None:
                    images.backward()
        finally:
            set_gradient_sync(model, True)

    def _pass_unit(self, tensors: StepTensors, rows: list[int]) -> PrefixUnit:
        """A micro-batch as a unit of its own: its rows' distinct prompts."""
        keys = prompt_keys(tensors.prompt_ids, tensors.prompt_images)
        prompts, index = unique_prompts([tensors.prompt_ids[r] for r in rows], [keys[r] for r in rows] if keys else None)
        return PrefixUnit(prompts, [rows], dict(zip(rows, index)))

    def _pad_tensors(self, tensors: StepTensors) -> StepTensors:
        """One row of one pad token after a one-token prompt: a pass of zero weight."""
        batch = lockstep.pad_batch(self.pad_token_id, tensors.response_ids.device)
        mask = batch.response_mask.float()
        images = [[]] if tensors.prompt_images is not None else None
        return StepTensors(
            batch.prompt_ids, batch.response_ids, batch.response_mask, mask, mask.new_zeros(1),
            old_log_probs=mask.new_zeros(1, 1) if tensors.old_log_probs is not None else None,
            ref_log_probs=mask.new_zeros(1, 1) if tensors.ref_log_probs is not None else None,
            rollout_log_probs=mask.new_zeros(1, 1) if tensors.rollout_log_probs is not None else None,
            policy_mask=mask if tensors.policy_mask is not None else None,
            prompt_images=images, response_images=images,
        )  # fmt: skip

    def _account(self, micro_metrics: dict, tensors: StepTensors, micro: list[int], metrics: dict, totals) -> float:
        """The micro-batch's weight in the mini-batch's loss; its metrics added at their share."""
        weight = micro_batch_weight(self.cfg.loss_agg_mode, tensors.loss_mask[micro], totals[0])
        token_share = micro_batch_weight("token-mean", tensors.loss_mask[micro], totals[1])
        for k, v in metrics.items():
            micro_metrics[k] += v * (token_share if k in TOKEN_MEAN_METRICS else weight)
        return weight

    def _with_images(self, tensors: StepTensors, rows: list[int]) -> bool:
        """Some of `rows` shows the policy an image (in its prompt or a later turn)."""
        parts = [p for p in (tensors.prompt_images, tensors.response_images) if p is not None]
        return self.vision is not None and any(p[r] for p in parts for r in rows)

    def _clip(self, params) -> float:
        clip = self.cfg.optim.grad_clip
        if clip > 0:
            return float(full_tensor(torch.nn.utils.clip_grad_norm_(params, clip)))
        grads = [full_tensor(p.grad).norm() for p in params if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def _micro_loss(
        self, model, tensors: StepTensors, micro: list[int], prefix=None, unit=None, opening=None, recorded=None, vision=None
    ):
        cfg = self.cfg
        want_entropy = cfg.entropy_coef != 0
        log_probs, entropy = self.log_probs(
            model, tensors, micro, with_entropy=want_entropy, prefix=prefix, unit=unit, opening=opening, vision=vision
        )
        loss_mask = tensors.loss_mask[micro]
        old = tensors.old_log_probs[micro] if tensors.old_log_probs is not None else log_probs.detach()
        if recorded is not None:  # on policy: the old log-probs this update took, kept
            recorded[micro] = old.float()
        weights = None
        if self.rollout_is != "off" and tensors.rollout_log_probs is not None:  # per row: exact per micro-batch
            if self.rollout_is_mode == "mask" and tensors.policy_mask is None:
                raise RuntimeError("importance masking needs PolicyUpdater.reject's masks before the update")
            weights, _, _ = rollout_correction(
                self.rollout_is,
                self.rollout_is_mode,
                old.float(),
                tensors.rollout_log_probs[micro].float(),
                loss_mask,
                upper=self.rollout_is_cap,
                lower=self.rollout_is_lower,
            )
        pg_loss, m = policy_loss(
            cfg.policy_loss,
            log_probs,
            old,
            tensors.advantages[micro],
            loss_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip,
            agg_mode=cfg.loss_agg_mode,
            token_weights=weights,
            norm_length=self.norm_length,
            tau_pos=cfg.sapo_tau_pos,
            tau_neg=cfg.sapo_tau_neg,
        )
        metrics = {"actor/pg_loss": float(pg_loss.detach()), **{f"actor/{k}": v for k, v in m.items()}}
        loss = pg_loss
        if want_entropy:
            ent = aggregate_loss(entropy, loss_mask, cfg.loss_agg_mode, norm_length=self.norm_length)
            loss = loss - cfg.entropy_coef * ent
            metrics["actor/entropy"] = float(ent.detach())
        if cfg.kl_loss_coef > 0 and tensors.ref_log_probs is not None:
            kl = aggregate_loss(
                kl_estimate(log_probs, tensors.ref_log_probs[micro], cfg.kl_loss_type),
                loss_mask,
                cfg.loss_agg_mode,
                norm_length=self.norm_length,
            )
            loss = loss + cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = float(kl.detach())
        metrics["actor/loss"] = float(loss.detach())
        return loss, metrics
