"""The memory plan against what runs measure, per rank, on 1, 2 and 4 ranks of this CPU.

    .venv/bin/python benchmarks/memory_plan.py                       # 331M float32 Llama, 1 / 2 / 4 ranks
    .venv/bin/python benchmarks/memory_plan.py --ranks 1 --steps 2   # one process only
    .venv/bin/python benchmarks/memory_plan.py --vlm                 # the embedded VLM with images

A Llama of hidden 2048, intermediate 5504, 6 layers, 16 query / 4 key-value heads and a 32,000-word
vocabulary (331M parameters, tied embeddings), random float32 weights, saved once under --work;
a word-level tokenizer (one token a word) and prompts of exactly --prompt-len words, so every
prompt is at its limit; responses of exactly --response-len tokens (rollout.ignore_eos): every
length at its limit, as the plan assumes. --vlm: the embedded VLM (builtin:smolvlm-smollm2-135m),
each prompt a long text cut to its last --prompt-len tokens, which hold an image: the prompts at
their limit with the image's tokens among them.

Each layout is a fresh `grouprl train` (1 process, or torchrun with gloo and one thread a rank)
of --steps steps; the plan is the run's own `memory_plan.json` (made before the model loads, from
config.json, the settings and the data's longest prompt), the measurement `perf/peak_gb/<phase>`
(the resident set's high-water mark, reset at each phase's start; every rank's, the largest
printed): start-up from step 1, generation and update from the last step (AdamW's state in
place). Printed: planned / measured GiB and the ratio per phase, and the plan's parts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import REWARD, synthetic_tokenizer  # noqa: E402

LLAMA = dict(
    model_type="llama", hidden_size=2048, intermediate_size=5504, num_hidden_layers=6, num_attention_heads=16,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=True,
    bos_token_id=0, eos_token_id=1, initializer_range=0.02,
)  # fmt: skip
PHASES = ("startup", "generation", "update")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(folder: Path) -> Path:
    """The float32 Llama and its tokenizer (tokenizer/), once."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.for_model(**LLAMA)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = synthetic_tokenizer(LLAMA)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp / "tokenizer")
    tmp.rename(folder)
    return folder


def write_data(folder: Path, count: int, prompt_len: int) -> Path:
    """Prompts of exactly `prompt_len` words of the synthetic vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    path = folder / "train.jsonl"
    with path.open("w") as f:
        for i in range(count):
            words = " ".join(f"w{int(t)}" for t in torch.randint(8, LLAMA["vocab_size"] - 8, (prompt_len,), generator=g))
            f.write(json.dumps({"id": f"p{i}", "question": words, "answer": "0"}) + "\n")
    return path


def llama_settings(args, work: Path) -> list[str]:
    model = write_model(work / "llama-331m")
    data = write_data(work / "data", 4 * args.batch, args.prompt_len)
    reward = work / "reward.py"
    reward.write_text(REWARD)
    return [
        f"model.path={model}", f"model.tokenizer_path={model / 'tokenizer'}", f"data.train_files=[{data}]",
        "data.val_files=[]", f"data.train_batch_size={args.batch}", f"data.max_prompt_length={args.prompt_len}",
        f"rollout.n_agent={args.n}", f"rollout.max_response_length={args.response_len}", "rollout.ignore_eos=true",
        f"actor.micro_batch_size={args.micro}", f"actor.dtype={args.dtype}", "actor.optim.lr=1e-6",
        f"reward.components=[{{name: even, function: '{reward}:score'}}]", "reward.val_metric=even",
    ]  # fmt: skip


def vlm_settings(args, work: Path) -> list[str]:
    """The embedded VLM: each prompt a long text cut to its last --prompt-len tokens
    (data.prompt_overflow=truncate), which end with a 112 x 56 image (16 image tokens and their
    markers at the processor's 64 px) and the question."""
    from PIL import Image

    folder = work / "vlm-data"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    with path.open("w") as f:
        for i in range(4 * args.batch):
            Image.new("RGB", (112, 56), (40 * i % 256, 90, 200)).save(folder / f"p{i}.png")
            text = " ".join(f"word{(i * 7 + k) % 97}" for k in range(3 * args.prompt_len))
            row = {"id": f"p{i}", "question": f"{text} <image> Which colour is it?", "answer": "blue", "images": [f"p{i}.png"]}
            f.write(json.dumps(row) + "\n")
    reward = work / "reward.py"
    reward.write_text(REWARD)
    return [
        "model.path=builtin:smolvlm-smollm2-135m", f"data.train_files=[{path}]", "data.val_files=[]",
        f"data.train_batch_size={args.batch}", f"data.max_prompt_length={args.prompt_len}", "data.prompt_overflow=truncate",
        f"rollout.n_agent={args.n}", f"rollout.max_response_length={args.response_len}", "rollout.ignore_eos=true",
        f"actor.micro_batch_size={args.micro}", f"actor.dtype={args.dtype}", "actor.optim.lr=1e-6",
        f"reward.components=[{{name: even, function: '{reward}:score'}}]", "reward.val_metric=even",
    ]  # fmt: skip


def run(ranks: int, settings: list[str], args, out: Path) -> dict:
    """One training run: the plan of its rank 0 and the measured peaks (largest over ranks)."""
    name = f"ranks-{ranks}"
    overrides = [
        *settings, f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
        "trainer.save_final=false", "trainer.save_best=false", "trainer.save_last=false", "trainer.save_freq=0",
        f"trainer.output_dir={out}", f"trainer.experiment_name={name}", "trainer.loggers=[jsonl]", "trainer.device=cpu",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    if ranks == 1:
        command = [sys.executable, "-m", "grouprl", "train"]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "grouprl", "train",
        ]  # fmt: skip
    done = subprocess.run([*command, *overrides], env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    plan = json.loads((out / name / "memory_plan.json").read_text())
    steps = [m for m in map(json.loads, (out / name / "metrics.jsonl").read_text().splitlines()) if "time/step" in m]
    measured = {
        "startup": steps[0]["perf/peak_gb/startup"],
        "generation": steps[-1]["perf/peak_gb/generation"],
        "update": steps[-1]["perf/peak_gb/update"],
    }
    return {"plan": plan, "measured": measured}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4", help="comma-separated layouts (1 = one process)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--vlm", action="store_true", help="the embedded VLM on page images instead of the Llama")
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--micro", type=int, default=4, help="actor.micro_batch_size")
    p.add_argument("--dtype", default="float32", help="actor.dtype")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "grouprl-memory-plan"))
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--set", nargs="*", default=[], help="further overrides for every run (section.key=value)")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    settings = [*(vlm_settings(args, work) if args.vlm else llama_settings(args, work)), *args.set]
    results = {}
    for ranks in map(int, args.ranks.split(",")):
        out = work / ("vlm-runs" if args.vlm else "runs")
        results[ranks] = result = run(ranks, settings, args, out)
        print(f"\n{ranks} rank(s): {result['plan']['resolved'].get('micro-batch', '')}")
        for phase in PHASES:
            planned, got = result["plan"]["phases"][phase]["peak_gb"], result["measured"][phase]
            print(f"  {phase:<11} planned {planned:6.2f} GiB, measured {got:6.2f}  ({planned / got:.2f}x)")
        for phase in PHASES:
            parts = result["plan"]["phases"][phase]["parts"]
            print(f"  {phase} parts: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
