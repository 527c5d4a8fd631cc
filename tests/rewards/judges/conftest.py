"""Fixtures for judge tests: fake OpenAI-compatible servers on 127.0.0.1 (random free ports,
stopped after each test) and judge configs with tiny backoff delays."""

from __future__ import annotations

import dataclasses

import pytest

from grouprl.config import JudgeConfig
from rewards.judges.fake_server import FakeJudgeServer


@pytest.fixture
def start_server():
    """start_server(latency=..., behaviour=...) -> a running FakeJudgeServer."""
    servers = []

    def start(latency: float = 0.0, behaviour=None) -> FakeJudgeServer:
        server = FakeJudgeServer(latency=latency, behaviour=behaviour).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def judge_config():
    """judge_config(server, **overrides) -> a JudgeConfig for `server`: no cache, fast retries."""

    def make(server: FakeJudgeServer | None = None, **overrides) -> JudgeConfig:
        base = JudgeConfig(
            name="test",
            model="fake-judge",
            base_url=server.base_url if server is not None else "http://127.0.0.1:9/v1",
            cache_path="",
            timeout_s=5.0,
            max_retries=3,
            backoff_base_s=0.001,
            backoff_max_s=0.01,
        )
        return dataclasses.replace(base, **overrides)

    return make


@pytest.fixture
def clients():
    """Collects JudgeClients made by a test and closes them afterwards."""
    made = []
    yield made
    for client in made:
        client.close()


@pytest.fixture(autouse=True)
def home_in_tmp(tmp_path, monkeypatch):
    """`~` (the default judge cache lives in ~/.cache/grouprl) points into the test's folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def start_gemini_server():
    """start_gemini_server(behaviour=...) -> a running FakeGeminiServer (see fake_gemini.py)."""
    from fake_gemini import FakeGeminiServer

    servers = []

    def start(behaviour=None) -> FakeGeminiServer:
        server = FakeGeminiServer(behaviour=behaviour).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
