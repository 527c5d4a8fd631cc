"""Token ids of what the agent loop inserts between two policy turns, rendered by the policy's
own chat template: the end of the assistant turn, the observation message, and the generation
prompt of the next assistant turn.

The ids are the delta between the template applied to a conversation that ends with the
observation (plus the generation prompt) and the same conversation cut right after the
assistant's content. The assistant's content is a placeholder, so the delta holds only what
the template writes after it. That keeps the delta right for templates that are not
append-only: ones that inject a default system prompt when none is given (Qwen2.5, SmolLM2),
ones that rewrite earlier assistant turns (dropping <think> blocks), ones whose generation
prompt adds text. The trajectory's own earlier tokens are never re-rendered.

Shapes of the delta for an observation "OBS":
    ChatML   <|im_end|>\\n<|im_start|>user\\nOBS<|im_end|>\\n<|im_start|>assistant\\n
    Llama-3  <|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\nOBS<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n
"""

from __future__ import annotations

from typing import Any

from grouprl.data.prompts import _flat_ids
from grouprl.errors import ConfigError

# Stand-ins rendered through the template; neither has edge whitespace a template could trim.
_ASSISTANT = "GRPL-ASSISTANT-CONTENT-0x5f3759df"
_QUESTION = "GRPL-QUESTION"


class ChatRenderer:
    """Renders observation messages through `tokenizer`'s chat template, token-exactly.

    role: the observation message's role ("user", or "tool" where the template knows it).
    A tokenizer without a chat template gets plain "role: content" lines, as
    `grouprl.data.prompts.encode_prompt` writes prompts for it.
    """

    def __init__(self, tokenizer: Any, role: str = "user"):
        self.tokenizer = tokenizer
        self.role = role
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._check_role()

    def _render(self, observation: str) -> tuple[str, int]:
        """(conversation text with the observation and generation prompt, index just past the
        assistant placeholder)."""
        if not self.has_template:
            text = f"user: {_QUESTION}\nassistant: {_ASSISTANT}\n{self.role}: {observation}\nassistant:"
            return text, text.rfind(_ASSISTANT) + len(_ASSISTANT)
        messages = [
            {"role": "user", "content": _QUESTION},
            {"role": "assistant", "content": _ASSISTANT},
            {"role": self.role, "content": observation},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        cut = text.rfind(_ASSISTANT)
        if cut < 0:
            raise ConfigError(
                "the chat template drops assistant messages; it cannot render multi-turn agents"
            )
        return text, cut + len(_ASSISTANT)

    def _check_role(self) -> None:
        marker = "GRPL-OBSERVATION"
        try:
            text, cut = self._render(marker)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a jinja template may raise for a role it rejects
            raise ConfigError(
                f"the chat template cannot render an observation with role {self.role!r} "
                f"(agent.observation_role): {type(e).__name__}: {e}"
            ) from None
        if marker not in text[cut:]:
            raise ConfigError(
                f"the chat template drops messages with role {self.role!r}; set agent.observation_role=user"
            )

    def _encode(self, text: str) -> list[int]:
        return _flat_ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation_text(self, observation: str) -> str:
        """The text the template writes after an assistant turn's content for this observation."""
        text, cut = self._render(observation)
        return text[cut:]

    def observation_ids(
        self, observation: str, closing_token: int | None = None, images: list | None = None, expand=None
    ) -> list[int]:
        """Token ids to append after a policy segment: end of turn + observation + generation prompt.

        closing_token: the segment's last token when the segment ended at EOS. When that token
        is the template's end-of-turn token, it is not written twice. images / expand: a VLM
        policy's observation images, whose `<image>` placeholders in `observation` become their
        tokens through `expand(text, images)` (grouprl.vision VisionProcessor.encode_text).
        """
        text, cut = self._render(observation)
        encode = (lambda t: expand(t, images)) if images else self._encode
        whole, head = encode(text), self._encode(text[:cut])
        if whole[: len(head)] == head:
            delta = whole[len(head) :]
        else:  # the tokenizer merged across the cut: tokenize the delta on its own
            delta = encode(text[cut:])
        if closing_token is not None and delta and delta[0] == closing_token:
            delta = delta[1:]
        return delta
