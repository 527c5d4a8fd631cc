"""The sharded update (ZeRO-3) and sharded loading on this CPU: a ~320M float32 Llama trained two
steps as one process and on 2 and 4 torchrun ranks (gloo), each rank's update and start-up peak,
and the update's time and communication at 2 ranks against another commit's code, alternated.

    .venv/bin/python benchmarks/zero3.py memory                    # 1, 2 and 4 ranks, this tree
    .venv/bin/python benchmarks/zero3.py memory --code HEAD~4      # the same runs on a commit's code
    .venv/bin/python benchmarks/zero3.py time --baseline HEAD~4 --rounds 3
    .venv/bin/python benchmarks/zero3.py memory --quick            # a 4-layer model: a smoke test

The model (built once under --work): Llama, hidden 1024, 22 layers of MLP width 2816, 16 heads,
a 32,000-word vocabulary with tied embeddings (315M parameters, 1.26 GB in float32), random
weights saved as safetensors; a word tokenizer, so prompts are exactly --prompt-len tokens.
The run: --batch prompts x --n samples, responses of exactly --response-len tokens
(rollout.ignore_eos), actor.dtype=float32, the whole batch one mini-batch and one micro-batch a
rank, no KL reference, two steps. Step 2's update has AdamW's state in place. Figures per run:
`perf/peak_gb/startup` (step 1) and `perf/peak_gb/update` (step 2): the resident set's high-water
mark of the phase, the largest rank's; `time/update` (step 2). Ranks run one thread each
(OMP_NUM_THREADS=1), one process the machine's threads.

`time` alternates this tree and --baseline (a commit, its src/ exported to a temp folder) at 2
ranks, --rounds rounds, the first flipping every round, and prints the medians and their ratio,
with the bytes each rank's update gathered (all-gathers) and reduced (reduce-scatters) in step
2, counted by a wrapper of torch.distributed's collectives in each rank (`--worker`).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import synthetic_tokenizer, write_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(
    model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=22, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=True,
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip
REWARD = "def score(response, ground_truth=None, **kwargs):\n    return float(len(response) % 3 == 0)\n"


def build_model(folder: Path, layers: int) -> Path:
    """The Llama of LLAMA (with `layers` layers) in float32, random weights, once."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    values = {**LLAMA, "num_hidden_layers": layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values), dtype=torch.float32)
    tokenizer = synthetic_tokenizer(values)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp / "tokenizer")
    tmp.rename(folder)
    return folder


def settings(args, model: Path, data: Path, out: Path, name: str) -> list[str]:
    reward = out / "reward.py"
    reward.write_text(REWARD)
    return [
        f"model.path={model}", f"model.tokenizer_path={model / 'tokenizer'}", f"data.train_files=[{data}]",
        "data.val_files=[]", f"data.train_batch_size={args.batch}", f"data.max_prompt_length={args.prompt_len}",
        "data.sampler=sequential", f"rollout.n_agent={args.n}", f"rollout.max_response_length={args.response_len}",
        "rollout.ignore_eos=true", "actor.dtype=float32", "rollout.dtype=float32", "actor.mini_batch_size=0",
        f"actor.micro_batch_size={args.batch * args.n}", "actor.micro_batch_tokens=0", "trainer.device=cpu",
        "trainer.total_steps=2", f"trainer.output_dir={out}", f"trainer.experiment_name={name}",
        "trainer.val_before_train=false", "trainer.save_final=false", "trainer.save_best=false",
        "trainer.save_last=false", "trainer.resume_mode=disable", "trainer.loggers=[jsonl]", "reward.streaming=false",
        f"reward.components=[{{name: score, function: '{reward}:score'}}]", "reward.val_metric=score",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, ranks: int, src: Path, model: Path, data: Path, out: Path) -> dict:
    """One training run of the code in `src`: its figures (see the module's docstring)."""
    name = f"r{ranks}-{abs(hash(str(src))) % 10**6}"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    counts = out / f"{name}-comm"
    env["ZERO3_COUNTS"] = str(counts)
    worker = [str(Path(__file__).resolve()), "--worker"]
    if ranks == 1:
        command = [sys.executable, *worker]
    else:
        env["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", *worker]  # fmt: skip
    done = subprocess.run([*command, "train", *settings(args, model, data, out, name)], env=env,
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{ranks} rank(s) of {src} failed:\n{done.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "time/update" in m]
    figures = {
        "startup_gb": steps[0]["perf/peak_gb/startup"],
        "update_gb": steps[1]["perf/peak_gb/update"],
        "update_s": steps[1]["time/update"],
    }
    if counts.is_file():  # step 2's update, the largest rank's
        updates = [json.loads(line) for line in counts.read_text().splitlines()]
        last = [u for u in updates if u["update"] == 2]
        figures["gathered_gb"] = max(u["gathered"] for u in last) / 1e9
        figures["reduced_gb"] = max(u["reduced"] for u in last) / 1e9
    return figures


def worker() -> None:
    """A rank of a run (`--worker train ...`): torch.distributed's FSDP collectives counted during
    each update, appended to $ZERO3_COUNTS per update, then grouprl's CLI."""
    import torch.distributed as dist

    from grouprl.trainer import update

    counted = {"gathered": 0, "reduced": 0}

    def counting(fn, key, which, name):
        def wrapped(*a, **k):
            t = a[which] if len(a) > which else k[name]
            counted[key] += t.numel() * t.element_size()
            return fn(*a, **k)

        return wrapped

    # the whole tensors: an all-gather's output, a reduce-scatter's input
    dist.all_gather_single = counting(dist.all_gather_single, "gathered", 0, "output_tensor")
    dist.reduce_scatter_single = counting(dist.reduce_scatter_single, "reduced", 1, "input")
    original = update.PolicyUpdater.update
    calls = [0]

    def counted_update(self, *a, **k):
        counted.update(gathered=0, reduced=0)
        out = original(self, *a, **k)
        calls[0] += 1
        with open(os.environ["ZERO3_COUNTS"], "a") as f:
            f.write(json.dumps({"update": calls[0], "rank": int(os.environ.get("RANK", "0")), **counted}) + "\n")
        return out

    update.PolicyUpdater.update = counted_update
    sys.argv = ["grouprl", *sys.argv[2:]]
    runpy.run_module("grouprl", run_name="__main__")


def export_code(commit: str, into: Path) -> Path:
    """`commit`'s src/ in a folder of its own."""
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def show(label: str, f: dict, base: dict | None = None) -> None:
    cells = []
    for key in ("startup_gb", "update_gb", "update_s", "gathered_gb", "reduced_gb"):
        if key in f:
            ratio = f" ({f[key] / base[key]:.2f}x)" if base and base.get(key) else ""
            cells.append(f"{key}={f[key]:.3f}{ratio}")
    print(f"{label:>28}: " + " ".join(cells), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["memory", "time"])
    p.add_argument("--ranks", default="1,2,4", help="memory: the layouts")
    p.add_argument("--code", default=None, help="memory: run a commit's code instead of this tree's")
    p.add_argument("--baseline", default="HEAD~1", help="time: the commit to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="a 4-layer model, 1 round")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "grouprl-zero3")
    args = p.parse_args()
    layers = 4 if args.quick else LLAMA["num_hidden_layers"]
    args.rounds = 1 if args.quick else args.rounds
    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / f"llama-{layers}", layers)
    data = write_data(args.work / "data", LLAMA["vocab_size"], 16, args.prompt_len, image=False)
    with open(model / "model.safetensors", "rb") as f:  # the header's shapes
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    params = sum(torch.Size(v["shape"]).numel() for k, v in header.items() if k != "__metadata__")
    print(f"model: {params / 1e6:.0f}M parameters, {params * 4 / 1e9:.2f} GB in float32")
    with tempfile.TemporaryDirectory() as tmp:
        here = ROOT / "src"
        if args.what == "memory":
            src = export_code(args.code, Path(tmp)) if args.code else here
            results = {}
            for ranks in map(int, args.ranks.split(",")):
                with tempfile.TemporaryDirectory() as out:
                    results[ranks] = run(args, ranks, src, model, data, Path(out))
                show(f"{ranks} rank(s)", results[ranks], results.get(1))
            return
        baseline = export_code(args.baseline, Path(tmp))
        sides = {"this tree": here, f"baseline {args.baseline}": baseline}
        got: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for label in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                with tempfile.TemporaryDirectory() as out:
                    got[label].append(run(args, 2, sides[label], model, data, Path(out)))
                show(f"round {r + 1} {label}", got[label][-1])
        medians = {k: {key: statistics.median(f[key] for f in v) for key in v[0]} for k, v in got.items()}
        print(f"\nmedians over {args.rounds} rounds, 2 ranks; ratio to the baseline in brackets")
        base = medians[f"baseline {args.baseline}"]
        for label, f in medians.items():
            show(label, f, base)


if __name__ == "__main__":
    main()
