"""One GRPO step's parts on models of the real architectures: random weights, fixed lengths.

    .venv/bin/python benchmarks/scale.py --models qwen2.5-0.5b                  # this CPU, the smallest
    .venv/bin/python benchmarks/scale.py --toy                                  # tiny shapes of each family (CI)
    python benchmarks/scale.py --device cuda --models qwen2.5-1.5b,qwen2.5-3b,qwen2.5-7b --with-trl

For each model: its published config (architectures.py) with random weights, saved once under
--work (nothing is downloaded), a tokenizer of as many words as the model's vocabulary (one token
a word; Qwen2.5-VL's image tokens at their ids), prompts of exactly --prompt-len words (a VL
model's with one --image-size image in front), responses of exactly --response-len tokens
(rollout.ignore_eos). `grouprl train` runs --steps steps in a process of its own; from its last
step (the first warms up) the table gives:
- gen tok/s: generated tokens / time/generate;
- upd tok/s and MFU: the batch's tokens (prompt + response) / time/update, and 6 x trained
  parameters x those tokens / time/update over the device's peak (--peak-tflops; an H100's or
  H200's 989 dense bf16 on CUDA, none on a CPU);
- push s: the weight sync after the update (time/weight_sync, plus time/weight_push);
- each phase's planned peak (<run>/memory_plan.json) against the measured one (perf/peak_gb/*).
--with-trl: TRL's GRPOTrainer (no vLLM) on the same model folder, batch and lengths
(min_new_tokens = max_new_tokens), a process of its own per side and round, the order
alternating; the ratio of median step times (grouprl / TRL, below 1 is faster).
--json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from architectures import ARCHITECTURES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}  # dense bf16, per GPU
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
TOY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[1])
QWEN_SPECIALS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                 "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}  # fmt: skip
REWARD = "def score(response, ground_truth=None, **kwargs):\n    return sum(w[-1] in '02468' for w in response.split()) / max(len(response.split()), 1)\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen2.5-0.5b", help=f"comma-separated: {', '.join(ARCHITECTURES)}")
    p.add_argument("--toy", action="store_true", help="each family's shapes shrunk (hidden 64, 2 layers): a smoke run")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--batch", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224, help="a VL model's image, pixels a side")
    p.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=2, help="steps per run (the last is reported)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak (0: known GPUs', none on a CPU)")
    p.add_argument("--with-trl", action="store_true", help="TRL's GRPOTrainer on the same model, alternating")
    p.add_argument("--rounds", type=int, default=2, help="--with-trl: alternations")
    p.add_argument("--work", type=Path, default=None, help="where models and runs go (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)  # internal: one TRL run, its args as JSON
    args = p.parse_args(argv)
    if args.toy and args.models == p.get_default("models"):  # every family, shrunk
        args.models = "qwen2.5-0.5b,qwen2.5-vl-3b"
        args.image_size = min(args.image_size, 56)
    unknown = [m for m in args.models.split(",") if m not in ARCHITECTURES]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(ARCHITECTURES)}")
    return args


# ----------------------------------------------------------------------------- the model folder
def model_config(name: str, toy: bool) -> dict:
    values = json.loads(json.dumps(ARCHITECTURES[name]))
    if toy:
        values.update(TOY, max_position_embeddings=4096)
        if "vision_config" in values:
            values["vision_config"].update(TOY_VISION, out_hidden_size=TOY["hidden_size"])
            values["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 2, 2]}
            for special, key in QWEN_SPECIALS.items():  # inside the toy vocabulary
                values[key] = TOY["vocab_size"] - 1 - list(QWEN_SPECIALS).index(special)
        values.update(bos_token_id=0, eos_token_id=1)
    return values


CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def synthetic_tokenizer(values: dict, characters: bool = False):
    """A word-level tokenizer over the whole vocabulary: <pad> and <eos> (the config's EOS id), a
    word "wK" for every other id, a VL model's image tokens at the config's ids; prompts are their
    last message's text. `characters`: the first ids are printable characters, one token each
    (any text tokenises, as a recipe's prompts need), with a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = values.get("vocab_size") or values["text_config"]["vocab_size"]
    specials = {values[key]: token for token, key in QWEN_SPECIALS.items() if key in values}
    eos = values.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) else eos
    named = {eos: "<eos>", **specials}
    free = (i for i in range(vocab_size) if i not in named)
    named[next(free)] = "<pad>"
    if characters:
        for token in ["<|im_start|>", "<|im_end|>", *CHARACTERS]:
            named[next(free)] = token
    vocab = {named.get(i, f"w{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    if characters:
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
    else:
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left")
    added = list(specials.values()) + (["<|im_start|>", "<|im_end|>"] if characters else [])
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": added})
    tokenizer.chat_template = CHATML if characters else "{{ messages[-1]['content'] }}"
    return tokenizer


def write_model(name: str, folder: Path, toy: bool, characters: bool = False) -> Path:
    """The model folder (config, random bf16 weights, tokenizer in tokenizer/, image processor),
    once. `characters`: a tokenizer that reads any text (synthetic_tokenizer)."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    values = model_config(name, toy)
    config = AutoConfig.for_model(**values)
    vision = "vision_config" in values
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = auto.from_config(config, dtype=torch.bfloat16)
    tokenizer = synthetic_tokenizer(values, characters)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp)
    # a folder of its own (model.tokenizer_path): beside a Qwen config.json, AutoTokenizer would
    # build Qwen's BPE tokenizer instead of this one
    tokenizer.save_pretrained(tmp / "tokenizer")
    if vision:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        pixels = IMAGE_SIDE[0] ** 2
        Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


IMAGE_SIDE = [224]  # the run's image size (set from --image-size)


def write_data(folder: Path, vocab_size: int, count: int, prompt_len: int, image: bool, seed: int = 0) -> Path:
    """A plain-layout jsonl: prompts of exactly `prompt_len` words (and one image)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    path = folder / "train.jsonl"
    with path.open("w") as f:
        for i in range(count):
            words = " ".join(f"w{int(t)}" for t in torch.randint(8, vocab_size - 8, (prompt_len,), generator=g))
            row = {"id": f"p{i}", "question": words, "answer": "0"}
            if image:
                side = IMAGE_SIDE[0]
                pixels = torch.randint(0, 255, (side, side, 3), generator=g, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"p{i}.png")
                row["images"] = [f"p{i}.png"]
            f.write(json.dumps(row) + "\n")
    return path


def image_tokens(side: int) -> int:
    return (side // 14) ** 2 // 4 + 2  # merged patches, and the start / end tokens


# ----------------------------------------------------------------------------- one grouprl run
def grouprl_settings(args, model_dir: Path, data: Path, run_dir: Path, vision: bool) -> list[str]:
    prompt = args.prompt_len + (image_tokens(args.image_size) if vision else 0)
    reward = run_dir.parent / "reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(REWARD)
    return [
        f"model.path={model_dir}", f"model.tokenizer_path={model_dir / 'tokenizer'}", f"data.train_files=[{data}]", "data.val_files=[]",
        f"data.train_batch_size={args.batch}", f"data.max_prompt_length={prompt}", "data.sampler=sequential",
        f"rollout.n_agent={args.n}", f"rollout.max_response_length={args.response_len}", "rollout.ignore_eos=true",
        f"rollout.engine={args.engine}", f"actor.micro_batch_size={args.micro_batch}", "actor.policy_loss=gspo",
        f"model.gradient_checkpointing={str(args.checkpointing).lower()}", f"trainer.device={args.device}",
        f"trainer.total_steps={args.steps}", f"trainer.output_dir={run_dir.parent}", f"trainer.experiment_name={run_dir.name}",
        "trainer.val_before_train=false", "trainer.save_final=false", "trainer.save_best=false", "trainer.save_last=false",
        "trainer.resume_mode=disable", "trainer.loggers=[jsonl]", "reward.streaming=false",
        f"reward.components=[{{name: score, function: '{reward}:score'}}]", "reward.val_metric=score",
    ]  # fmt: skip


def run_grouprl(args, model_dir: Path, data: Path, run_dir: Path, vision: bool) -> dict:
    command = [sys.executable, "-m", "grouprl", "train", *grouprl_settings(args, model_dir, data, run_dir, vision)]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"grouprl failed on {model_dir.name}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    return {"steps": steps, "plan": plan, "wall_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- one TRL run
def run_trl_child(spec_path: Path) -> None:
    """In a process of its own: GRPOTrainer over the same folder, data and lengths, each optimizer
    step timed; the step times written next to the spec."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(spec_path.read_text())
    namespace: dict = {}
    exec(REWARD, namespace)  # noqa: S102 - our own reward source, above
    score = namespace["score"]

    def reward(prompts, completions, **_):
        return [float(score(c if isinstance(c, str) else c[0]["content"])) for c in completions]

    rows = [json.loads(x) for x in Path(spec["data"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(Path(spec["model"]) / "tokenizer")
    cuda = spec["device"] == "cuda"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    rows_per_step = spec["batch"] * spec["n"]
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    config = GRPOConfig(
        output_dir=str(spec_path.parent / "trl"), seed=0, use_cpu=not cuda, bf16=cuda, fp16=False,
        per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=rows_per_step // spec["micro_batch"],
        num_generations=spec["n"], max_completion_length=spec["response_len"],
        generation_kwargs={"min_new_tokens": spec["response_len"]}, temperature=1.0,
        activation_checkpointing=spec["checkpointing"], max_steps=spec["steps"], learning_rate=1e-6,
        beta=0.0, importance_sampling_level="sequence", loss_type="grpo", use_vllm=False, report_to="none",
        save_strategy="no", disable_tqdm=True, logging_steps=1, shuffle_dataset=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    (spec_path.parent / "trl_times.json").write_text(json.dumps(times))


def run_trl(args, model_dir: Path, data: Path, work: Path) -> list[float]:
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({
        "model": str(model_dir), "data": str(data), "device": args.device, "batch": args.batch, "n": args.n,
        "micro_batch": args.micro_batch, "response_len": args.response_len, "steps": args.steps,
        "checkpointing": args.checkpointing,
    }))  # fmt: skip
    done = subprocess.run([sys.executable, __file__, "--trl-child", str(spec)], capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"TRL failed on {model_dir.name}: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    return json.loads((work / "trl_times.json").read_text())


# ----------------------------------------------------------------------------- figures
def peak_tflops(args) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    if args.device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    return 0.0


def figures(args, result: dict, trained: int, vision: bool) -> dict:
    last = [s for s in result["steps"] if "time/update" in s][-1]
    prompt = args.prompt_len + (image_tokens(args.image_size) if vision else 0)
    rows = args.batch * args.n
    generated, tokens = rows * args.response_len, rows * (prompt + args.response_len)
    out = {
        "response_len": last["response/length_mean"],
        "gen_tok_s": generated / last["time/generate"],
        "upd_tok_s": tokens / last["time/update"],
        "push_s": last.get("time/weight_sync", 0.0) + last.get("time/weight_push", 0.0),
        "step_s": last["time/step"],
    }
    peak = peak_tflops(args)
    out["mfu"] = 6 * trained * tokens / last["time/update"] / (peak * 1e12) if peak else None
    first = result["steps"][0]
    measured = {"startup": first.get("perf/peak_gb/startup"), "generation": last.get("perf/peak_gb/generation"),
                "update": last.get("perf/peak_gb/update")}  # fmt: skip
    out["peaks"] = {ph: (result["plan"]["phases"][ph]["peak_gb"], measured[ph]) for ph in measured}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_child:
        run_trl_child(args.trl_child)
        return 0
    IMAGE_SIDE[0] = args.image_size
    work = args.work or Path(tempfile.mkdtemp(prefix="grouprl-scale-"))
    rows, records = [], {}
    for name in args.models.split(","):
        vision = "vision_config" in ARCHITECTURES[name]
        folder = write_model(name, work / f"{'toy-' if args.toy else ''}{name}", args.toy)
        values = json.loads((folder / "config.json").read_text())
        vocab = values.get("vocab_size") or values["text_config"]["vocab_size"]
        data = write_data(work / f"data-{folder.name}", vocab, args.batch * args.steps * max(args.rounds, 1), args.prompt_len, vision)
        from grouprl.config import ModelConfig
        from grouprl.trainer.memory import model_shape
        from grouprl.trainer.models import model_config as hf_config

        shape = model_shape(ModelConfig(path=str(folder)), hf_config(ModelConfig(path=str(folder)), str(folder)))
        result = run_grouprl(args, folder, data, work / "runs" / f"{folder.name}-grouprl", vision)
        record = {"params": shape.params, "trained": shape.trainable, **figures(args, result, shape.trainable, vision)}
        if args.with_trl:
            ours, theirs = [], []
            for r in range(args.rounds):
                for side in ("grouprl", "trl") if r % 2 == 0 else ("trl", "grouprl"):
                    if side == "trl":
                        theirs += run_trl(args, folder, data, work / "runs" / f"{folder.name}-trl-{r}")[1:]
                    else:
                        again = run_grouprl(args, folder, data, work / "runs" / f"{folder.name}-grouprl-{r}", vision)
                        ours += [s["time/step"] for s in again["steps"] if "time/step" in s][1:]
            record["trl"] = {"grouprl_step_s": statistics.median(ours), "trl_step_s": statistics.median(theirs)}
            record["trl"]["ratio"] = record["trl"]["grouprl_step_s"] / record["trl"]["trl_step_s"]
        records[folder.name] = record
        rows.append(table_row(folder.name, record))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "CPU"
    print(f"{device}; {args.batch} prompts x {args.n} samples, prompt {args.prompt_len} + response {args.response_len} tokens, "
          f"micro-batch {args.micro_batch}, checkpointing {'on' if args.checkpointing else 'off'}, engine {args.engine}")  # fmt: skip
    print(HEADER)
    print("\n".join(rows))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "models": records}, indent=1))
    return 0


HEADER = (
    "| model | params | gen tok/s | upd tok/s | MFU | push s | start-up GiB plan/meas | generation | update | vs TRL |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(name: str, r: dict) -> str:
    peaks = " | ".join(f"{p:.2f} / {m:.2f}" if m is not None else f"{p:.2f} / -" for p, m in r["peaks"].values())
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
    trl = f"{r['trl']['ratio']:.2f}x" if "trl" in r else "-"
    size = f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.1f}M"
    return f"| {name} | {size} | {r['gen_tok_s']:.0f} | {r['upd_tok_s']:.0f} | {mfu} | {r['push_s']:.2f} | {peaks} | {trl} |"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
