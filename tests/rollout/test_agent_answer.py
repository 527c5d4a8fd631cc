"""Frozen answer generators: a real OpenAI-compatible server on 127.0.0.1 (good replies, HTTP
errors, replies that are not JSON, timeouts, a closed port), the API key only from the
environment, and local transformers models (the policy itself, or a folder)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_agent import ScriptedEngine, samples, scripted, spans
from test_chat import EXPECTED_DELTA, chat_tokenizer

from grouprl.config import AgentConfig
from grouprl.data.prompts import encode_prompt
from grouprl.errors import ConfigError, ModelLoadError
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.agent_prompts import answer_messages
from grouprl.rollout.answer import (
    AnswerRequest,
    LocalAnswerGenerator,
    OpenAIAnswerGenerator,
    build_answer_generator,
    format_answer,
)
from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from helpers import tiny_model_and_tokenizer

KEY_ENV, KEY = "GRPL_TEST_ANSWER_KEY", "sk-test-0123456789"


class Handler(BaseHTTPRequestHandler):
    """Behaviour by the requested model name."""

    received: list = []

    def do_POST(self):  # noqa: N802 - the http.server interface
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.received.append((self.path, self.headers.get("Authorization"), body))
        model = body["model"]
        if model == "slow":
            time.sleep(1.0)
        if model == "broken":
            self._reply(503, b'{"error": "overloaded"}')
        elif model == "html":
            self._reply(200, b"<html>gateway</html>")
        elif model == "nochoices":
            self._reply(200, json.dumps({"error": {"message": "bad"}}).encode())
        else:
            question = body["messages"][-1]["content"].split("\n")[0]
            content = f"Sure. <answer>{question}</answer>"
            self._reply(
                200,
                json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode(),
            )

    def _reply(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def ask(generator, requests):
    import asyncio

    return asyncio.run(generator.answer(requests))


REQUESTS = [AnswerRequest("Q=a", ["RESULT[1] one"]), AnswerRequest("Q=b", [])]


def test_openai_generator_answers_with_the_key_from_the_environment(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    Handler.received.clear()
    generator = OpenAIAnswerGenerator(server, "judge-model", KEY_ENV, max_tokens=32, timeout_s=5)
    results = ask(generator, REQUESTS)
    assert [(r.text, r.error) for r in results] == [
        ("<answer>Question: Q=a</answer>", None),
        ("<answer>Question: Q=b</answer>", None),
    ]
    paths, auths, bodies = zip(*Handler.received)
    assert set(paths) == {"/v1/chat/completions"} and set(auths) == {f"Bearer {KEY}"}
    assert sorted(b["messages"][-1]["content"] for b in bodies) == sorted(
        answer_messages(r.question, r.evidence)[-1]["content"] for r in REQUESTS
    )
    assert {b["max_tokens"] for b in bodies} == {32}
    assert KEY not in repr(generator) and KEY_ENV in repr(generator)


@pytest.mark.parametrize(
    "model, error",
    [
        ("broken", "answer generator returned HTTP 503"),
        ("html", "answer generator returned a reply that is not JSON"),
        ("nochoices", "answer generator reply has no choices[0].message.content"),
        ("slow", "answer generator timed out after 0.3 s"),
    ],
)
def test_openai_generator_failures_become_errors(server, model, error):
    timeout = 0.3 if model == "slow" else 10  # the others answer at once, however busy the machine is
    results = ask(OpenAIAnswerGenerator(server, model, timeout_s=timeout), REQUESTS)
    assert [(r.text, r.error) for r in results] == [("", error)] * 2


def test_closed_port_is_an_error_not_an_exception():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends
    (result,) = ask(OpenAIAnswerGenerator(f"http://127.0.0.1:{port}/v1", "m", timeout_s=2), REQUESTS[:1])
    assert result.text == "" and result.error.startswith("answer generator unreachable")


def test_missing_key_variable_is_a_config_error(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=KEY_ENV):
        OpenAIAnswerGenerator("http://127.0.0.1:1/v1", "m", KEY_ENV)


def test_loop_appends_a_remote_answer_with_loss_mask_0(server):
    tokenizer = chat_tokenizer("chatml")
    cfg = AgentConfig(answer_generator="openai", answer_base_url=server, answer_model="m", answer_timeout_s=5)
    engine = ScriptedEngine(tokenizer, scripted(["<search_complete>true</search_complete>"]))
    loop = AgentLoop(engine, tokenizer, {}, cfg, build_answer_generator(cfg, engine))
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, SamplingParams(max_new_tokens=50))
    assert spans(tokenizer, t) == [
        (1, "<search_complete>true</search_complete>"),
        (0, "\n<answer>Question: Q=q0</answer>"),
    ]
    assert t.turns[-1] == {
        "turn": 1,
        "action": "answer",
        "generator": "openai",
        "argument": "<answer>Question: Q=q0</answer>",
        "observation": "",
        "error": None,
        "masked_tokens": len(t.response_ids) - 39,
        "tokens": 0,
    }

    broken = AgentConfig(answer_generator="openai", answer_base_url=server, answer_model="broken")
    loop = AgentLoop(engine, tokenizer, {}, broken, build_answer_generator(broken, engine))
    (t,) = loop.run(samples(1), loop.encode_prompts(samples(1)), 1, SamplingParams(max_new_tokens=50))
    assert spans(tokenizer, t)[-1] == (
        0,
        EXPECTED_DELTA["chatml"].replace("OBS", "answer generator returned HTTP 503"),
    )
    assert loop.stats["agent/errors/answer_error"] == 1


@pytest.mark.parametrize(
    "raw, formatted",
    [
        ("<answer>x</answer>", "<answer>x</answer>"),
        ("reasoning... <answer> 1,234 </answer> trailing <answer>2</answer>", "<answer>1,234</answer>"),
        ("<answer>cut off", "<answer>cut off</answer>"),
        ("  plain  ", "<answer>plain</answer>"),
    ],
)
def test_format_answer(raw, formatted):
    assert format_answer(raw) == formatted


def test_local_generator_is_greedy_generation_on_the_answer_prompt():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64)
    engine = HFEngine(model, tokenizer)
    results = ask(LocalAnswerGenerator(engine, max_tokens=8), REQUESTS)
    expected = engine.generate(
        [encode_prompt(tokenizer, answer_messages(r.question, r.evidence)) for r in REQUESTS],
        1,
        SamplingParams(max_new_tokens=8, temperature=0.0, stop=["</answer>"]),
    )
    assert [r.text for r in results] == [format_answer(g.text) for g in expected]
    assert all(r.error is None for r in results)
    assert all(p.grad is None for p in model.parameters())


def test_build_answer_generator(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(tmp_path / "frozen")
    engine = HFEngine(model, tokenizer)
    assert build_answer_generator(AgentConfig(answer_generator="none"), engine) is None
    policy = build_answer_generator(AgentConfig(answer_generator="policy"), engine)
    assert isinstance(policy, LocalAnswerGenerator) and policy.engine is engine
    frozen = AgentConfig(answer_generator=f"hf:{tmp_path / 'frozen'}")
    local = build_answer_generator(frozen, engine)
    assert isinstance(local, LocalAnswerGenerator) and local.engine.model is not model
    assert not any(p.requires_grad for p in local.engine.model.parameters())
    # its precision is what the builder is told (the trainer: its policy's), float32 unless told
    assert {p.dtype for p in local.engine.model.parameters()} == {torch.float32}
    in_bf16 = AgentLoop(engine, tokenizer, {}, frozen, answer_dtype=torch.bfloat16).answer_generator
    assert {p.dtype for p in in_bf16.engine.model.parameters()} == {torch.bfloat16}
    # a loop given no generator builds the one its config names
    assert isinstance(AgentLoop(engine, tokenizer, {}, AgentConfig()).answer_generator, LocalAnswerGenerator)
    assert AgentLoop(engine, tokenizer, {}, AgentConfig(answer_generator="none")).answer_generator is None
    with pytest.raises(ModelLoadError, match="hf:"):
        build_answer_generator(AgentConfig(answer_generator=f"hf:{tmp_path / 'missing'}"), engine)
    with pytest.raises(ConfigError, match="agent.answer_generator"):
        AgentConfig(answer_generator="gpt")
    with pytest.raises(ConfigError, match="agent.answer_model"):
        AgentConfig(answer_generator="openai")
