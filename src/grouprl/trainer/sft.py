"""Supervised fine-tuning on conversations (`grouprl sft`): the warm start that teaches a policy
the agent protocol before RL.

loss = mean negative log-likelihood over the trained tokens of a batch (assistant contents and
their end-of-turn token; see `sft_data`), summed over micro-batches with each micro-batch's NLL
divided by the batch's token count, so accumulation gives the same gradient as one big batch.
The LM head runs only at trained positions, in chunks, so no [tokens, vocab] tensor is made for
prompts or observations. Each batch is sorted by length before it is cut into micro-batches.

Output: `<sft.output_dir>/model` (save_pretrained + tokenizer: `model.path` for the RL phase),
`metrics.jsonl` (train/loss per step, eval/loss), `samples.jsonl` (greedy first turns on
held-out prompts before and after training), and with `sft.val_rl_files` `answers.jsonl`: the
greedy answers to RL held-out prompts, scored as `grouprl eval` scores them (a `step` field,
then `grouprl.trainer.evaluation`'s format), with eval/accuracy in the metrics.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from pathlib import Path

import torch
import yaml

from grouprl.config import Config, SFTConfig, to_dict
from grouprl.data import load_samples
from grouprl.data.layout import describe_data_file
from grouprl.data.prompts import with_system_prompt
from grouprl.errors import ConfigError, DataError
from grouprl.rewards import CompositeReward
from grouprl.rollout.trajectory import Trajectory
from grouprl.trainer.checkpoint import CheckpointManager
from grouprl.trainer.evaluation import (
    answer_held_out,
    answer_record,
    metrics_of,
    reward_config,
    rows_of,
    skipped_record,
)
from grouprl.trainer.export import export_model
from grouprl.trainer.head_stats import chunked_token_stats
from grouprl.trainer.loggers import ConsoleLogger, make_loggers
from grouprl.trainer.models import (
    load_policy,
    resolve_device,
    resolve_dtype,
    shape_stable_attention,
)
from grouprl.trainer.optim import build_optimizer, build_scheduler
from grouprl.trainer.sft_data import Conversation, TokenizedConversation, load_conversations, tokenize_all

log = logging.getLogger(__name__)

# A first turn in the protocol: optional think, then one action tag.
PROTOCOL_TURN = re.compile(
    r"^\s*(<think>.*?</think>\s*)?(<search>.+?</search>|<bbox>.+?</bbox>|<search_complete>.+?</search_complete>"
    r"|<answer>.+?</answer>)\s*$",
    re.DOTALL,
)
CONSOLE_KEYS = [
    ("train/loss", "loss"),
    ("eval/loss", "eval"),
    ("eval/accuracy", "acc"),
    ("train/lr", "lr"),
    ("time/step", "s/step"),
]


def validate_sft(s: SFTConfig) -> None:
    """What a sft run adds to the sft section's own checks (`SFTConfig`, run when the config
    loads, before any model): a warning for an RL-sized learning rate."""
    if s.optim.lr < 1e-5:
        log.warning(
            "sft.optim.lr=%g is an RL-sized step; supervised fine-tuning usually wants 1e-5..1e-4", s.optim.lr
        )


def check_val_rl(cfg: Config) -> None:
    """sft.val_rl_files are answered in one turn: an agent's prompts need its loop (`grouprl eval`)."""
    if cfg.sft.val_rl_files and cfg.agent.enabled:
        raise ConfigError(
            "sft.val_rl_files answers single-turn prompts; with agent.enabled evaluate the saved model with grouprl eval"
        )


def describe_sft(cfg: Config) -> list[str]:
    """What `grouprl sft` would do, without loading a model or writing data. Each data file's
    layout comes from its columns (`grouprl.data.layout`): a needed column absent is a DataError."""
    s = cfg.sft
    check_val_rl(cfg)

    def files(role: str, paths: list[str], purpose: str) -> list[str]:
        return [
            f"data ({role}): {f}: "
            + (describe_data_file(f, purpose, s.reply_template) if Path(f).exists() else "[WARNING: not found]")
            for f in paths
        ]

    if s.train_files:
        data = files("train", s.train_files, "sft") + files("held-out", s.val_files, "sft")
    else:
        folder = s.task_dir or str(Path(s.output_dir) / "data")
        ending = "the policy's own <answer>" if s.task_self_answer else "<search_complete>"
        pages = ", page images in the search observations" if s.task_page_images else ""
        data = [
            f"data: built-in task '{s.task}' (seed {s.task_seed}): {s.task_train_size} train / "
            f"{s.task_val_size} held-out gold trajectories ending with {ending}{pages}, written to {folder}"
        ]
    if s.val_rl_files:
        data += files("held-out accuracy", s.val_rl_files, "rl")
        data.append(
            f"held-out accuracy: greedy answers of <= {cfg.rollout.max_response_length} tokens scored by "
            f"reward.val_metric={cfg.reward.val_metric}, before and after training"
            + (f" and every {s.eval_freq} steps" if s.eval_freq else "")
        )
    steps = f"{s.max_steps} steps" if s.max_steps else f"{s.epochs} epoch(s)"
    accumulation = math.ceil(s.batch_size / s.micro_batch_size)
    lora = f" + LoRA r={cfg.model.lora.rank}" if cfg.model.lora.rank else ""
    answers = ", answers.jsonl" if s.val_rl_files else ""
    return [
        *data,
        f"policy: {cfg.model.path}{lora} on {cfg.trainer.device} ({cfg.model.dtype})",
        f"run: {steps}, {s.batch_size} conversations a step in {accumulation} micro-batch(es) of "
        f"{s.micro_batch_size}, max {s.max_length} tokens ({s.overflow})",
        f"lr: {s.optim.lr:g} ({s.optim.scheduler}, warm-up {s.optim.warmup_steps or f'{s.optim.warmup_ratio:.0%}'}), "
        f"grad clip {s.optim.grad_clip:g}",
        f"output: {Path(s.output_dir) / 'model'} (+ metrics.jsonl, samples.jsonl{answers})",
    ]


def load_sft_conversations(
    s: SFTConfig, system_prompt: str | None = None
) -> tuple[list[Conversation], list[Conversation]]:
    """Training and held-out conversations: from files (`system_prompt`: data.system_prompt, for
    RL-layout files), or the task's gold trajectories (written first)."""
    if s.train_files:
        val = load_conversations(s.val_files, s.reply_template, system_prompt) if s.val_files else []
        return load_conversations(s.train_files, s.reply_template, system_prompt), val
    if s.task == "shapes":  # drawn in memory: images are PNG bytes
        from grouprl.data.tasks.shapes import conversations
        from grouprl.trainer.sft_data import _conversation

        where = Path("<task shapes>")
        return (
            [
                _conversation(r, where, i)
                for i, r in enumerate(conversations(s.task_train_size, s.task_seed, "train"))
            ],
            [
                _conversation(r, where, i)
                for i, r in enumerate(conversations(s.task_val_size, s.task_seed, "val"))
            ],
        )
    from grouprl.rollout.gold import write_slides_task

    folder = Path(s.task_dir) if s.task_dir else Path(s.output_dir) / "data"
    files = write_slides_task(
        folder, s.task_seed, s.task_train_size, s.task_val_size, self_answer=s.task_self_answer,
        page_images=s.task_page_images,
    )
    val = load_conversations([str(files.sft_val)]) if s.task_val_size else []
    return load_conversations([str(files.sft_train)]), val


# -- the loss -----------------------------------------------------------------------------
def pad_right(rows: list[TokenizedConversation], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """ids, attention mask and loss mask, each [N, W], right-padded to the longest row."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        ids[i, :n] = torch.tensor(r.input_ids)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r.loss_mask)
    return ids.to(device), attention.to(device), loss_mask.to(device)


def nll_sum(
    model, rows: list[TokenizedConversation], pad_id: int, chunk_size: int = 256, vision=None
) -> tuple[torch.Tensor, int]:
    """Summed NLL of the trained tokens of `rows`, and how many there are. Differentiable.
    `vision`: a VLM's family; the rows' images enter as embeddings at the family's positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # through peft
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    device = next(model.parameters()).device
    ids, attention, loss_mask = pad_right(rows, pad_id, device)
    if vision is None:
        inputs = {"input_ids": ids}
    else:
        images = [r.images for r in rows]
        inputs = {
            "inputs_embeds": vision.embed(model, ids, [im for row in images for im in row]),
            "position_ids": vision.batch_positions(ids, attention, images),
        }
    hidden = decoder(**inputs, attention_mask=attention, use_cache=False).last_hidden_state  # [N, W, H]
    targets_mask = loss_mask[:, 1:].bool()  # token t is predicted by position t - 1
    predictors = hidden[:, :-1][targets_mask]  # [M, H]
    targets = ids[:, 1:][targets_mask]  # [M]
    log_probs, _ = chunked_token_stats(predictors, targets, head, chunk_size=chunk_size)
    return -log_probs.sum(), int(targets.numel())


def micro_batches(rows: list[TokenizedConversation], size: int) -> list[list[TokenizedConversation]]:
    """Longest first, then cut: rows of like length share a micro-batch (less padding)."""
    ordered = sorted(rows, key=lambda r: -len(r.input_ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def train_step(
    model, batch: list[TokenizedConversation], pad_id: int, s: SFTConfig, vision=None
) -> tuple[float, int]:
    """Backward of the batch's mean NLL (accumulated over micro-batches); returns (loss, trained tokens)."""
    total = sum(r.num_targets for r in batch)
    loss_value = 0.0
    for micro in micro_batches(batch, s.micro_batch_size):
        nll, _ = nll_sum(model, micro, pad_id, s.logits_chunk_size, vision)
        loss = nll / total
        loss.backward()
        loss_value += float(loss.detach())
    return loss_value, total


@torch.no_grad()
def mean_nll(model, rows: list[TokenizedConversation], pad_id: int, s: SFTConfig, vision=None) -> float:
    """Token-mean NLL over `rows` (the eval loss)."""
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for micro in micro_batches(rows, s.micro_batch_size):
        nll, n = nll_sum(model, micro, pad_id, s.logits_chunk_size, vision)
        total_nll, total_tokens = total_nll + float(nll), total_tokens + n
    model.train(was_training)
    return total_nll / max(total_tokens, 1)


def batches_for(n_rows: int, s: SFTConfig, total_steps: int) -> list[list[int]]:
    """Row indices of each optimizer step: a fresh seeded shuffle every epoch, the last batch of an
    epoch possibly smaller; cut at total_steps."""
    rng = random.Random(s.seed)
    steps: list[list[int]] = []
    while len(steps) < total_steps:
        order = list(range(n_rows))
        rng.shuffle(order)
        steps += [order[i : i + s.batch_size] for i in range(0, n_rows, s.batch_size)]
    return steps[:total_steps]


# -- previews -----------------------------------------------------------------------------
@torch.no_grad()
def preview(
    model, tokenizer, conversations: list[Conversation], max_new_tokens: int, vision=None
) -> list[dict]:
    """Greedy first turn of each conversation (its messages before the first trained one);
    `vision`: a VLM's processor, which shows the turn's images."""
    from grouprl.data.prompts import encode_prompt
    from grouprl.rollout.engines import SamplingParams, build_engine

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    engine = build_engine(None, model, tokenizer, vision=vision.family) if vision is not None else None
    out = []
    for c in conversations:
        if engine is not None:
            shown = c.messages[: c.train_on[0]]
            count = sum(m["content"].count("<image>") for m in shown)
            prompt, images = vision.encode(shown, c.images[:count])
            (generation,) = engine.generate(
                [prompt], 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), images=[images]
            )
            text = generation.text
        else:
            prompt = encode_prompt(tokenizer, c.messages[: c.train_on[0]])
            generated = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :]
            text = tokenizer.decode(generated, skip_special_tokens=True)
        out.append(
            {
                "id": c.id,
                "question": c.messages[c.train_on[0] - 1]["content"],
                "expected": c.messages[c.train_on[0]]["content"],
                "generated": text,
                "protocol": bool(PROTOCOL_TURN.match(text)),
                "exact": text.strip() == c.messages[c.train_on[0]]["content"].strip(),
            }
        )
    model.train(was_training)
    return out


# -- the run ------------------------------------------------------------------------------
def run_sft(cfg: Config) -> dict:
    """Fine-tune `cfg.model` on `cfg.sft`'s conversations and save it; returns a summary."""
    run = SFTRun(cfg)
    run.evaluate_start()
    run.train()
    return run.finish()


class SFTRun:
    """One SFT run: data and the model loaded (data errors before the model loads), then
    evaluations before and after, the training steps, and the export."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.s = s = cfg.sft
        validate_sft(s)
        random.seed(s.seed)
        torch.manual_seed(s.seed)
        self.out = Path(s.output_dir)
        # data errors before the model loads
        train_conversations, val_conversations = load_sft_conversations(s, cfg.data.system_prompt)
        check_val_rl(cfg)
        self.held_out = load_samples(s.val_rl_files, max_samples=s.val_rl_max_samples) if s.val_rl_files else []
        for sample in self.held_out:  # the prompts training sees
            sample.messages = with_system_prompt(sample.messages, cfg.data.system_prompt)
        # reward mistakes (a missing file, an unknown judge) before the model loads too
        self.reward = CompositeReward.from_config(reward_config(cfg), run_dir=self.out) if self.held_out else None

        device = resolve_device(cfg.trainer.device)
        shape_stable_attention(device)
        loaded = load_policy(cfg, device, resolve_dtype(cfg.model.dtype, device))
        self.model, self.tokenizer, self.vision, self.family = loaded.model, loaded.tokenizer, loaded.vision, loaded.family
        self.pad_id = self.tokenizer.pad_token_id
        if self.vision is None and any(sample.images for sample in self.held_out):
            raise DataError(f"sft.val_rl_files have images but model.path '{cfg.model.path}' is a text-only model")
        self.train_rows, self.val_rows, self.train_counts = self._tokenize(train_conversations, val_conversations)
        self.total_steps = s.max_steps or s.epochs * math.ceil(len(self.train_rows) / s.batch_size)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, s.optim)
        self.scheduler = build_scheduler(self.optimizer, s.optim, self.total_steps)
        self._prepare_folder()
        self._open_logs(val_conversations[: s.preview_samples])

    def _tokenize(self, train_conversations, val_conversations):
        s = self.s
        train, train_counts = tokenize_all(self.tokenizer, train_conversations, s.max_length, s.overflow, self.vision)
        val, _ = tokenize_all(self.tokenizer, val_conversations, s.max_length, s.overflow, self.vision)
        if s.eval_max_conversations:
            val = val[: s.eval_max_conversations]
        if not train:
            raise ConfigError(f"every training conversation is longer than sft.max_length={s.max_length} tokens")
        if train_counts["skipped"] or train_counts["truncated"]:
            log.warning(
                "training conversations over %d tokens: %d skipped, %d truncated",
                s.max_length,
                train_counts["skipped"],
                train_counts["truncated"],
            )
        return train, val, train_counts

    def _prepare_folder(self) -> None:
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        CheckpointManager(out, keep_last=0).sweep((out / "model",))  # an export a killed run left half-written
        for stale in ("metrics.jsonl", "samples.jsonl", "answers.jsonl"):  # a rerun in the same folder starts them afresh
            (out / stale).unlink(missing_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))

    def _open_logs(self, previews: list[Conversation]) -> None:
        cfg, out = self.cfg, self.out
        self.loggers = make_loggers(
            self.s.loggers,
            out,
            total_steps=self.total_steps,
            start_step=0,
            project=cfg.trainer.project_name,
            experiment=out.name,
            config=to_dict(cfg),
        )
        self.console = next((logger for logger in self.loggers if isinstance(logger, ConsoleLogger)), None)
        if self.console is not None:
            self.console.KEYS = CONSOLE_KEYS
        self.previews = previews
        self.samples_file = (out / "samples.jsonl").open("a", encoding="utf-8")
        self.answers_file = (out / "answers.jsonl").open("a", encoding="utf-8") if self.held_out else None
        self.summary: dict = {
            "steps": self.total_steps,
            "train_conversations": len(self.train_rows),
            "train_tokens": 0,  # every token the model read
            "train_target_tokens": 0,  # the trained ones
            "skipped": self.train_counts["skipped"],
            "truncated": self.train_counts["truncated"],
        }

    def log_all(self, metrics: dict, step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def write_previews(self, when: str, metrics: dict) -> None:
        records = preview(self.model, self.tokenizer, self.previews, self.s.preview_max_tokens, self.vision)
        for r in records:
            self.samples_file.write(json.dumps({"when": when, **r}, ensure_ascii=False) + "\n")
        for key in ("protocol", "exact"):  # share of protocol-shaped turns, of turns equal to the gold one
            rate = sum(r[key] for r in records) / len(records)
            self.summary[f"{key}_rate_{when}"] = metrics[f"eval/{key}_rate"] = rate

    def held_out_accuracy(self, step: int, metrics: dict) -> float:
        """Greedy answers to the RL held-out prompts, scored; their lines in answers.jsonl."""
        cfg = self.cfg
        progress = self.console.chunk if self.console is not None else None
        answers = answer_held_out(self.model, self.tokenizer, self.vision, self.held_out, cfg, progress=progress)
        answered = [a for a in answers if isinstance(a, Trajectory)]
        if not answered:
            raise DataError(
                f"every sft.val_rl_files prompt is longer than data.max_prompt_length={cfg.data.max_prompt_length} tokens"
            )
        self.reward.score(answered)
        metrics.update(metrics_of(rows_of(answered, cfg.reward.val_metric), prefix="eval"))
        for a in answers:
            record = answer_record(a, cfg.reward.val_metric) if isinstance(a, Trajectory) else skipped_record(a)
            self.answers_file.write(json.dumps({"step": step, **record}, ensure_ascii=False, default=str) + "\n")
        self.answers_file.flush()
        return metrics["eval/accuracy"]

    def eval_loss(self) -> float:
        return mean_nll(self.model, self.val_rows, self.pad_id, self.s, self.family)

    def evaluate_start(self) -> None:
        metrics = {"data/skipped": self.train_counts["skipped"], "data/truncated": self.train_counts["truncated"]}
        if self.val_rows:
            self.summary["eval_loss_before"] = metrics["eval/loss"] = self.eval_loss()
        if self.held_out:
            self.summary["accuracy_before"] = self.held_out_accuracy(0, metrics)
        if self.previews:
            self.write_previews("before", metrics)
        self.log_all(metrics, 0)

    def train(self) -> None:
        s, total_steps = self.s, self.total_steps
        self.model.train()
        self.started, self.started_cpu = time.perf_counter(), time.process_time()
        self.losses = []
        for step, index in enumerate(batches_for(len(self.train_rows), s, total_steps), start=1):
            metrics = self.step([self.train_rows[i] for i in index])
            if s.eval_freq and step % s.eval_freq == 0 and step != total_steps:
                if self.val_rows:
                    metrics["eval/loss"] = self.eval_loss()
                if self.held_out:
                    self.held_out_accuracy(step, metrics)
            self.log_all(metrics, step)
            if "console" not in s.loggers:
                log.info("sft step %d/%d loss %.4f", step, total_steps, metrics["train/loss"])

    def step(self, batch: list[TokenizedConversation]) -> dict:
        """One optimizer step on `batch`; its metrics."""
        t0 = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        loss, targets = train_step(self.model, batch, self.pad_id, self.s, self.family)
        tokens = sum(len(r.input_ids) for r in batch)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.s.optim.grad_clip or float("inf")))
        self.optimizer.step()
        self.scheduler.step()
        self.losses.append(loss)
        self.summary["train_tokens"] += tokens
        self.summary["train_target_tokens"] += targets
        elapsed = time.perf_counter() - t0
        return {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens": tokens,
            "train/target_tokens": targets,
            "time/step": elapsed,
            "perf/tokens_per_s": tokens / elapsed,
        }

    def finish(self) -> dict:
        """The last evaluation, the logs closed, and the model exported; the summary."""
        summary, metrics = self.summary, {}
        if self.val_rows:
            summary["eval_loss_after"] = metrics["eval/loss"] = self.eval_loss()
        if self.held_out:
            summary["accuracy_after"] = self.held_out_accuracy(self.total_steps, metrics)
            self.answers_file.close()
            self.reward.close()
        if self.previews:
            self.write_previews("after", metrics)
        self.log_all(metrics, self.total_steps)
        self.samples_file.close()
        for logger in self.loggers:
            logger.close()
        summary.update(
            first_loss=self.losses[0],
            last_loss=self.losses[-1],
            train_seconds=time.perf_counter() - self.started,
            train_cpu_seconds=time.process_time() - self.started_cpu,  # what a shared machine's wall time hides
        )
        summary["model"] = str(
            export_model(
                self.model,
                self.tokenizer,
                self.out / "model",
                merge_lora=self.s.merge_lora,
                meta={"sft": {k: v for k, v in summary.items() if k != "model"}},
                processor=self.vision,
            )
        )
        return summary


