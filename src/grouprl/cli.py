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


def cmd_train(args) -> int:
    from grouprl.config import explain

    if args.explain:
        from grouprl.config.docs import explain_key

        print("\n".join(explain() if args.explain is True else explain_key(args.explain)))
        return 0
    cfg = _load(args.items)
    if args.dry_run:
        from grouprl.trainer.describe import describe_memory, describe_plan

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
    folder = Path(cfg.trainer.eval_dir) if cfg.trainer.eval_dir else trainer.parts.run_dir / "eval"
    console = ConsoleLogger(0, console=Console(stderr=True)) if trainer.ranks.main else None
    try:
        result = trainer.evaluate(answers=folder, progress=console.chunk if console else None)
    finally:
        if console:
            console.close()
        trainer.parts.evaluate.reward.close()
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


def build_parser() -> argparse.ArgumentParser:
    """`grouprl`'s arguments, every verb's (the docs' commands are checked against it)."""
    parser = argparse.ArgumentParser(prog="grouprl", description="Group-relative RL post-training.")
    sub = parser.add_subparsers(dest="verb", required=True)
    train = sub.add_parser(
        "train", help="train a policy: grouprl train [config.yaml] [section.key=value ...]"
    )
    train.add_argument("items", nargs="*", help="an optional YAML file, then dotted overrides")
    train.add_argument("--dry-run", action="store_true", help="validate and print the plan; load nothing")
    train.add_argument(
        "--explain", nargs="?", const=True, metavar="KEY",
        help="list every setting with its default and meaning; with KEY (grouprl's, verl's or TRL's name) that one: "
        "its default, its verl and TRL names and the checks that name it"
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
