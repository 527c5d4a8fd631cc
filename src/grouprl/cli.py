"""`grouprl <verb>`: train (with --dry-run / --explain), eval, sft, curriculum, judge, retriever, version.

A mistake the user can make (a missing file, an unknown key, a bad value, an unreachable
model) is printed as one line and exits with status 2; anything else is a bug and keeps its
traceback. Under torchrun the line comes from one rank and every rank exits 2 (`RankReport`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

from grouprl.errors import UserError

# `grouprl train` without a YAML file runs this recipe (overrides apply on top of it).
DEFAULT_RECIPE = Path(__file__).parent / "configs" / "default.yaml"


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for noisy in ("faiss", "faiss.loader", "bm25s", "httpx"):  # their INFO/DEBUG lines are not ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # transformers' notices about its own API (e.g. `is_gradient_checkpointing`, which peft reads
    # on every LoRA model) say nothing about the run; other modules' warnings, ours too, stay
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"transformers(\.|$)")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


class RankReport:
    """A user's mistake under torchrun, reported as one process would: one line, status 2 on
    every rank. The ranks share the store torchrun's agent keeps: the first rank to find a
    mistake (a counter there) prints it and sets a key that a thread in every rank waits on;
    each other rank then leaves at once with status 2, silently, wherever it is (a collective
    waiting for the rank that found it included), and the first rank leaves after them (torchrun
    stops the ranks left once one has gone: a stop then leaves with status 2 too). Without that
    store (one process, another launcher) each rank prints its own mistake."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.store = self._connect()
        run = f"grouprl/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.count_key, self.said_key, self.left_key = (f"{run}/user_error_{k}" for k in ("count", "said", "left"))
        self.reporting = False  # this rank's main thread handles a mistake: the watcher stands aside
        if self.store is not None:
            threading.Thread(target=self._leave_when_said, name="grouprl-user-error", daemon=True).start()

    def _connect(self):
        if self.world <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        try:
            from torch.distributed import TCPStore

            return TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)
            )
        except (ImportError, KeyError, ValueError, RuntimeError):  # no store to reach: each rank speaks for itself
            return None

    def _leave_when_said(self) -> None:
        store = self._connect()  # a connection of its own: the main thread may be using the other
        if store is None:
            return
        try:
            store.wait([self.said_key], timedelta(days=365))
        except RuntimeError:  # the store went away (the run is over): nothing more to hear
            return
        if not self.reporting:
            self._count_out(store)

    def user_error(self, error: UserError) -> int:
        """Print the line, unless another rank did, and leave with status 2."""
        if self.store is None:
            print(f"grouprl: error: {error}", file=sys.stderr)
            return 2
        self.reporting = True
        if threading.current_thread() is threading.main_thread():  # torchrun's stop: status 2 as well
            signal.signal(signal.SIGTERM, lambda *_: self.leave())
        try:
            first = self.store.add(self.count_key, 1) == 1
            if first:  # only the rank that prints wakes the others: none leaves before the line is out
                print(f"grouprl: error: {error}", file=sys.stderr)
                sys.stderr.flush()
                self.store.set(self.said_key, "1")
                deadline = time.monotonic() + 10  # the others leave first (a rank that died never counts)
                while self.store.add(self.left_key, 0) < self.world - 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.02)  # from counted out to gone
            else:
                self.store.wait([self.said_key], timedelta(seconds=10))
                self._count_out(self.store)
        except RuntimeError:  # the store is gone: leave all the same
            pass
        self.leave()
        return 2

    def _count_out(self, store) -> None:
        """Count this rank as gone, then go."""
        try:
            store.add(self.left_key, 1)
        finally:
            self.leave()

    @staticmethod
    def leave() -> None:
        """Status 2 at once: tearing the interpreter down can abort a rank ("terminate called
        without an active exception" from a communication thread), as cmd_train says."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)

    def said_elsewhere(self) -> bool:
        """Whether a rank reported a user's mistake: this rank's failure (a collective whose peer
        left) follows from it and needs no traceback."""
        try:
            return self.store is not None and self.store.check([self.count_key])
        except RuntimeError:
            return False


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item may be a YAML file; the rest are key=value overrides."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _load(items: list[str]):
    from grouprl.config import is_verl_only, load_config

    path, overrides = _split_args(items)
    if path is None and any(is_verl_only(o) for o in overrides):
        return _from_verl(overrides)
    return load_config(path or DEFAULT_RECIPE, overrides)


def _from_verl(overrides: list[str]):
    """A run given verl's overrides and no config file: verl's meaning (its defaults, gates,
    scorer), as `grouprl convert` would write it, not the demo recipe; every key no setting
    takes in one line."""
    import yaml

    from grouprl.config import from_dict
    from grouprl.convert import convert, data_sources_of
    from grouprl.errors import ConfigError

    files = next((yaml.safe_load(o.partition("=")[2]) for o in overrides if o.lstrip("+").startswith("data.train_files=")), None)
    files = [files] if isinstance(files, str) else files or []
    tree, report = convert(overrides, data_sources_of([str(f) for f in files]) if files else None)
    if report.not_taken:
        listed = "; ".join(f"{k}={v} ({why})" for k, v, why in report.not_taken)
        raise ConfigError(f"{len(report.not_taken)} verl override(s) not taken: {listed}")
    for key, _, why in report.no_effect:
        logging.getLogger("grouprl").info("verl key %s has no effect in grouprl: %s", key, why)
    logging.getLogger("grouprl").info("verl overrides without a config file: verl's defaults for the rest (grouprl convert)")
    return from_dict(tree)


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
    from grouprl.trainer.memory import devices_for, model_shape, plan_memory, refusal, settle_for_devices
    from grouprl.trainer.models import config_without_weights

    try:
        config = config_without_weights(cfg.model)
    except (ModelLoadError, OSError, ValueError) as e:
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


def cmd_train(args) -> int:
    from grouprl.config import explain

    if args.explain:
        print("\n".join(explain()))
        return 0
    cfg = _load(args.items)
    if args.dry_run:
        memory, fits, settled = describe_memory(cfg)  # `auto` settings made concrete for the devices
        plan = describe_plan(settled)  # reads the data files' columns: a missing one is the only line
        print("config is valid. plan:")
        for line in plan + memory:
            print("  " + line)
        return 0 if fits else 1
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
    """Held-out metrics on stdout; every answer in answers.jsonl (trainer.eval_dir); progress on stderr."""
    cfg = _load(args.items)
    from rich.console import Console

    from grouprl.trainer.loggers import ConsoleLogger
    from grouprl.trainer.trainer import Trainer

    if not (cfg.data.val_files if cfg.data.train_files else cfg.data.task_val_size):
        raise UserError("grouprl eval needs held-out data: data.val_files, or a built-in task's data.task_val_size > 0")
    cfg.trainer.resume_mode = "disable"
    trainer = Trainer(cfg)
    folder = Path(cfg.trainer.eval_dir) if cfg.trainer.eval_dir else trainer.run_dir / "eval"
    console = ConsoleLogger(0, console=Console(stderr=True)) if trainer.ranks.main else None
    try:
        result = trainer.evaluate(answers=folder, progress=console.chunk if console else None)
    finally:
        if console:
            console.close()
        trainer.reward.close()
    if trainer.ranks.main:
        for k, v in result.items():
            print(f"{k}: {v:.4f}")
        print(f"answers: {folder / 'answers.jsonl'}")
    return 0


def cmd_convert(args) -> int:
    from grouprl.convert import run

    for line in run(args.source, args.out):
        print(line)
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
    from grouprl.rollout.cli import add_parser as add_engine
    from grouprl.trainer.sft_cli import add_parser as add_sft
    from grouprl.view.cli import add_parser as add_view

    add_sft(sub)  # grouprl sft [config.yaml] [overrides]: supervised warm start
    add_curriculum(sub)  # grouprl curriculum build ...
    add_judge(sub)  # grouprl judge score ...
    add_retriever(sub)  # grouprl retriever build | serve ...
    add_engine(sub)  # grouprl engine serve ...: rollout engines for trainers on other machines
    add_view(sub)  # grouprl view RUN ...: a local page over run folders
    conv = sub.add_parser(
        "convert", help="a verl/VRAG launch script, overrides file or Hydra YAML -> a complete grouprl YAML and a report"
    )
    conv.add_argument("source", help="run_x.sh, a file of key=value overrides, or a verl config YAML")
    conv.add_argument("-o", "--out", required=True, help="the grouprl YAML to write")
    conv.set_defaults(func=cmd_convert)
    ver = sub.add_parser("version", help="print the version")
    ver.set_defaults(func=lambda a: print(__import__("grouprl").__version__) or 0)
    args = parser.parse_args(argv)
    _setup_logging()
    report = RankReport()
    try:
        return args.func(args)
    except UserError as e:
        return report.user_error(e)
    except Exception:
        if report.said_elsewhere():  # e.g. a collective whose peer left on a user's mistake
            report.leave()
        raise
    except KeyboardInterrupt:
        print("grouprl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
