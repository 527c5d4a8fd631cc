"""The vLLM engine's own logic, without vLLM: when it sleeps, wakes and pushes weights, which
log-prob mode it picks, and the lazy LoRA merge of its push.

`FakeLLM` stands in for vLLM's `LLM` and keeps the rules of vLLM's sleep mode (0.32): a level-1
sleep offloads the weights (kept, off the device) and drops the KV cache and the prefix cache; a
level-2 sleep discards the weights, so a wake gives allocated garbage until a reload; a request
while anything sleeps, or on garbage weights, is an error (real vLLM would queue it forever or
sample garbage), and so is a reload into weights that are not on the device. Its prefix cache
remembers which weights computed each sequence: a hit on blocks of older weights is an error (a
push without a reset). Every call is recorded in `events`. The engine sleeps on CUDA only; the
tests set `VLLMEngine.emulate_sleep` to take the same path on the CPU.

The trainer drives the engine here (`rollout.engine=vllm`, tiny models), so what is checked is
the order of the trainer's own calls: single-turn steps with evaluation in chunks, the agent loop
with the policy as answer generator, and dynamic-filter refills.
"""

import contextlib
import copy
import json
import logging
import sys
import types
import weakref
from types import SimpleNamespace

import pytest
import torch

import grouprl.rollout.engines.vllm as vllm_module
import grouprl.trainer.evaluation as evaluation_module
import grouprl.trainer.learner as learner_module
import grouprl.trainer.step as step_module
from grouprl.config import RolloutConfig, load_config
from grouprl.errors import ConfigError
from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.vllm import VLLMEngine, logprobs_mode, merged_state
from grouprl.trainer.trainer import Trainer
from helpers import tiny_model_and_tokenizer
from trainer.tiny import tiny_model_dir, write_run_config

BLOCK = 4  # tokens per KV block of the fake prefix cache
LOWER = range(3, 29)  # the character tokenizer's "a".."z"
PER_PROMPT = "float(int(ground_truth) % 2)"  # every group scores all alike: dynamic filtering refills
EOS_ID = 1  # the character tokenizer's <eos>


class FakeError(AssertionError):
    """A call real vLLM would not survive (or would answer with garbage)."""


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeLLM:
    """vLLM's `LLM` (and its `llm_engine`) as far as the engine uses it; see the module docstring."""

    latest = None  # the newest instance (its events record the allocator's releases too)

    def __init__(self, **kwargs):
        FakeLLM.latest = self
        self.kwargs = kwargs
        self.llm_engine = self
        self.events: list[tuple] = []
        self.errors: list[str] = []  # also raised, in case a caller swallows the exception
        self.weights: dict | str | None = "folder"  # what vLLM's model holds; None = garbage
        self.weights_at = "device"  # device | host | gone
        self.kv_cache = True  # on the device
        self.prefix_cache: dict[tuple, int] = {}  # sequence -> weights version that computed it
        self.version = 0  # reloads so far
        self.requests: list[tuple] = []
        self.on_generate = None  # check(weights) at every generate call (the tests set it)
        self.hits: list[int] = []  # prefix-cache hit tokens of each generate call

    def fail(self, message: str):
        self.errors.append(message)
        raise FakeError(message)

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1, mode: str = "abort"):
        if not self.kwargs["enable_sleep_mode"]:
            self.fail("sleep without enable_sleep_mode")
        if self.weights_at != "device" or not self.kv_cache:
            self.fail("sleep while (partly) asleep")
        self.events.append(("sleep", level))
        self.kv_cache = False
        self.prefix_cache.clear()  # vLLM 0.32 resets it when it pauses for a sleep
        self.weights_at = "host" if level == 1 else "gone"

    def wake_up(self, tags=None):
        tags = list(tags or ["weights", "kv_cache"])
        self.events.append(("wake", *tags))
        for tag in tags:
            if tag == "weights":
                if self.weights_at == "device":
                    self.fail("weights woken twice")
                if self.weights_at == "gone":
                    self.weights = None  # allocated again, contents undefined
                self.weights_at = "device"
            elif tag == "kv_cache":
                if self.kv_cache:
                    self.fail("KV cache woken twice")
                self.kv_cache = True

    # ------------------------------------------------------------------ weights
    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == "reload_weights":
            if self.weights_at != "device":
                self.fail("reload into weights that are not on the device")
            self.weights = {name: t.clone() for name, t in kwargs["weights_iterator"]}
            self.version += 1
            self.events.append(("reload",))
        else:  # a function run on the worker (the tied head's refresh)
            method(SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: SimpleNamespace())))
            self.events.append(("rpc",))
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.events.append(("reset",))
        self.prefix_cache.clear()
        return True

    # ------------------------------------------------------------------ generation
    def add_request(self, request_id, prompt, params):
        if not self.requests:  # the first request of an engine.generate call
            if self.weights_at != "device" or not self.kv_cache:
                self.fail("generate while asleep")
            if not isinstance(self.weights, dict):
                self.fail(f"generate on {'garbage' if self.weights is None else 'the folder'}'s weights")
            self.events.append(("generate", params.temperature, tuple(params.stop or ())))
            self.hits.append(0)
            if self.on_generate is not None:
                self.on_generate(self.weights)
        ids = tuple(prompt["prompt_token_ids"])
        for seq, version in self.prefix_cache.items():
            shared = next((i for i, (a, b) in enumerate(zip(seq, ids)) if a != b), min(len(seq), len(ids)))
            if shared >= BLOCK and version != self.version:
                self.fail("prefix-cache hit on blocks of older weights")
            if version == self.version:
                self.hits[-1] = max(self.hits[-1], shared // BLOCK * BLOCK)
        self.requests.append((request_id, ids, params))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        outputs = []
        for request_id, ids, params in self.requests:
            samples = []
            for j in range(params.n):
                if params.temperature == 0:  # greedy: a function of the prompt
                    length = 1 + sum(ids) % params.max_tokens
                    tokens = [LOWER[(sum(ids) + k) % len(LOWER)] for k in range(length)]
                else:  # vLLM draws from the global generator the engine seeded
                    length = int(torch.randint(1, params.max_tokens + 1, (1,)))
                    tokens = [LOWER[int(t)] for t in torch.randint(0, len(LOWER), (length,))]
                finish = "length" if length == params.max_tokens else "stop"
                tokens = tokens if finish == "length" else tokens[:-1] + [EOS_ID]
                self.prefix_cache[ids + tuple(tokens)] = self.version
                samples.append(
                    SimpleNamespace(
                        index=j,
                        token_ids=tokens,
                        finish_reason=finish,
                        stop_reason=None,
                        logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in tokens],
                    )
                )
            outputs.append(SimpleNamespace(request_id=request_id, finished=True, outputs=samples))
        self.requests = []
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake `vllm` package in sys.modules, and the engine sleeping off CUDA."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeSamplingParams
    vllm.sampling_params = types.ModuleType("vllm.sampling_params")
    vllm.sampling_params.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final_only")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", vllm.sampling_params)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setattr(VLLMEngine, "emulate_sleep", True)

    def release(device):  # what PyTorch's allocator keeps cached goes back (devices.py), recorded
        if FakeLLM.latest is not None:
            FakeLLM.latest.events.append(("release",))

    monkeypatch.setattr(FakeLLM, "latest", None)
    monkeypatch.setattr(vllm_module, "release_cached_memory", release)
    monkeypatch.setattr(learner_module, "release_cached_memory", release)
    return vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def recorded_trainer(root, model_dir, monkeypatch, level, *overrides, reward="1.0 - len(response) / 7"):
    """A Trainer on the fake vLLM whose phases, updates and generate calls land in one event
    list; every generate call checks that vLLM holds the trainer's current weights."""
    config = write_run_config(root, model_dir, reward=reward)
    settings = ["rollout.engine=vllm", f"rollout.sleep_level={level}", "trainer.save_final=false", *overrides]
    trainer = Trainer(load_config(config, settings))
    engine, llm = trainer.parts.collect.engine, trainer.parts.collect.engine.llm
    real_phase, real_update = step_module.rollout_phase, engine.weights_updated

    @contextlib.contextmanager
    def phase(e):
        with real_phase(e):
            llm.events.append(("phase",))
            yield
            llm.events.append(("/phase",))

    def update(model):
        llm.events.append(("update",))
        real_update(model)

    def current(weights):
        want = dict(merged_state(trainer.parts.learn.model, engine.dtype))
        assert weights.keys() == want.keys()
        assert all(torch.equal(weights[k], want[k]) for k in want), "vLLM samples from stale weights"

    monkeypatch.setattr(step_module, "rollout_phase", phase)  # a step's rollout
    monkeypatch.setattr(evaluation_module, "rollout_phase", phase)  # an evaluation's
    monkeypatch.setattr(engine, "weights_updated", update)
    llm.on_generate = current
    return trainer, llm


PUSH = [("reload",), ("rpc",), ("reset",)]


def wake(level: int, push: bool) -> list[tuple]:
    """What begin_rollout does at `level`, with or without a policy to push: PyTorch's cached
    blocks released before each of vLLM's two wakes (its own allocator cannot reuse them)."""
    if level == 0:
        return []
    if level == 2 or push:  # weights first, the push into them, then the KV cache
        return [("release",), ("wake", "weights"), *PUSH, ("release",), ("wake", "kv_cache")]
    return [("release",), ("wake", "weights"), ("release",), ("wake", "kv_cache")]


UPDATE = [("release",), ("update",)]  # the update's cached memory released, then its weights pushed


def phases(events: list[tuple]) -> list[list[tuple]]:
    """The events inside each rollout phase."""
    found, inside = [], None
    for e in events:
        if e == ("phase",):
            inside = []
        elif e == ("/phase",):
            found.append(inside)
            inside = None
        elif inside is not None:
            inside.append(e)
    return found


def outside(events: list[tuple]) -> list[tuple]:
    """The events between rollout phases, each phase shown as ("phase", its generate calls)."""
    shown, inside = [], None
    for e in events:
        if e == ("phase",):
            inside = []
        elif e == ("/phase",):
            shown.append(("phase", len(inside)))
            inside = None
        elif inside is not None:
            inside.append(e)
        else:
            shown.append(e)
    return shown


def only_generate_inside(llm):
    """Nothing but generate calls within a rollout: no sleep, wake, push or prefix-cache reset."""
    for inside in phases(llm.events):
        assert inside and all(e[0] == "generate" for e in inside), inside
    assert not llm.errors


# ------------------------------------------------------------------ the trainer's calls
@pytest.mark.parametrize("level", [0, 1, 2])
def test_steps_and_chunked_evaluation_sleep_between_rollouts_only(
    tmp_path, model_dir, monkeypatch, fake_vllm, level
):
    """fit: a baseline evaluation in two chunks, two steps, a final evaluation. Each rollout wakes
    once and sleeps once; an update while asleep is pushed at the next wake (level 1), every wake
    after a level-2 sleep pushes; awake (level 0) the push follows the update at once."""
    trainer, llm = recorded_trainer(
        tmp_path, model_dir, monkeypatch, level, "rollout.gen_batch_size=2", "trainer.total_steps=2"
    )
    trainer.fit()
    only_generate_inside(llm)
    sleep = [("sleep", level)] if level else []
    if level == 0:  # awake throughout: the first push at start, then one after every update
        start, update = PUSH, [*UPDATE, *PUSH]
    else:  # the first push waits for the first wake
        start, update = sleep, UPDATE
    want = [
        *start,
        *wake(level, push=True), ("phase", 2), *sleep,  # baseline evaluation: 4 prompts, 2 chunks
        *wake(level, push=False), ("phase", 1), *sleep, *update,  # step 1
        *wake(level, push=True), ("phase", 1), *sleep, *update,  # step 2
        *wake(level, push=True), ("phase", 2), *sleep,  # final evaluation
    ]
    assert outside(llm.events) == want
    assert trainer.parts.collect.engine.last_sleep_freed_bytes == 0  # off CUDA nothing is measured
    assert trainer.parts.collect.engine.push_seconds > 0
    # each step logs its pushes, wherever they ran (the update's at level 0, the next wake's asleep)
    records = [json.loads(x) for x in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    pushes = {r["step"]: r["time/weight_push"] for r in records if "time/weight_push" in r}
    assert set(pushes) == {1, 2} and pushes[2] > 0
    assert (pushes[1] > 0) == (level != 1)  # level 1: step 1 woke to the weights it already had
    assert all(r["perf/engine_freed_gb"] == 0 for r in records if "perf/engine_freed_gb" in r)


def two_steps(level: int, steps: list[list[tuple]]) -> list[tuple]:
    """fit's calls between rollouts over two steps without evaluations (`steps`: each step's
    rollout, as `phases` gives them): asleep, each step wakes with a push and sleeps before its
    update; awake (level 0), the first push at start and one after every update."""
    if level == 0:
        return [*PUSH, ("phase", len(steps[0])), *UPDATE, *PUSH, ("phase", len(steps[1])), *UPDATE, *PUSH]
    return [
        ("sleep", level),
        *wake(level, push=True), ("phase", len(steps[0])), ("sleep", level), *UPDATE,
        *wake(level, push=True), ("phase", len(steps[1])), ("sleep", level), *UPDATE,
    ]  # fmt: skip


@pytest.mark.parametrize("level", [0, 1, 2])
def test_agent_turns_and_the_policys_answers_run_in_one_wake(
    tmp_path, model_dir, monkeypatch, fake_vllm, level
):
    """The agent loop with the policy as answer generator: every turn and the frozen answers are
    generate calls within one rollout, with no sleep, wake or reset between them, so a later
    turn finds the conversation so far in the prefix cache."""
    trainer, llm = recorded_trainer(
        tmp_path,
        model_dir,
        monkeypatch,
        level,
        "agent.enabled=true",
        "agent.tools=[]",
        "agent.max_turns=3",
        "agent.answer_generator=policy",
        "agent.system_prompt=Answer.",  # short prompts and observations: a fast update
        "agent.max_observation_tokens=100",  # the least this tokenizer's turn markers and notes allow
        "rollout.n_agent=2",
        "data.val_files=[]",
        "trainer.total_steps=2",
    )
    trainer.fit()
    only_generate_inside(llm)
    steps = phases(llm.events)
    assert len(steps) == 2
    for step in steps:
        turns = [e for e in step if e[1] == 1.0]
        answers = [e for e in step if e[1] == 0.0 and "</answer>" in e[2]]
        assert len(turns) == 3 and answers, step  # no action ever: every turn is corrected
    first = llm.hits[: len(steps[0])]
    assert first[0] == 0 and all(h > 0 for h in first[1:3])  # turns 2 and 3 reuse the cache
    assert outside(llm.events) == two_steps(level, steps)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_dynamic_filter_refills_generate_within_the_steps_rollout(
    tmp_path, model_dir, monkeypatch, fake_vllm, level
):
    """Every group scores all alike, so each step generates its prompts and then refills: all of
    those generate calls belong to the step's one rollout."""
    trainer, llm = recorded_trainer(
        tmp_path,
        model_dir,
        monkeypatch,
        level,
        "data.sampler=curriculum",
        "curriculum.dynamic_filter=true",
        "curriculum.max_oversample=2",
        "data.val_files=[]",
        "trainer.save_best=false",
        "trainer.total_steps=2",
        reward=PER_PROMPT,
    )
    trainer.fit()
    only_generate_inside(llm)
    steps = phases(llm.events)
    assert len(steps) == 2 and all(len(step) >= 2 for step in steps)  # the first draw and a refill
    assert outside(llm.events) == two_steps(level, steps)


# ------------------------------------------------------------------ the engine used directly
def engine_on_fake(level: int, **settings):
    model, tokenizer = tiny_model_and_tokenizer()
    cfg = RolloutConfig(engine="vllm", sleep_level=level, **settings)
    return VLLMEngine(model, tokenizer, "unused", cfg), model


def moved(model, seed: int):
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return other


@pytest.mark.parametrize("level", [1, 2])
def test_a_generate_outside_a_rollout_is_a_rollout_of_its_own(fake_vllm, level):
    engine, model = engine_on_fake(level)
    llm = engine.llm
    params = SamplingParams(max_new_tokens=4)
    assert llm.events == [("sleep", level)]  # the trainer's weights wait for the first wake
    engine.generate([[3, 4, 5]], 2, params)
    assert llm.events[1:] == [*wake(level, push=True), ("generate", 1.0, ()), ("sleep", level)]

    newer = moved(model, 1)
    llm.events.clear()
    engine.weights_updated(newer)  # asleep: nothing happens until the next wake
    assert llm.events == []
    llm.on_generate = lambda weights: torch.testing.assert_close(weights, dict(merged_state(newer)), rtol=0, atol=0)
    engine.generate([[3, 4, 5]], 1, params)
    engine.generate([[6, 7]], 1, params)  # level 2: the discarded weights are pushed again
    assert llm.events == [
        *wake(level, push=True), ("generate", 1.0, ()), ("sleep", level),
        *wake(level, push=level == 2), ("generate", 1.0, ()), ("sleep", level),
    ]

    llm.events.clear()
    engine.begin_rollout()
    engine.weights_updated(moved(model, 2))  # awake within a rollout: pushed at once
    assert llm.events == [*wake(level, push=level == 2), *PUSH]
    engine.end_rollout()
    assert not llm.errors


def test_without_sleep_every_update_is_pushed_at_once(fake_vllm):
    engine, model = engine_on_fake(0)
    assert not engine.sleeps and engine.llm.kwargs["enable_sleep_mode"] is False
    assert engine.llm.events == PUSH
    engine.weights_updated(moved(model, 3))
    engine.generate([[3, 4]], 1, SamplingParams(max_new_tokens=3))
    assert engine.llm.events == [*PUSH, *PUSH, ("generate", 1.0, ())]


def test_production_sleeps_on_cuda_only(fake_vllm, monkeypatch):
    monkeypatch.setattr(VLLMEngine, "emulate_sleep", False)
    engine, _ = engine_on_fake(2)
    assert not engine.sleeps and engine.llm.kwargs["enable_sleep_mode"] is False
    assert engine.llm.events == PUSH


def test_the_engine_answers_what_callers_ask(fake_vllm):
    from grouprl.rollout.engines.base import RolloutEngine

    engine, model = engine_on_fake(0)
    assert isinstance(engine, RolloutEngine)  # every member of the interface
    assert engine.reads_trainer_weights is False  # a copy of its own, pushed to
    pushed = engine.push_seconds
    assert pushed > 0  # the start's push
    engine.weights_updated(moved(model, 3))
    assert engine.push_seconds > pushed and engine.last_sleep_freed_bytes == 0
    engine.close()  # in-process: nothing ends
    engine.generate([[3, 4]], 1, SamplingParams(max_new_tokens=3))
    assert engine.llm.events == [*PUSH, *PUSH, ("generate", 1.0, ())]


def test_tensor_parallelism_is_refused_in_one_line(fake_vllm):
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size must be 1"):
        engine_on_fake(1, tensor_parallel_size=2)


# ------------------------------------------------------------------ log-prob mode
@pytest.mark.parametrize(
    "temperature, top_k, top_p, mode, warns",
    [
        (1.0, 0, 1.0, "processed_logprobs", False),  # nothing truncated: after temperature = the trainer's
        (0.7, 0, 1.0, "processed_logprobs", False),
        (1.0, 0, 0.9, "raw_logprobs", False),  # before truncation; temperature 1 changes nothing
        (1.0, 20, 1.0, "raw_logprobs", False),
        (0.0, 20, 0.9, "processed_logprobs", False),  # greedy skips both
        (0.7, 0, 0.9, "processed_logprobs", True),  # no mode is the trainer's: said once, at start
        (1.3, 5, 1.0, "processed_logprobs", True),
    ],
)
def test_the_logprob_mode_matches_the_trainers_distribution_where_vllm_has_one(
    fake_vllm, caplog, temperature, top_k, top_p, mode, warns
):
    with caplog.at_level(logging.WARNING, logger="grouprl.rollout.engines.vllm"):
        engine, _ = engine_on_fake(1, temperature=temperature, top_k=top_k, top_p=top_p)
    said = [r.getMessage() for r in caplog.records if "truncated distribution" in r.getMessage()]
    assert len(said) == (1 if warns else 0)
    if warns:
        assert "rollout/mismatch_" in said[0] and "rollout_is" in said[0]
    assert engine.llm.kwargs["logprobs_mode"] == mode
    assert logprobs_mode(RolloutConfig(temperature=temperature, top_k=top_k, top_p=top_p)) == mode


# ------------------------------------------------------------------ the lazy LoRA merge
def lora_model(**config):
    peft = pytest.importorskip("peft")
    base, _ = tiny_model_and_tokenizer(**config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"]
    if config.get("tie_word_embeddings", True):
        targets.remove("embed_tokens")  # a tied head would keep the plain embedding in the unmerged model
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    return peft.get_peft_model(base, lora)


@pytest.mark.parametrize("tied", [True, False])
def test_the_merged_push_equals_peft_merge_and_unload(tied):
    model = lora_model(tie_word_embeddings=tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = dict(merged_state(model))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # left as it was
    want = copy.deepcopy(model).merge_and_unload()
    names = [n for n, _ in want.named_parameters()]  # tied weights once, as vLLM takes them
    assert list(got) == names
    assert ("lm_head.weight" in names) != tied
    for name in names:
        torch.testing.assert_close(got[name], want.get_parameter(name).detach(), rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(got[f"{q}.weight"], before[f"base_model.model.{q}.base_layer.weight"])
    if not tied:  # the embedding's adapter (kept apart from the linear ones by peft) is merged too
        embed = "model.embed_tokens"
        assert not torch.equal(got[f"{embed}.weight"], before[f"base_model.model.{embed}.base_layer.weight"])


def test_lora_deltas_are_made_one_at_a_time_as_their_weights_go_out():
    from peft.tuners.lora import LoraLayer

    model = lora_model(tie_word_embeddings=False)
    layers = {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}
    made, alive = [], []  # the layers whose delta was computed, in order; weak references to the deltas

    def counting(name, real):
        def get_delta_weight(adapter):
            delta = real(adapter)
            made.append(name)
            alive.append(weakref.ref(delta))
            return delta

        return get_delta_weight

    for name, layer in layers.items():
        layer.get_delta_weight = counting(name, layer.get_delta_weight)
    out, held = [], []  # names out so far; the tensors, kept as vLLM keeps what it copied
    for name, tensor in merged_state(model, torch.float64):
        out.append(name)
        held.append(tensor)
        # a delta is made when its own weight goes out, not before ...
        assert made == [o.removesuffix(".weight") for o in out if o.removesuffix(".weight") in layers]
        # ... and dropped before that weight leaves: never two at once
        assert all(ref() is None for ref in alive)
    assert sorted(made) == sorted(layers) and len(layers) == 2 * 7 + 1  # every adapter once
