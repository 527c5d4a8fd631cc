"""Frozen answer generators: after <search_complete> (or at max turns) a model that is not
trained writes <answer>...</answer> from the question and the evidence the agent gathered.

- `LocalAnswerGenerator`: a transformers model run by a rollout engine: the policy itself (no
  gradient: generation runs under no_grad) or a separate model loaded with `from_pretrained`.
- `OpenAIAnswerGenerator`: an OpenAI-compatible chat server over httpx, with a timeout; every
  failure (unreachable, timeout, HTTP error, a reply that is not JSON or has no content)
  becomes an `AnswerResult` with `error` set, never an exception.

The loop appends the answer as text tokenized once with the policy's tokenizer, loss mask 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import torch

from grouprl.data.prompts import encode_prompt
from grouprl.errors import ConfigError, ModelLoadError
from grouprl.rollout.agent_prompts import answer_messages
from grouprl.rollout.engines.base import RolloutEngine, SamplingParams

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


@dataclass
class AnswerRequest:
    question: str
    evidence: list[str]  # observation texts the agent gathered, in order


@dataclass
class AnswerResult:
    text: str  # "<answer>...</answer>", or "" when the generator failed
    error: str | None = None  # why it failed (short, no secrets)


class AnswerGenerator(Protocol):
    async def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]: ...


def format_answer(raw: str) -> str:
    """A generator's reply as exactly one <answer>...</answer>: the first tagged answer
    (closed or not), else the whole reply.

    >>> format_answer("Sure. <answer> 1912 </answer> done")
    '<answer>1912</answer>'
    >>> format_answer("1912")
    '<answer>1912</answer>'
    """
    found = _ANSWER.search(raw)
    inner = found.group(1) if found else raw
    return f"<answer>{inner.strip()}</answer>"


class LocalAnswerGenerator:
    """Greedy answers from a transformers model, all requests of a call in one batch."""

    def __init__(self, engine: RolloutEngine, max_tokens: int = 256):
        self.engine = engine
        self.max_tokens = max_tokens

    @classmethod
    def from_pretrained(
        cls, path: str, device: Any, dtype: Any, max_tokens: int = 256
    ) -> LocalAnswerGenerator:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grouprl.rollout.engines import build_engine

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        except Exception as e:  # noqa: BLE001 - any loader failure is the user's path
            raise ModelLoadError(
                f"could not load the answer generator 'hf:{path}': {type(e).__name__}: {e}"
            ) from None
        model.requires_grad_(False)
        return cls(build_engine(None, model, tokenizer), max_tokens)

    async def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]:
        if not requests:
            return []
        tokenizer = self.engine.tokenizer
        prompts = [encode_prompt(tokenizer, answer_messages(r.question, r.evidence)) for r in requests]
        params = SamplingParams(max_new_tokens=self.max_tokens, temperature=0.0, stop=["</answer>"])
        generations = self.engine.generate(prompts, 1, params)
        return [AnswerResult(format_answer(g.text)) for g in generations]


class OpenAIAnswerGenerator:
    """Answers from an OpenAI-compatible /chat/completions endpoint, requests concurrent."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "",
        max_tokens: int = 256,
        timeout_s: float = 60.0,
        max_concurrency: int = 32,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.api_key_env = api_key_env
        if api_key_env and not os.environ.get(api_key_env):
            raise ConfigError(
                f"agent.answer_api_key_env names the environment variable {api_key_env}, which is not set"
            )

    def __repr__(self) -> str:  # the key stays in the environment, never in a repr
        return (
            f"OpenAIAnswerGenerator(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r})"
        )

    async def answer(self, requests: list[AnswerRequest]) -> list[AnswerResult]:
        if not requests:
            return []
        headers = {"Authorization": f"Bearer {os.environ[self.api_key_env]}"} if self.api_key_env else {}
        limit = asyncio.Semaphore(self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=headers) as client:

            async def one(request: AnswerRequest) -> AnswerResult:
                async with limit:
                    return await self._ask(client, request)

            return list(await asyncio.gather(*(one(r) for r in requests)))

    async def _ask(self, client: httpx.AsyncClient, request: AnswerRequest) -> AnswerResult:
        body = {
            "model": self.model,
            "messages": answer_messages(request.question, request.evidence),
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        try:
            reply = await client.post(self.url, json=body)
        except httpx.TimeoutException:
            return AnswerResult("", f"answer generator timed out after {self.timeout_s:g} s")
        except httpx.HTTPError as e:
            return AnswerResult("", f"answer generator unreachable: {type(e).__name__}")
        if reply.status_code != 200:
            return AnswerResult("", f"answer generator returned HTTP {reply.status_code}")
        try:
            content = reply.json()["choices"][0]["message"]["content"]
        except (json.JSONDecodeError, ValueError):
            return AnswerResult("", "answer generator returned a reply that is not JSON")
        except (KeyError, IndexError, TypeError):
            return AnswerResult("", "answer generator reply has no choices[0].message.content")
        if not isinstance(content, str) or not content.strip():
            return AnswerResult("", "answer generator returned an empty answer")
        return AnswerResult(format_answer(content))


def build_answer_generator(
    cfg: Any, policy_engine: RolloutEngine, dtype: torch.dtype = torch.float32
) -> AnswerGenerator | None:
    """The generator `cfg` (an AgentConfig) names; None when the policy answers itself.
    `dtype`: what an `hf:` generator's weights load in (the trainer gives its policy's), on the
    policy engine's device."""
    name = cfg.answer_generator
    if name == "none":
        return None
    if name == "policy":
        return LocalAnswerGenerator(policy_engine, cfg.answer_max_tokens)
    if name.startswith("hf:"):
        return LocalAnswerGenerator.from_pretrained(
            name[3:],
            policy_engine.device,
            dtype,
            cfg.answer_max_tokens,
        )
    if name == "openai":
        return OpenAIAnswerGenerator(
            cfg.answer_base_url,
            cfg.answer_model,
            cfg.answer_api_key_env,
            cfg.answer_max_tokens,
            cfg.answer_timeout_s,
        )
    raise ConfigError(
        f"config key 'agent.answer_generator' must be policy, none, hf:<path> or openai, got {name!r}"
    )
