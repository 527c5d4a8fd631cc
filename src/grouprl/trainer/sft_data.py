"""Conversations for supervised fine-tuning: reading them, and turning them into token ids with a
loss mask that is 1 exactly on the assistant tokens to learn.

A conversation file (jsonl, json list, or parquet) holds one record per conversation:
`{"id"?: str, "messages": [{"role", "content"}, ...], "train_on"?: [message indices],
"images"?: [paths or bytes]}`; without `train_on` every assistant message is trained. For a VLM,
each `<image>` placeholder in a (not trained) message is the next image of `images`, paths
relative to the file. Other fields are ignored.

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

from grouprl.data.dataset import read_records
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


def load_conversations(paths: list[str] | str) -> list[Conversation]:
    """Every conversation of `paths`, checked; problems are one-line `DataError`s."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise DataError("no conversation files given")
    conversations = []
    for path in map(Path, paths):
        records, _ = read_records(path)
        if not records:
            raise DataError(f"conversation file {path} is empty")
        conversations += [_conversation(record, path, row) for row, record in enumerate(records)]
    return conversations


def _conversation(record: dict[str, Any], path: Path, row: int) -> Conversation:
    where = f"{path} record {row}"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with text 'content'")
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: message {i} has role {m.get('role')!r}; allowed: {', '.join(ROLES)}")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    train_on = record.get("train_on")
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
    images = record.get("images") or []
    images = images if isinstance(images, list) else [images]
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if placeholders != len(images):
        raise DataError(
            f"{where}: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)"
        )
    if any(IMAGE_PLACEHOLDER in messages[i]["content"] for i in train_on):
        raise DataError(f"{where}: a trained assistant message holds an {IMAGE_PLACEHOLDER} placeholder")
    images = [resolve(image, path.parent) for image in images]
    for k, image in enumerate(images):
        try:
            check_image(image)
        except ImageError as e:
            raise DataError(f"{where}: image {k}: {e}") from None
    return Conversation(str(record.get("id", f"{path.stem}-{row}")), messages, sorted(set(train_on)), images)


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
