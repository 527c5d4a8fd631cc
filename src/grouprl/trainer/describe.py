"""What `grouprl train --dry-run` prints: a run's plan in words (batch, update, rollout, rewards,
policy, episode, data, run files) and its memory plan, read from the config (and the data files'
columns, and model.path's config.json); nothing is loaded."""

from __future__ import annotations

import os
from pathlib import Path


def describe_correction(cfg) -> str:
    """The importance correction of engine samples, in words (auto resolves on the device)."""
    a = cfg.algorithm
    if a.rollout_is == "off":
        return "off"
    level = "token" if a.rollout_is == "auto" else a.rollout_is
    if a.rollout_is_mode == "truncate":
        how = f"{level} ratios truncated at {a.rollout_is_cap:g}"
    else:
        lower = a.rollout_is_lower or 1 / a.rollout_is_cap
        how = f"{level} ratios outside [{lower:.4g}, {a.rollout_is_cap:g}] leave the loss"
    if a.rollout_is != "auto":
        return how
    return how + " wherever the engine's numbers can differ from the update's (bf16, vLLM); off in float32 on the built-in engine"


def describe_rollout(cfg) -> str:
    """Where generation runs: the engine, and with vLLM one engine per rank (WORLD_SIZE: the
    launcher's, e.g. a dry run under torchrun), its memory share and sleep between rollouts."""
    r = cfg.rollout
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    ranks = f"on each of the {world} ranks" if world > 1 else "on every rank (one here; torchrun/Ray: one per rank)"
    where = (
        f"in an engine process of its own on {r.engine_device or 'the trainer device'} (weights over its pipe, NCCL between GPUs)"
        if r.engine_process
        else f"in an engine process of the engine service at {r.engine_address} (weights over the authenticated connection, NCCL between GPUs)"
        if r.engine_address
        else "on a thread of its own"
    )
    ahead = (
        f"; asynchronous: up to {r.max_staleness} step(s) ahead of the update ({r.async_schedule}), {where} "
        "over a whole copy of the policy on each rank"
        if r.max_staleness
        else ""
    )
    if r.engine == "auto":  # not settled (the model's config could not be read)
        return f"rollout: auto (vLLM on CUDA where installed, else the built-in engine), {ranks}{ahead}"
    if r.engine == "hf":
        weights = "a copy of the policy" if r.max_staleness else "the trainer's own weights"
        return f"rollout: built-in engine over {weights}, {ranks}{ahead}"
    memory = f"KV cache {r.kv_cache_gb:g} GiB" if r.kv_cache_gb else f"{r.gpu_memory_utilization:.0%} of the GPU"
    sleep = {0: "awake throughout", 1: "weights to host memory", 2: "weights and KV cache freed"}[r.sleep_level]
    return (
        f"rollout: vLLM in-process, one engine {ranks}, on that rank's GPU with the whole model (tensor parallel "
        f"{r.tensor_parallel_size}), {memory}; between rollouts (CUDA) sleep level {r.sleep_level}: {sleep}; "
        f"{'eager' if r.enforce_eager else 'CUDA graphs'}{ahead}"
    )


def describe_rewards(cfg) -> list[str]:
    """What each rule or user reward reads (its file imported, its signature checked: a missing
    file, function or argument is the dry run's one error line), and a warning for a reward that
    reads the ground truth of a data file that has none (it would fail on every call)."""
    from grouprl.data.layout import REFERENCE_COLUMNS, layout_of, peek
    from grouprl.rewards.composite import describe_components

    truthless, kinds = [], set()
    for f in [*cfg.data.train_files, *cfg.data.val_files]:
        if Path(f).is_file():
            columns, _, truth = peek(Path(f))
            kind = layout_of(columns, "rl")
            kinds.add(kind)
            reference = any(c in columns for c in REFERENCE_COLUMNS)  # TRL's datasets
            if (kind == "verl" and not truth and not reference) or (kind == "plain" and "answer" not in columns):
                truthless.append(f)
    # where each piece of a reward's context comes from in the data files' layouts
    column = {
        "ground_truth": {"verl": "reward_model.ground_truth", "plain": "answer"},
        "extra_info": {"verl": "extra_info", "plain": "the row's other columns"},
        "prompt": {"verl": "prompt's last user turn", "plain": "question"},
    }
    lines = []
    for name, spec, reads in describe_components(cfg.reward):
        if reads is None:
            shown = "everything (**kwargs)"
        else:
            shown = ", ".join(
                f"{r} ({' / '.join(column[r][k] for k in sorted(kinds) if k in column[r])})"
                if r in column and kinds & set(column[r]) else r
                for r in sorted(reads)
            ) or "nothing"
        lines.append(f"reward {name}: {spec} reads {shown}")
        if truthless and reads is not None and "ground_truth" in reads:  # named, not only through **kwargs
            lines.append(
                f"WARNING: reward {name} reads the ground truth, which {', '.join(truthless)} lacks "
                "(plain layout: an answer column; verl layout: reward_model.ground_truth): there it gets None"
            )
    return lines


def describe_plan(cfg) -> list[str]:
    """What a run would do, without loading a model."""
    return [
        *_describe_update(cfg),
        *_describe_policy(cfg),
        *_describe_episode(cfg),
        *_describe_data(cfg),
        *_describe_run(cfg),
    ]


def _describe_update(cfg) -> list[str]:
    """The batch, the update's steps, the loss, the learning rate, lengths, rollout and correction."""
    b, n = cfg.data.train_batch_size, cfg.rollout.n_agent
    mini = cfg.actor.mini_batch_size or b
    mini_samples = mini * n
    t = cfg.trainer  # the ranks the plan is for: the cluster it names, else the launcher's
    world = t.nnodes * t.n_gpus_per_node if t.n_gpus_per_node else int(os.environ.get("WORLD_SIZE", "1") or 1)
    share = -(-mini_samples // world)  # each rank holds its part of a mini-batch
    accum = -(-share // cfg.actor.micro_batch_size)
    ranks = f" on each of the {world} ranks ({share} samples each)" if world > 1 else ""
    micro = (
        f"micro-batches: <= {cfg.actor.micro_batch_tokens} tokens each (dynamic), groups split when needed"
        if cfg.actor.micro_batch_tokens
        else f"micro-batches: {cfg.actor.micro_batch_size} samples -> {accum} accumulation step(s) per mini-batch{ranks}"
    )
    lines = [
        f"batch: {b} prompts x {n} samples = {b * n} trajectories per step",
        f"update: {cfg.actor.ppo_epochs} epoch(s) x {b // mini} mini-batch(es) of {mini} prompts "
        f"({mini_samples} samples) = {cfg.actor.ppo_epochs * (b // mini)} optimizer steps per training step",
        micro,
        f"loss: {cfg.actor.policy_loss} (clip {1 - cfg.actor.clip_low:g}..{1 + cfg.actor.clip_high:g}, "
        f"{cfg.actor.loss_agg_mode}), advantages: {cfg.algorithm.adv_estimator}"
        f"{'' if cfg.algorithm.norm_adv_by_std else ' (no std normalisation)'}",
        f"lr: {cfg.actor.optim.lr:g} ({cfg.actor.optim.scheduler}, warm-up "
        f"{cfg.actor.optim.warmup_steps or f'{cfg.actor.optim.warmup_ratio:.0%}'}), grad clip {cfg.actor.optim.grad_clip:g}",
        f"lengths: prompt <= {cfg.data.max_prompt_length} ({cfg.data.prompt_overflow}), response <= "
        f"{cfg.rollout.max_response_length} tokens",
    ]
    lines.append(describe_rollout(cfg))
    lines.append(f"engine-trainer correction: {describe_correction(cfg)}")
    if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode == "token-mean":
        lines.append("WARNING: gspo with token-mean weighs a sequence by its length (GSPO's own is seq-mean-token-mean)")
    if cfg.actor.policy_loss in ("sapo", "gmpo", "geo_mean") and cfg.actor.loss_agg_mode != "seq-mean-token-mean":
        lines.append(
            f"WARNING: {cfg.actor.policy_loss} with {cfg.actor.loss_agg_mode}: verl reduces it as seq-mean-token-mean "
            "(one term per sequence); set actor.loss_agg_mode=seq-mean-token-mean for its numbers"
        )
    return lines


def _describe_policy(cfg) -> list[str]:
    """Where the policy comes from, what trains it, and the reference."""
    from grouprl.errors import missing_local_path
    from grouprl.trainer.models import BUILTIN_MODELS, BUILTIN_VLMS

    path = cfg.model.path
    builtin = path.split(":", 1)[1] if path.startswith("builtin:") else None
    if builtin in BUILTIN_MODELS:
        where = f"built-in ({BUILTIN_MODELS[builtin][1]} from a PyPI package)"
    elif builtin in BUILTIN_VLMS:  # see trainer/embedded_vlm.py
        where = (
            f"built-in VLM: {BUILTIN_MODELS[BUILTIN_VLMS[builtin]][1]} (a PyPI package) as its language model, "
            f"its vision tower initialised at random; assembled once into {Path(cfg.model.cache_dir) / 'models' / builtin}"
        )
    elif builtin is not None:
        where = f"WARNING: no such built-in model; available: {', '.join([*BUILTIN_MODELS, *BUILTIN_VLMS])}"
    elif Path(path).expanduser().exists():
        where = "local folder"
    elif missing_local_path(path):
        where = f"WARNING: does not exist ({missing_local_path(path)})"
    else:
        where = "not a local folder: will be read from the Hugging Face hub"
    extra = []
    if cfg.model.lora.rank:
        extra.append(f"LoRA r={cfg.model.lora.rank} alpha={cfg.model.lora.alpha}")
    if cfg.model.quantization != "none":
        extra.append(f"{cfg.model.quantization} quantised (CUDA only)")
    if cfg.model.gradient_checkpointing:
        extra.append("gradient checkpointing")
    lines = [f"policy: {path} [{where}]" + (f" + {', '.join(extra)}" if extra else "")]
    needs_ref = cfg.algorithm.kl_coef > 0 or cfg.actor.kl_loss_coef > 0
    if needs_ref:
        kind = "base model with adapters disabled" if cfg.model.lora.rank else "frozen copy of the policy"
        lines.append(
            f"reference: {kind} (kl_coef={cfg.algorithm.kl_coef:g}, kl_loss_coef={cfg.actor.kl_loss_coef:g})"
        )
    else:
        lines.append("reference: none (no KL term)")
    return lines


def _describe_episode(cfg) -> list[str]:
    """The agent, the curriculum, the rewards and reward models."""
    lines = []
    if cfg.agent.enabled:
        a = cfg.agent
        search = (
            f"search via {a.retriever.url}"
            if a.retriever.url
            else f"search in-process on {a.retriever.index or '(no index set)'}"
        )
        lines.append(
            f"agent: up to {a.max_turns} turns of <= {cfg.rollout.max_response_length} tokens, tools "
            f"{', '.join(a.tools) or 'none'} ({search}), answers by {a.answer_generator}, "
            f"KV cache {'kept' if a.reuse_kv_cache else 're-prefilled'} between turns"
        )
    if cfg.data.sampler == "curriculum":
        cur = cfg.curriculum
        lines.append(
            f"curriculum: online buckets (easy > {cur.easy:g}, hard < {cur.hard:g}, re-bucket every "
            f"{cur.rebucket_every} steps)"
            + (f", dynamic filter up to {cur.max_oversample:g}x prompts" if cur.dynamic_filter else "")
        )
    comps = " + ".join(f"{c.weight:g} x {c.name}" for c in cfg.reward.components)
    judges = (
        f"; judges: {', '.join(f'{j.name} ({j.backend} {j.model})' for j in cfg.reward.judges)}"
        if cfg.reward.judges
        else ""
    )
    lines.append(f"reward: {comps}{judges}{' (streamed per group)' if cfg.reward.streaming else ''}")
    lines += describe_rewards(cfg)
    from grouprl.rewards.composite import describe_components
    from grouprl.rewards.probe import probe_rewards

    if cfg.reward.streaming and any(reads is not None and "prompts" in reads for _, _, reads in describe_components(cfg.reward)):
        lines.append("TRL-style rewards are called once per group as each finishes (reward.streaming); "
                     "reward.streaming=false calls them once per batch, as TRL does")  # fmt: skip
    lines += probe_rewards(cfg)  # each reward called once on a row: one that cannot run is the error line
    for m in cfg.reward.models:  # each in the reward-model worker, on its own device
        what = f"{m.kind} {m.path or m.base_url or '(built-in)'} on {m.device}, batches of {m.batch_size}"
        lines.append(f"reward model {m.name}: {what}" + (f", scores {m.images_from}'s images" if m.images_from else ""))
    return lines


def _describe_data(cfg) -> list[str]:
    if not cfg.data.train_files:
        return [f"data: built-in task '{cfg.data.task}' ({cfg.data.task_train_size} train / {cfg.data.task_val_size} held-out)"]
    from grouprl.data.layout import describe_data_file

    # a needed column absent: one error line
    return [
        f"data: {f}: {describe_data_file(f)}" if Path(f).exists() else f"data: {f}  [WARNING: not found]"
        for f in cfg.data.train_files + cfg.data.val_files
    ]


def _describe_run(cfg) -> list[str]:
    """How it launches (Ray), how long it runs, saves, evaluates, and where it writes."""
    t = cfg.trainer
    lines = []
    if t.launcher == "ray":
        workers = f"{t.ray_workers} ranks" if t.ray_workers else "a rank per GPU of the cluster"
        lines.append(
            f"launch: {workers} as Ray Train workers ({t.ray_cpus_per_worker} CPU each; a GPU each "
            f"{'always' if t.device == 'cuda' else 'never' if t.device == 'cpu' else 'when the cluster has them'})"
        )
    steps = f"{t.total_steps} steps" if t.total_steps else f"{t.total_epochs} epoch(s)"
    lines.append(
        f"run: {steps}, save every {t.save_freq or 'end'}, resume {t.resume_mode}, "
        f"eval every {t.test_freq or 'start/end'}, output {Path(t.output_dir) / t.experiment_name}"
    )
    return lines


def describe_memory(cfg) -> tuple[list[str], bool, object]:
    """The memory plan as table lines (from model.path's config alone), whether it fits, and the
    config with its device-dependent `auto` settings made concrete (as the run would); a model
    config that cannot be read without loading is said in a line (and counts as fitting)."""
    from grouprl.errors import ModelLoadError
    from grouprl.hub import cache_only_when_offline
    from grouprl.trainer.memory import devices_for, model_shape, plan_memory, refusal, settle_for_devices
    from grouprl.trainer.models import config_without_weights

    try:
        with cache_only_when_offline(cfg.model.path) as offline:
            config = config_without_weights(cfg.model)
    except (ModelLoadError, OSError, ValueError) as e:
        if offline:
            return [f"memory plan: not made, the hub is not reachable from here and {cfg.model.path}'s config is not in its cache"], True, cfg
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"memory plan: not made, model.path's config.json could not be read ({first})"], True, cfg
    shape = model_shape(cfg.model, config)
    devices = devices_for(cfg)
    cfg = settle_for_devices(cfg, shape, devices)
    if cfg.trainer.memory_check == "off":
        return ["memory plan: off (trainer.memory_check=off)"], True, cfg
    from grouprl.trainer.data_lengths import data_longest_prompt

    longest, said = data_longest_prompt(cfg)
    plan = plan_memory(cfg, shape, devices, longest_prompt=longest)
    lines = [
        f"memory plan per device, from model.path's config ({shape.params / 1e9:.2f}B parameters, "
        f"{shape.trainable / 1e9:.2f}B trained; no weights read):",
        *plan.table(),
        said,
    ]
    from grouprl.trainer.memory import lr_resolution_warning

    warning = lr_resolution_warning(cfg)
    if warning:
        lines.append("WARNING: " + warning)
    if not plan.fits:
        lines.append(refusal(plan, cfg, shape, longest))
    return lines, plan.fits or cfg.trainer.memory_check != "refuse", cfg
