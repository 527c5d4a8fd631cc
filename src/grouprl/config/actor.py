"""The algorithm section (advantages, KL in the reward, the rollout importance correction) and
the actor section (the policy update and its optimizer). Names of estimators, losses and
aggregation modes are checked against the registries of `grouprl.algorithms`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need, one_of


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, grpo_batch."""
    norm_adv_by_std: bool = True
    """Divide by the group std (False = Dr. GRPO)."""
    adv_epsilon: float = 1e-6
    """Added to the std before dividing."""
    kl_coef: float = 0.0
    """KL penalty subtracted from the reward; loads a reference."""
    kl_penalty: str = "k1"
    """KL estimator for the reward penalty: k1, abs, k2, k3."""
    ref_refresh_steps: int = 0
    """Copy the policy into the reference model every N steps (0 = never)."""
    rollout_is: Literal["auto", "off", "token", "sequence", "geometric"] = "auto"
    """Importance correction of engine samples by pi_old / pi_rollout: per token, per sequence (the product) or geometric (the per-token mean, per sequence); auto = token wherever the engine's numbers can differ from the trainer's (bf16/fp16 generation or update, bf16 weights, vLLM), off where they cannot (everything float32 on the built-in engine)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: weight the loss by min(ratio, rollout_is_cap) (TIS); mask: tokens or sequences whose ratio leaves [rollout_is_lower, rollout_is_cap] leave the loss and its denominator, the rest are weighted by their ratio."""
    rollout_is_cap: float = 2.0
    """Upper bound of the importance ratio: the cap (truncate) or the upper edge kept (mask)."""
    rollout_is_lower: float = 0.0
    """mask mode: the lower edge kept; 0 = 1 / rollout_is_cap."""
    mismatch_threshold: float = 0.1
    """Engine-vs-trainer log-prob difference above which a token counts in rollout/mismatch_above_threshold."""

    def __post_init__(self) -> None:
        from grouprl.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

        one_of("algorithm.adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATORS)
        one_of("algorithm.kl_penalty", self.kl_penalty, KL_ESTIMATORS)
        need(self.rollout_is_cap > 0, "config key 'algorithm.rollout_is_cap' must be > 0")
        need(
            0 <= self.rollout_is_lower < self.rollout_is_cap,
            "config key 'algorithm.rollout_is_lower' must be in [0, algorithm.rollout_is_cap) (0 = 1 / rollout_is_cap)",
        )
        need(
            self.rollout_is_mode != "mask" or self.rollout_is_cap > 1 > (self.rollout_is_lower or 1 / self.rollout_is_cap),
            "config key 'algorithm.rollout_is_cap' must be > 1 and 'algorithm.rollout_is_lower' < 1 with "
            "rollout_is_mode=mask (a band around ratio 1; otherwise even exact samples leave the loss)",
        )
        need(
            self.ref_refresh_steps >= 0,
            f"config key 'algorithm.ref_refresh_steps' must be >= 0, got {self.ref_refresh_steps!r}",
        )


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps; wins over warmup_ratio when > 0."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of total steps."""
    scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak, for cosine/linear."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""

    def check(self, key: str) -> None:
        """The optimizer's settings, named under `key` (actor.optim, sft.optim): the section that
        holds it calls this, since the same settings sit in two sections."""
        need(self.warmup_steps >= 0, f"config key '{key}.warmup_steps' must be >= 0, got {self.warmup_steps!r}")
        need(0 <= self.min_lr_ratio <= 1, f"config key '{key}.min_lr_ratio' must be in [0, 1]")
        need(self.lr > 0, f"config key '{key}.lr' must be > 0")
        need(0 <= self.warmup_ratio < 1, f"config key '{key}.warmup_ratio' must be in [0, 1)")
        need(len(self.betas) == 2, f"config key '{key}.betas' must be two numbers")


@dataclass
class ActorConfig:
    policy_loss: str = "gspo"
    """Policy loss: gspo, ppo (verl's vanilla), cispo (clipped, detached importance weights; every token keeps its gradient), sapo (a smooth gate for the clip: sapo_tau_pos / sapo_tau_neg) or gmpo (geometric-mean ratio per sequence, clip_low / clip_high in log space; verl's geo_mean)."""
    clip_low: float = 3e-4
    """Lower clip: ratio >= 1 - clip_low."""
    clip_high: float = 4e-4
    """Upper clip: ratio <= 1 + clip_high."""
    dual_clip: float | None = 3.0
    """PPO dual-clip bound for negative advantages (None = off)."""
    sapo_tau_pos: float = 1.0
    """policy_loss=sapo: the gate's temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """policy_loss=sapo: the gate's temperature for negative advantages."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    loss_scale_factor: int = 0
    """seq-mean-token-sum-norm: the constant the token sum is divided by; 0 = the configured response length (rollout.max_response_length; for agents agent.max_response_tokens, else agent.max_turns x rollout.max_response_length)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    mini_batch_size: int = 0
    """Prompts per optimizer step; 0 = the whole batch, one step."""
    micro_batch_size: int = 8
    """Samples per forward/backward (gradient accumulation inside a mini-batch)."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Token budget per forward/backward instead of a sample count (dynamic batch size, verl's ppo_max_token_len_per_gpu; 0 = off: micro_batch_size rows). auto: on CUDA 16384 tokens (at least the longest sequence), on a CPU off."""
    kl_loss_coef: float = 0.0
    """KL-to-reference loss weight; loads a reference when > 0."""
    kl_loss_type: str = "k3"
    """KL estimator for the loss term: k1, abs, k2, k3."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    shared_prefix: bool = True
    """Run each group's shared prompt once in forward/backward and reuse its KV cache."""
    shared_opening: bool = True
    """With shared_prefix: the opening all of a mini-batch's prompts share (system prompt, example
    turns; 16 tokens or more) runs once for all its groups, their prompts' rest on top of it."""
    lean_mlp: bool = True
    """On a CPU, gated MLPs keep gate(x) and up(x) for backward and recompute the activation and product
    (two [tokens, intermediate] tensors per layer less; same numbers)."""
    lean_norm: bool = True
    """On a CPU, RMSNorms keep their input and reciprocal RMS for backward and recompute the normalised
    input (one [tokens, hidden] tensor per norm less; same numbers)."""
    lean_attention: bool = True
    """On CPU, grouped-query attention runs on the unrepeated keys/values with one float mask per
    forward (torch's kernel takes both); keys, values and mask are kept once (same numbers)."""
    update_malloc_trim: bool = True
    """Before each backward, give the pages of malloc's free chunks back to the OS (Linux/glibc):
    lowers the peak RSS (freed activations otherwise stay resident) for a few percent of update time."""
    update_trim_every_layers: int = 5
    """With update_malloc_trim, also give them back when backward reaches every this many decoder
    layers (what backward frees inside one micro-batch), and under FSDP after as many layers' forward
    (their gathered weights' buffers); 0 = before each backward only."""
    update_mmap_threshold_kb: int = 0
    """During the update, malloc blocks of this size and more that its heap has no room for are
    mmapped and unmapped when freed (Linux/glibc): the lowest peak RSS, but fresh pages are
    faulted in for every such block (1024: -0.25 GiB more than trimming, ~+25% update time on a
    2-core CPU). 0 = malloc's default."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision: bfloat16 = autocast over float32 weights; auto = bfloat16 where native (CUDA, AVX512-BF16/AMX CPUs)."""
    logits_chunk_size: int = 256
    """Response positions per chunk when computing log-probs (bounds the [tokens, vocab] tensor)."""
    fsdp_reduce_dtype: Literal["compute", "float32"] = "float32"
    """Several ranks (FSDP2): dtype of the gradient reduction; float32 keeps it exact under bf16 compute."""
    fsdp_reduce_every: int = 1
    """Several ranks (FSDP2): micro-batches between reduce-scatters of the gradients into the shards; 1 holds only sharded gradients (ZeRO-3), k > 1 keeps whole gradients between reductions and communicates k times less (for when the network is the bottleneck), 0 = once per mini-batch."""
    fsdp_offload: bool = False
    """Several ranks on GPUs (FSDP2): keep sharded parameters, gradients and optimizer state in host memory (ranks on a CPU hold them there already: no effect)."""
    reference_offload: bool | Literal["auto"] = "auto"
    """The KL reference's weights in host memory except during its log-prob pass (once a step), so generation and the update have the device's memory; auto = on CUDA (verl's examples offload the reference beside a colocated vLLM). On a CPU the host is the device: nothing moves."""
    optimizer_offload: bool = False
    """AdamW's state (twice the trainable weights) in host memory outside the update: generation runs without it, the update brings it back (a copy each way per step). On a CPU nothing moves."""
    fsdp_size: int = -1
    """Several ranks (FSDP2): ranks one copy of the model is sharded over; -1 = all of them. Fewer
    (e.g. the GPUs of one node) shard within groups of that many ranks and replicate across the
    groups (hybrid sharding); 1 replicates the whole model on every rank (data parallel only)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""

    def __post_init__(self) -> None:
        from grouprl.algorithms import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES

        one_of("actor.policy_loss", self.policy_loss, POLICY_LOSSES)
        need(
            self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0,
            "config keys 'actor.sapo_tau_pos' and 'actor.sapo_tau_neg' must be > 0",
        )
        one_of("actor.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        one_of("actor.kl_loss_type", self.kl_loss_type, KL_ESTIMATORS)
        need(self.clip_low >= 0 and self.clip_high >= 0, "config keys 'actor.clip_low/clip_high' must be >= 0")
        need(
            self.dual_clip is None or self.dual_clip > 1.0,
            f"config key 'actor.dual_clip' must be > 1.0 or null, got {self.dual_clip!r}",
        )
        need(self.ppo_epochs >= 1, "config key 'actor.ppo_epochs' must be >= 1")
        need(self.loss_scale_factor >= 0, "config key 'actor.loss_scale_factor' must be >= 0 (0 = the response length)")
        need(self.micro_batch_size >= 1, "config key 'actor.micro_batch_size' must be >= 1")
        need(self.update_trim_every_layers >= 0, "config key 'actor.update_trim_every_layers' must be >= 0 (0 = off)")
        need(
            self.micro_batch_tokens == "auto" or self.micro_batch_tokens >= 0,
            "config key 'actor.micro_batch_tokens' must be >= 0 (0 = off) or auto",
        )
        need(self.logits_chunk_size >= 1, "config key 'actor.logits_chunk_size' must be >= 1")
        need(self.fsdp_reduce_every >= 0, "config key 'actor.fsdp_reduce_every' must be >= 0 (0 = once per mini-batch)")
        need(self.fsdp_size == -1 or self.fsdp_size >= 1, "config key 'actor.fsdp_size' must be -1 (all ranks) or >= 1")
        # 0 means "the whole batch": a negative value divides any batch and then skips every update
        need(self.mini_batch_size >= 0, f"config key 'actor.mini_batch_size' must be >= 0, got {self.mini_batch_size!r}")
        self.optim.check("actor.optim")

