"""grouprl vs TRL's GRPOTrainer: same model, prompts, seed and GSPO settings, alternated in one process.

    .venv/bin/python benchmarks/vs_trl.py [--steps 5 --rounds 4 --batch 4 --n-agent 8 --max-new-tokens 48]
    .venv/bin/python benchmarks/vs_trl.py --quick        # smoke test (tiny settings)
    .venv/bin/python benchmarks/vs_trl.py --isolated --steps 2   # each side alone in fresh processes: peak RSS

Both trainers are built once; each round runs N steps of one side, then N of the other (grouprl first
on even rounds), each side keeping its state. TRL's `train()` runs in a helper thread that a callback
parks after every N optimizer steps. The settings are taken from grouprl's default recipe and mapped
onto GRPOConfig in `TRLSide` (the full mapping, with what could not be aligned: benchmarks/README.md).
Key points: GSPO = importance_sampling_level="sequence"; seq-mean-token-mean = loss_type="grpo";
one optimizer step per step (B*n completions = per_device_train_batch_size x gradient_accumulation_steps);
TRL gets grouprl's AdamW + LambdaLR, its prompts in grouprl's draw order, and stop strings through
generation_kwargs with the tokenizer bound onto generate() (TRL does not pass it; huggingface/trl#2820).

Per step, on both sides: step = one optimizer step (TRL: on_step_begin to on_step_end); generation =
the generate call (TRL: `_generate`, tokenising and decoding included); reward = the reward functions
(TRL: `_calculate_rewards`); update = step - generation - reward. tokens/s = (prompt tokens x n +
generated tokens) / step time. Memory: RSS sampled by a thread, per side's phases; ru_maxrss.

--isolated: each round starts one child process per side (alternating which goes first) that builds
only that side and runs --steps steps from the start; a side's peak RSS is its child's ru_maxrss
(model, optimizer state, generation and update of that side alone, as a user's run would see it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import json
import pickle
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import torch

import grouprl
from grouprl.config import load_config
from grouprl.rewards.loader import load_reward_function
from grouprl.trainer.models import resolve_model_path
from grouprl.trainer.optim import build_optimizer, build_scheduler
from grouprl.trainer.trainer import Trainer

DEFAULT_RECIPE = Path(grouprl.__file__).parent / "configs" / "default.yaml"
SIDES = ("grouprl", "trl")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="steps per side per round")
    p.add_argument("--rounds", type=int, default=4, help="alternations (each side runs --steps per round)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n-agent", type=int, default=8, help="samples per prompt (num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="rollout.max_response_length")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 round x 1 step, 2 prompts x 2, 8 tokens")
    p.add_argument("--out", type=Path, default=None, help="write all records and the summary as JSON")
    p.add_argument("--isolated", action="store_true",
                   help="each side alone in a fresh child process per round: per-side peak RSS (ru_maxrss)")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side, one process
    p.add_argument("--child-io", type=Path, help=argparse.SUPPRESS)  # internal: pickled samples in, JSON out
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds, args.batch, args.n_agent, args.max_new_tokens = 1, 1, 2, 2, 8
    if args.n_agent < 2:
        p.error("--n-agent must be >= 2 (TRL's GRPO needs at least 2 generations per prompt)")
    return args


def grouprl_config(args, run_dir: str):
    total = args.steps * args.rounds
    overrides = [
        f"data.train_batch_size={args.batch}", f"rollout.n_agent={args.n_agent}",
        f"rollout.max_response_length={args.max_new_tokens}", f"trainer.seed={args.seed}",
        f"trainer.total_steps={total}", "trainer.device=cpu", "model.dtype=float32",
        "trainer.resume_mode=disable", f"trainer.output_dir={run_dir}", "data.task_val_size=0",
        "algorithm.adv_epsilon=1e-4",  # TRL's fixed epsilon in (r - mean) / (std + eps)
    ]
    if args.lr is not None:
        overrides.append(f"actor.optim.lr={args.lr}")
    cfg = load_config(DEFAULT_RECIPE, overrides)
    rows = args.batch * args.n_agent
    micro = max(d for d in range(1, min(cfg.actor.micro_batch_size, rows) + 1) if rows % d == 0)
    cfg.actor.micro_batch_size = micro  # the same micro-batch on both sides
    return cfg


GIB = 1024**3


class RSSMonitor:
    """Samples this process's RSS in a thread: the maximum per phase label, and the largest rise of
    a phase over the RSS at its start."""

    def __init__(self, interval: float = 0.02):
        self.proc, self.interval, self.phase = psutil.Process(), interval, None
        self.peak: dict[str, int] = defaultdict(int)
        self.growth: dict[str, int] = defaultdict(int)
        self._start = self._phase_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def set_phase(self, phase: str | None) -> None:
        if self.phase is not None:  # close the old phase with one last sample
            peak = max(self._phase_peak, self.rss())
            self.peak[self.phase] = max(self.peak[self.phase], peak)
            self.growth[self.phase] = max(self.growth[self.phase], peak - self._start)
        with contextlib.suppress(OSError, AttributeError):  # hand freed heap back to the OS (glibc), so
            ctypes.CDLL("libc.so.6").malloc_trim(0)         # one side's freed memory does not hide the other's
        self._start = self._phase_peak = self.rss()
        self.phase = phase

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.phase is not None:
                self._phase_peak = max(self._phase_peak, self.rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ru_maxrss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux reports KiB


def record(step, t_step, t_gen, t_reward, tokens, reward, correctness, lengths, uids) -> dict:
    """One step's measurements, the same fields and definitions for both sides."""
    return {"step": step, "time_step": t_step, "time_gen": t_gen, "time_reward": t_reward,
            "time_update": t_step - t_gen - t_reward, "tokens": int(tokens), "tokens_per_s": tokens / t_step,
            "reward": reward, "correctness": correctness, "length": statistics.fmean(lengths or [0]), "uids": uids}


class GroupRLSide:
    def __init__(self, cfg):
        self.trainer = Trainer(cfg)
        self.records: list[dict] = []

    def run_steps(self, k: int) -> list[dict]:
        start = len(self.records)
        for _ in range(k):
            m, trajs, _ = self.trainer.train_step()
            self.records.append(record(
                len(self.records) + 1, m["time/step"], m["time/generate"], m["time/reward"],
                sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs), statistics.fmean(t.reward for t in trajs),
                statistics.fmean(t.rewards.get("correctness", float("nan")) for t in trajs),
                [len(t.response_ids) for t in trajs], sorted({t.uid for t in trajs})))
        return self.records[start:]


def draw_order(trainer: Trainer, steps: int) -> list:
    """The samples grouprl's sampler will draw in `steps` steps (a copy of it, so nothing advances)."""
    sampler, out = copy.deepcopy(trainer.parts.collect.sampler), []
    for _ in range(steps):
        batch = []
        while len(batch) < trainer.cfg.data.train_batch_size:  # as Collector.next_prompts: skip over-long
            batch += [i for i in sampler.next_batch() if trainer.parts.collect.train_prompts[i] is not None]
        out += [trainer.parts.collect.train_samples[i] for i in batch[: trainer.cfg.data.train_batch_size]]
    return out


def trl_reward(fn, name: str, kwargs: dict):
    def reward(prompts, completions, ground_truth, **_):
        return [float(fn(c[0]["content"] if isinstance(c, list) else c, g, **kwargs))
                for c, g in zip(completions, ground_truth)]
    reward.__name__ = name
    return reward


class TRLSide:
    """GRPOTrainer.train() in a thread, parked by a callback after every `k` optimizer steps."""

    def __init__(self, cfg, model_path: str, samples: list, work_dir: str):
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        r, a = cfg.rollout, cfg.actor
        rows = cfg.data.train_batch_size * r.n_agent
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if r.stop:  # transformers needs the tokenizer for stop strings; TRL does not pass it
            model.generate = functools.partial(model.generate, tokenizer=tokenizer)
        comps = cfg.reward.components
        reward_funcs = [trl_reward(load_reward_function(c.function or c.name), c.name, c.kwargs) for c in comps]
        dataset = Dataset.from_list([{"prompt": s.messages, "ground_truth": s.ground_truth, "uid": s.uid}
                                     for s in samples])
        total = cfg.trainer.total_steps
        args = GRPOConfig(
            output_dir=work_dir, seed=cfg.trainer.seed, use_cpu=True, bf16=False, fp16=False,
            activation_checkpointing=cfg.model.gradient_checkpointing,  # new name of gradient_checkpointing
            per_device_train_batch_size=a.micro_batch_size, gradient_accumulation_steps=rows // a.micro_batch_size,
            num_generations=r.n_agent, max_completion_length=r.max_response_length,
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            generation_kwargs={"stop_strings": list(r.stop)} if r.stop else None,
            learning_rate=a.optim.lr, max_grad_norm=a.optim.grad_clip, max_steps=total,
            beta=0.0, num_iterations=a.ppo_epochs, epsilon=a.clip_low, epsilon_high=a.clip_high,
            importance_sampling_level="sequence", loss_type="grpo",
            scale_rewards="group" if cfg.algorithm.norm_adv_by_std else "none",
            reward_weights=[c.weight for c in comps], mask_truncated_completions=r.mask_truncated,
            shuffle_dataset=False, use_vllm=False, report_to="none", logging_steps=1,
            save_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        )
        optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], a.optim)
        scheduler = build_scheduler(optimizer, a.optim, total * a.ppo_epochs)
        side = self

        class Clock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                side._begin()

            def on_step_end(self, args, state, control, **kw):
                side._end()
                control.should_training_stop |= side.stopping  # finish() before all steps ran

        self.trainer = GRPOTrainer(
            model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
            processing_class=tokenizer, callbacks=[Clock()], optimizers=(optimizer, scheduler),
        )
        self.trainer.remove_callback(PrinterCallback)  # we print our own per-step line
        self.weights = torch.tensor([c.weight for c in comps])
        self.correct_col = next((i for i, c in enumerate(comps) if c.name == "correctness"), None)
        self._wrap("_generate", self._after_generate)
        self._wrap("_calculate_rewards", self._after_rewards)
        self.records: list[dict] = []
        self.left, self.error, self.thread, self.stopping = 0, None, None, False
        self.parked, self.go = threading.Event(), threading.Event()

    def _wrap(self, name: str, after) -> None:
        original = getattr(self.trainer, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            after(time.perf_counter() - t0, args, out)
            return out

        setattr(self.trainer, name, timed)

    def _after_generate(self, dt, args, out) -> None:
        prompt_ids, completion_ids = out[0], out[1]
        self.acc["time_gen"] += dt
        self.acc["tokens"] += sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
        self.acc["lengths"] += [len(c) for c in completion_ids]

    def _after_rewards(self, dt, args, out) -> None:
        self.acc["time_reward"] += dt
        per_func = out.detach().float().cpu()  # [B*n, components]
        self.acc["reward"] = float((per_func * self.weights).sum(-1).mean())
        if self.correct_col is not None:
            self.acc["correctness"] = float(per_func[:, self.correct_col].mean())
        self.acc["uids"] = sorted({x["uid"] for x in args[0]})

    def _begin(self) -> None:
        self.acc = defaultdict(float, lengths=[], uids=[], correctness=float("nan"))
        self.t0 = time.perf_counter()

    def _end(self) -> None:
        a = self.acc
        self.records.append(record(len(self.records) + 1, time.perf_counter() - self.t0, a["time_gen"],
                                   a["time_reward"], a["tokens"], a["reward"], a["correctness"], a["lengths"], a["uids"]))
        self.left -= 1
        if self.left == 0:  # park until the next run_steps (or finish)
            self.parked.set()
            self.go.wait()
            self.go.clear()

    def _train(self) -> None:
        try:
            self.trainer.train()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            self.error = e
        finally:
            self.parked.set()

    def run_steps(self, k: int) -> list[dict]:
        start, self.left = len(self.records), k
        if self.thread is None:
            self.thread = threading.Thread(target=self._train, name="trl-train", daemon=True)
            self.thread.start()
        else:
            self.go.set()
        self.parked.wait()
        self.parked.clear()
        if self.error is not None:
            raise RuntimeError("TRL training failed") from self.error
        return self.records[start:]

    def finish(self) -> None:
        self.stopping = True
        if self.thread is not None and self.thread.is_alive():
            self.go.set()
            self.thread.join()


def medians(records: list[dict], skip_first: bool) -> dict:
    use = records[1:] if skip_first and len(records) > 1 else records
    return {k: statistics.median(r[k] for r in use)
            for k in ("time_step", "time_gen", "time_reward", "time_update", "tokens_per_s", "length")}


def run_rounds(args, sides: dict, monitor: RSSMonitor) -> tuple[dict, dict]:
    records: dict[str, list[dict]] = {s: [] for s in SIDES}
    ru_after: dict[str, float] = {}
    for rnd in range(args.rounds):
        for name in SIDES if rnd % 2 == 0 else SIDES[::-1]:
            monitor.set_phase(name)
            new = sides[name].run_steps(args.steps)
            monitor.set_phase(None)
            ru_after[name] = ru_maxrss_gb()
            for r in new:
                r["round"] = rnd
                print(f"[round {rnd}] {name:7s} step {r['step']:3d}: step {r['time_step']:6.2f}s gen {r['time_gen']:6.2f}s"
                      f" reward {r['time_reward']:5.3f}s update {r['time_update']:6.2f}s | {r['tokens_per_s']:7.1f} tok/s"
                      f" | reward {r['reward']:.3f} correct {r['correctness']:.3f} len {r['length']:.1f}", flush=True)
            records[name] += new
    return records, ru_after


def run_child(args) -> None:
    """One side alone: build it, run --steps steps, write its records and ru_maxrss as JSON."""
    io = args.child_io
    work = tempfile.mkdtemp(prefix=f"vs_trl-{args.child}-")
    try:
        cfg = grouprl_config(args, work)
        side = (GroupRLSide(cfg) if args.child == "grouprl" else
                TRLSide(cfg, resolve_model_path(cfg.model), pickle.loads(io.with_suffix(".pkl").read_bytes()), work))
        built = ru_maxrss_gb()
        try:
            records = side.run_steps(args.steps)
        finally:
            if isinstance(side, TRLSide):
                side.finish()
        io.with_suffix(".json").write_text(json.dumps(
            {"records": records, "ru_maxrss_gib": ru_maxrss_gb(), "ru_maxrss_built_gib": built}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_isolated(args) -> None:
    """Per round, one fresh child process per side (the order alternating); each child's ru_maxrss is
    that side's peak RSS."""
    work = Path(tempfile.mkdtemp(prefix="vs_trl-isolated-"))
    try:
        cfg = grouprl_config(args, str(work))
        order = draw_order(Trainer(cfg), args.steps)  # the prompts grouprl draws, for TRL's dataset
        io = work / "io"
        io.with_suffix(".pkl").write_bytes(pickle.dumps(order))
        flags = [f"--steps={args.steps}", "--rounds=1", f"--batch={args.batch}", f"--n-agent={args.n_agent}",
                 f"--max-new-tokens={args.max_new_tokens}", f"--seed={args.seed}"]
        flags += [f"--lr={args.lr}"] if args.lr is not None else []
        results: dict[str, list[dict]] = {s: [] for s in SIDES}
        for rnd in range(args.rounds):
            for name in SIDES if rnd % 2 == 0 else SIDES[::-1]:
                subprocess.run([sys.executable, __file__, *flags, f"--child={name}", f"--child-io={io}"], check=True)
                out = json.loads(io.with_suffix(".json").read_text())
                results[name].append(out)
                steps = ", ".join(f"{r['time_step']:.1f}" for r in out["records"])
                print(f"[round {rnd}] {name:7s} peak RSS {out['ru_maxrss_gib']:.2f} GiB (after building "
                      f"{out['ru_maxrss_built_gib']:.2f}); steps {steps} s; rewards "
                      + ", ".join(f"{r['reward']:.3f}" for r in out["records"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = {s: max(o["ru_maxrss_gib"] for o in results[s]) for s in SIDES}
    step = {s: statistics.median(r["time_step"] for o in results[s] for r in o["records"][1:] or o["records"])
            for s in SIDES}
    print(f"\neach side alone ({args.rounds} fresh process(es) each, {args.steps} step(s) per process):\n"
          f"{'':26s} {'grouprl':>10s} {'TRL':>10s} {'grouprl/TRL':>12s}")
    for label, d in [("peak RSS, max (GiB)", peak), ("median step time (s)", step)]:
        print(f"{label:26s} {d['grouprl']:10.3f} {d['trl']:10.3f} {d['grouprl'] / d['trl']:12.3f}")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                        "peak_rss_gib": peak, "median_step_s": step, "runs": results}, indent=2))
        print(f"wrote {args.out}")


def main() -> None:
    args = parse_args()
    if args.child:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        return run_child(args)
    if args.isolated:
        return run_isolated(args)
    import transformers
    import trl

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    work = tempfile.mkdtemp(prefix="vs_trl-")
    cfg = grouprl_config(args, work)
    total = args.steps * args.rounds
    print(f"grouprl vs TRL {trl.__version__} (transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()})\n"
          f"B={args.batch} prompts x n={args.n_agent}, max_new_tokens={args.max_new_tokens}, lr={cfg.actor.optim.lr}, "
          f"micro-batch={cfg.actor.micro_batch_size}, {args.rounds} rounds x {args.steps} steps per side, fp32 CPU, "
          f"stop={list(cfg.rollout.stop)}")
    monitor = RSSMonitor()
    g = GroupRLSide(cfg)
    t = TRLSide(cfg, resolve_model_path(cfg.model), draw_order(g.trainer, total), work)
    rss_built = monitor.rss()
    sample = g.trainer.parts.collect.train_samples[0]  # does TRL tokenise the chat-templated prompt as grouprl does?
    same_tokens = list(t.trainer._tokenize_prompts([sample.messages])[0][0]) == g.trainer.parts.collect.train_prompts[0]
    try:
        records, ru_after = run_rounds(args, {"grouprl": g, "trl": t}, monitor)
    finally:
        t.finish()
        monitor.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {s: medians(records[s], skip_first=total > 1) for s in SIDES}
    memory = {s: {"peak_rss_gib": monitor.peak[s] / GIB, "max_phase_growth_gib": monitor.growth[s] / GIB,
                  "ru_maxrss_gib_after_last_phase": ru_after.get(s)} for s in SIDES}
    print(f"\nmedians over steps{' (first step of each side excluded)' if total > 1 else ''}:\n"
          f"{'':18s} {'grouprl':>10s} {'TRL':>10s} {'grouprl/TRL':>12s}")
    for label, key, where in [("step time (s)", "time_step", med), ("generation (s)", "time_gen", med),
                              ("reward (s)", "time_reward", med), ("update (s)", "time_update", med),
                              ("tokens/s", "tokens_per_s", med), ("response length", "length", med),
                              ("peak RSS (GiB)", "peak_rss_gib", memory), ("RSS rise (GiB)", "max_phase_growth_gib", memory)]:
        a, b = where["grouprl"][key], where["trl"][key]
        print(f"{label:18s} {a:10.3f} {b:10.3f} {a / b if b else float('nan'):12.3f}")
    print(f"RSS with both trainers built {rss_built / GIB:.2f} GiB; ru_maxrss (whole process) {ru_maxrss_gb():.2f} GiB"
          "\n(RSS rise: the largest rise of RSS during one of the side's phases over the RSS at its start)")

    print("\nreward curves (composite reward / correctness, mean over the step's B*n completions):")
    print(f"{'step':>4s} {'grouprl':>16s} {'TRL':>16s}")
    for a, b in zip(records["grouprl"], records["trl"]):
        print(f"{a['step']:4d} {a['reward']:8.3f}/{a['correctness']:.3f} {b['reward']:8.3f}/{b['correctness']:.3f}")
    final = {s: {k: statistics.fmean(r[k] for r in records[s][-args.steps:]) for k in ("reward", "correctness")}
             for s in SIDES}
    print(f"mean over each side's last {args.steps} step(s): " + " | ".join(
        f"{s} reward {final[s]['reward']:.3f} correct {final[s]['correctness']:.3f}" for s in SIDES))
    same_prompts = all(a["uids"] == b["uids"] for a, b in zip(records["grouprl"], records["trl"]))
    notes = [f"same prompts at every step: {same_prompts}", f"chat-templated prompt ids identical: {same_tokens}"]
    if cfg.rollout.stop:
        notes.append(f"stop strings {list(cfg.rollout.stop)} on both sides (TRL: generation_kwargs stop_strings, "
                     "tokenizer bound to generate); a TRL completion stopped by a string before the longest in "
                     "its batch keeps one pad (= eos) token in its ids and loss, grouprl's never: up to 1 token longer")
    for n in notes:
        print("note:", n)
    if args.out:
        args.out.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "threads": torch.get_num_threads(), "medians": med, "memory": memory, "final_reward": final,
            "rss_built_gib": rss_built / GIB, "ru_maxrss_gib": ru_maxrss_gb(), "notes": notes, "records": records,
        }, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
