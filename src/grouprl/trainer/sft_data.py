"""Conversations for supervised fine-tuning: reading them, and turning them into token ids with a
loss mask that is 1 exactly on the assistant tokens to learn.

A conversation file (jsonl, json list, or parquet) holds one record per conversation:
`{"id"?: str, "messages": [{"role", "content"}, ...], "train_on"?: [message indices],
"images"?: [paths, bytes or {bytes, path} dicts]}`; without `train_on` every assistant message
is trained. For a VLM, each `<image>` placeholder in a (not trained) message is the next image of
`images`, paths relative to the file. Other fields are ignored.

A file without `messages` is read as RL data (`grouprl.data.dataset`: the verl or the plain
layout, its images and uids as RL reads them): a verl `prompt` ending with an assistant turn is
the conversation itself (`train_on` as above); any other prompt gets its ground truth
(`reward_model.ground_truth`, the plain layout's `answer`) as the assistant's reply, the one
message trained, written into `reply_template` at `{ground_truth}` (default: the ground truth as
it is; a list of accepted answers gives its first). data.system_prompt applies to RL data as in RL.

Tokens are built by appending per-message deltas of the chat template, never by re-tokenizing
a decoded text: the text the template adds for message k is `render(messages[:k+1])` minus
`render(messages[:k])`. A trained assistant message is cut into
`header` (the generation prompt, e.g. "<|im_start|>assistant\\n") + `content` + `tail`
(e.g. "<|im_end|>\\n"), each tokenized on its own; the mask is 1 on the content and on the tail
up to and including the end-of-turn token (the tokenizer's eos, <|im_end|> in ChatML), since
generation stops there; the separator after it is 0. A template with no eos in the tail (a base
model's "role: content" lines) trains the content only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.data.dataset import read_records, to_samples
from grouprl.data.layout import LAYOUTS, REPLY_FIELD, layout_of
from grouprl.data.prompts import with_system_prompt
from grouprl.data.sample import Sample
from grouprl.errors import DataError
from grouprl.vision.images import IMAGE_PLACEHOLDER, ImageError, check_image, resolve

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    train_on: list[int]  # indices of the assistant messages to learn
    images: list = field(default_factory=list)  # paths or bytes, one per <image> placeholder, in order


@dataclass
class TokenizedConversation:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a training target
    images: list = field(default_factory=list)  # processed images (VLMs), in the order of their tokens

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


def load_conversations(
    paths: list[str] | str, reply_template: str = REPLY_FIELD, system_prompt: str | None = None
) -> list[Conversation]:
    """Every conversation of `paths` (conversation files, or RL data: see the module docstring),
    checked; problems are one-line `DataError`s. `system_prompt` (data.system_prompt) replaces
    or goes before the system message of RL data, as RL's prompts get it."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise DataError("no conversation files given")
    conversations = []
    for path in map(Path, paths):
        records, columns = read_records(path)
        if not records:
            raise DataError(f"conversation file {path} is empty")
        kind = layout_of(columns, "sft")
        if kind == "conversations":
            conversations += [_conversation(record, path, row) for row, record in enumerate(records)]
        elif kind is None:
            raise DataError(
                f"{path} has columns {', '.join(columns)}; expected conversations (messages), or the {LAYOUTS}"
            )
        else:
            samples = to_samples(records, columns, path)
            for sample in samples:
                sample.messages = with_system_prompt(sample.messages, system_prompt)
            truth = "reward_model.ground_truth" if kind == "verl" else "'answer'"
            conversations += [
                _from_sample(sample, record.get("train_on"), f"{path} record {row}", truth, reply_template)
                for row, (sample, record) in enumerate(zip(samples, records))
            ]
    return conversations


def reply_from(ground_truth: Any, reply_template: str = REPLY_FIELD) -> str | None:
    """The assistant's reply formed from a ground truth (text or a number; a list of accepted
    answers: its first), None where it gives no text (missing, empty, or a dict)."""
    if isinstance(ground_truth, list):
        ground_truth = ground_truth[0] if ground_truth else None
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        return None
    text = str(ground_truth)
    return reply_template.replace(REPLY_FIELD, text) if text.strip() else None


def _from_sample(sample: Sample, train_on: Any, where: str, truth: str, reply_template: str) -> Conversation:
    """An RL sample as a conversation: a prompt ending with an assistant turn is one (its
    assistant turns learned); any other gets the ground truth as the reply, the one turn learned
    (earlier assistant turns, e.g. a few-shot example, are context). Its images were resolved
    and checked when the sample was read."""
    messages = _checked_messages(sample.messages, where)
    if messages[-1]["role"] != "assistant":
        reply = reply_from(sample.ground_truth, reply_template)
        if reply is None:
            raise DataError(
                f"{where}: the prompt does not end with an assistant turn and has no {truth} "
                "(text, a number, or a list of them) to learn as the reply"
            )
        messages.append({"role": "assistant", "content": reply})
        train_on = [len(messages) - 1] if train_on is None else train_on
    return _build(sample.uid, messages, train_on, list(sample.images), where)


def _conversation(record: dict[str, Any], path: Path, row: int) -> Conversation:
    where = f"{path} record {row}"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    messages = _checked_messages(messages, where)
    images = record.get("images") or []
    images = [resolve(image, path.parent) for image in (images if isinstance(images, list) else [images])]
    for k, image in enumerate(images):
        try:
            check_image(image)
        except ImageError as e:
            raise DataError(f"{where}: image {k}: {e}") from None
    return _build(str(record.get("id", f"{path.stem}-{row}")), messages, record.get("train_on"), images, where)


def _checked_messages(messages: list[Any], where: str) -> list[dict[str, str]]:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with text 'content'")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: message {i} has role {m.get('role')!r}; allowed: {', '.join(ROLES)}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _build(name: str, messages: list[dict[str, str]], train_on: Any, images: list, where: str) -> Conversation:
    """The conversation, its trained messages and placeholders checked."""
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on is None:
        train_on = assistant
    if not isinstance(train_on, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in train_on):
        raise DataError(f"{where}: 'train_on' must be a list of message indices")
    if not train_on:
        raise DataError(f"{where}: no assistant message to train on")
    bad = [i for i in train_on if i not in assistant]
    if bad:
        raise DataError(f"{where}: 'train_on' index {bad[0]} is not an assistant message")
    if 0 in train_on:
        raise DataError(f"{where}: a trained assistant message needs a message before it")
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if placeholders != len(images):
        raise DataError(
            f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)"
        )
    if any(IMAGE_PLACEHOLDER in messages[i]["content"] for i in train_on):
        raise DataError(f"{where}: a trained assistant message holds an {IMAGE_PLACEHOLDER} placeholder")
    return Conversation(name, messages, sorted(set(train_on)), images)


# -- tokens -------------------------------------------------------------------------------
def render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template's text; a tokenizer without one gets "role: content" lines and "assistant:"
    (as `grouprl.data.prompts.encode_prompt` does)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _after(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
        raise DataError(
            f"the chat template re-renders earlier text when {what}; per-message token deltas are not exact for it"
        )
    return text[len(prefix) :]


def tokenize_conversation(
    tokenizer: Any, conversation: Conversation, vision: Any = None
) -> TokenizedConversation:
    """Token ids of the whole conversation and its loss mask (see the module docstring);
    `vision` (a VLM's VisionProcessor) turns the images into tokens and model inputs."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    messages = conversation.messages
    images = [vision.prepare_image(image) for image in conversation.images] if vision is not None else []
    if conversation.images and vision is None:
        raise DataError(f"conversation {conversation.id} has images but the model reads none (not a VLM)")
    used = 0

    def encode_with_images(text: str) -> list[int]:
        nonlocal used
        k = text.count(IMAGE_PLACEHOLDER)
        if not k or vision is None:
            return _encode(tokenizer, text)
        used += k
        return vision.encode_text(text, images[used - k : used])

    for k, message in enumerate(messages):
        full = render(tokenizer, messages[: k + 1])
        if k not in conversation.train_on:
            piece = encode_with_images(_after(full, rendered, f"adding message {k}"))
            ids += piece
            mask += [0] * len(piece)
            rendered = full
            continue
        prompted = render(tokenizer, messages[:k], add_generation_prompt=True)
        header = _after(prompted, rendered, "adding the generation prompt")
        body = _after(full, prompted, f"adding assistant message {k}")
        start = body.find(message["content"])
        if start < 0:
            raise DataError(
                f"the chat template does not render assistant message {k} of {conversation.id} verbatim"
            )
        lead, tail = body[:start], body[start + len(message["content"]) :]
        context = _encode(tokenizer, header) + _encode(tokenizer, lead)
        content = _encode(tokenizer, message["content"])
        tail_ids = _encode(tokenizer, tail)
        trained_tail = tail_ids.index(eos) + 1 if eos is not None and eos in tail_ids else 0
        ids += context + content + tail_ids
        mask += (
            [0] * len(context)
            + [1] * len(content)
            + [1] * trained_tail
            + [0] * (len(tail_ids) - trained_tail)
        )
        rendered = full
    return TokenizedConversation(conversation.id, ids, mask, images)


def tokenize_all(
    tokenizer: Any, conversations: list[Conversation], max_length: int, overflow: str, vision: Any = None
) -> tuple[list[TokenizedConversation], dict[str, int]]:
    """Tokenized conversations that fit `max_length` (overflow: skip, or keep the first max_length
    tokens), and counts of skipped / truncated ones. A truncated conversation left with no
    target is skipped too, and so is one with images (a cut could split an image's tokens)."""
    kept, counts = [], {"skipped": 0, "truncated": 0}
    for conversation in conversations:
        t = tokenize_conversation(tokenizer, conversation, vision)
        if len(t.input_ids) > max_length:
            if overflow == "skip" or t.images:
                counts["skipped"] += 1
                continue
            t = TokenizedConversation(t.id, t.input_ids[:max_length], t.loss_mask[:max_length])
            counts["truncated"] += 1
            if not t.num_targets:
                counts["skipped"] += 1
                continue
        kept.append(t)
    return kept, counts
