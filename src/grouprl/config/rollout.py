"""The rollout section (generation and its engine) and the agent section (the multi-turn loop,
its tools and answer generator)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need

DEVICE = r"cpu|cuda(:\d+)?"  # a device string an engine takes (rollout.engine_device, grouprl engine serve)


@dataclass
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine: hf = the built-in decode loop over the trainer's own model (CPU and GPU); vllm = vLLM in-process (extra `vllm`); auto = vLLM on CUDA where it is installed (and the policy is not bitsandbytes-quantised), else hf."""
    n_agent: int = 8
    """Samples per prompt; one group per prompt."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off)."""
    max_response_length: int = 128
    """Maximum generated tokens per response."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation of a sample ends once its text contains one (kept in the output)."""
    ignore_eos: bool = False
    """Keep sampling past EOS to max_response_length (verl's rollout.ignore_eos): fixed response lengths for measurements (benchmarks/scale.py), not for training a model to stop."""
    mask_truncated: bool = False
    """Leave responses that hit max_response_length out of the loss."""
    gen_batch_size: int = 0
    """Most sequences generated at once (0 = the whole batch)."""
    share_prompt_prefill: bool = True
    """Prefill each group's prompt once and expand its KV cache to the n_agent samples."""
    check_log_probs: bool = False
    """Record each sampled token's log-prob and log how far the update's are from them (rollout/mismatch_*) also where the engine computes the trainer's own numbers (float32 on the built-in engine): a check that training sees what generation saw. Wherever they can differ (bf16, vLLM) they are recorded anyway."""
    max_staleness: int = 0
    """Asynchronous training: the rollout of step s may come from weights as old as step s-k (k = this). Generation of the next steps runs while this step's rewards finish and its update runs; the update corrects with the decoupled PPO objective (importance weights of the behaviour policy's log-probs). 0 = synchronous."""
    async_schedule: Literal["fixed_lag", "newest"] = "fixed_lag"
    """With max_staleness > 0: fixed_lag = step s always trains on the rollout of weights s-k (deterministic: a resumed run repeats an uninterrupted one exactly); newest = each batch starts on the newest weights there are, and an agent's later turns take weights pushed meanwhile (partial rollouts)."""
    engine_process: bool = False
    """With max_staleness > 0: the engine that generates ahead of the update runs in a process of its own (on engine_device), fed the weights over its pipe (NCCL from one GPU to another) after each update, instead of on a thread of the trainer's process."""
    engine_device: str = ""
    """With engine_process: where the engine process generates (e.g. cuda:1, cpu); empty = the trainer's device. One process: any device; several ranks: the trainer's, or cpu."""
    engine_address: str = ""
    """With max_staleness > 0: host:port of a `grouprl engine serve` on another machine; each rank's engine process runs there (on one of its --devices) instead of beside the rank, fed the weights over the connection that proved the key (NCCL between GPUs, its rendezvous over that connection). Both sides need the same secret in GROUPRL_ENGINE_KEY (32 characters or more)."""
    val_temperature: float = 0.0
    """Evaluation sampling temperature (0 = greedy)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Generation precision: bfloat16 = autocast over float32 weights; auto = as actor.dtype resolves."""
    gpu_memory_utilization: float = 0.5
    """vllm: share of the accelerator's memory (of host memory on vLLM's CPU build) vLLM may take for weights and KV cache."""
    kv_cache_gb: float = 0.0
    """vllm: KV-cache budget in GiB, instead of what gpu_memory_utilization leaves (0 = from the share)."""
    tensor_parallel_size: int = 1
    """vllm: devices one engine shards the model over."""
    sleep_level: int = 2
    """vllm on CUDA: between rollouts (never inside one) free the KV cache and discard the weights (2: the push at the next wake brings the policy's), or offload the weights to host memory (1: a host copy of the model, brought back at each wake); 0 = stay awake."""
    enforce_eager: bool = False
    """vllm: run eagerly instead of with captured graphs (slower decoding, faster start-up)."""
    max_model_len: int = 0
    """vllm: longest context (prompt + response, observations included) the engine plans for; 0 = the run's own, from the length limits (the memory plan's context, at most the model's positions)."""

    def __post_init__(self) -> None:
        need(self.n_agent >= 1, "config key 'rollout.n_agent' must be >= 1")
        need(self.max_response_length >= 1, "config key 'rollout.max_response_length' must be >= 1")
        need(self.temperature >= 0, "config key 'rollout.temperature' must be >= 0")
        need(0 < self.top_p <= 1, "config key 'rollout.top_p' must be in (0, 1]")
        self._check_vllm()
        self._check_asynchronous()
        for key in ("top_k", "gen_batch_size"):
            need(getattr(self, key) >= 0, f"config key 'rollout.{key}' must be >= 0, got {getattr(self, key)!r}")

    def _check_vllm(self) -> None:
        need(self.sleep_level in (0, 1, 2), "config key 'rollout.sleep_level' must be 0, 1 or 2")
        need(0 < self.gpu_memory_utilization <= 1, "config key 'rollout.gpu_memory_utilization' must be in (0, 1]")
        need(self.kv_cache_gb >= 0, "config key 'rollout.kv_cache_gb' must be >= 0 (0 = from the share)")
        need(self.tensor_parallel_size >= 1, "config key 'rollout.tensor_parallel_size' must be >= 1")
        # tensor_parallel_size > 1 with engine=vllm: config/rules.py (a loaded tree's check only)
        need(self.max_model_len >= 0, "config key 'rollout.max_model_len' must be >= 0 (0 = the model's)")

    def _check_asynchronous(self) -> None:
        """max_staleness and where the engine that generates ahead runs."""
        need(self.max_staleness >= 0, "config key 'rollout.max_staleness' must be >= 0 (0 = synchronous)")
        need(
            self.max_staleness == 0 or self.engine != "vllm" or self.sleep_level == 0,
            "config key 'rollout.sleep_level' must be 0 with rollout.max_staleness > 0: the engine generates "
            "while the update runs, so it never sleeps",
        )
        need(
            not self.engine_process or self.max_staleness > 0,
            "config key 'rollout.engine_process' needs rollout.max_staleness >= 1: the engine process generates "
            "ahead of the update (asynchronous training)",
        )
        need(
            not self.engine_device or self.engine_process,
            "config key 'rollout.engine_device' is for rollout.engine_process=true",
        )
        need(
            not self.engine_address or self.max_staleness > 0,
            "config key 'rollout.engine_address' needs rollout.max_staleness >= 1: the engine service generates "
            "ahead of the update (asynchronous training)",
        )
        need(
            not (self.engine_address and self.engine_process),
            "config keys 'rollout.engine_address' and 'rollout.engine_process' name two places for the engine: "
            "set one (the service's devices are chosen where it runs: grouprl engine serve --devices)",
        )
        need(
            not self.engine_address
            or re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}", self.engine_address) is not None,
            f"config key 'rollout.engine_address' must be host:port (got {self.engine_address!r})",
        )
        need(
            re.fullmatch(rf"({DEVICE})?", self.engine_device) is not None,
            f"config key 'rollout.engine_device' must be cpu, cuda or cuda:N (got {self.engine_device!r})",
        )


@dataclass
class AgentRetrieverConfig:
    index: str = ""
    """Index folder searched in-process (set this or `url`)."""
    url: str = ""
    """Search service URL for HTTP retrieval (set this or `index`)."""
    top_k: int = 3
    """Hits returned per <search> query."""
    max_consecutive_failures: int = 3
    """Failed searches in a row after which the search tool reports the service as down."""
    timeout_s: float = 30.0
    """Per-request timeout of the HTTP search service, in seconds."""
    max_in_flight: int = 8
    """HTTP search requests in flight at once (searches that arrive together share one); a search waits for an earlier slow one only beyond this many."""


@dataclass
class AgentConfig:
    enabled: bool = False
    """Run the multi-turn agent loop (actions, tools, observations) instead of single-turn generation."""
    max_turns: int = 7
    """Most policy turns per trajectory (a turn: optional <think> plus one action)."""
    tools: list[str] = field(default_factory=lambda: ["search", "bbox"])
    """Action tags handled by tools: search, bbox."""
    answer_generator: str = "policy"
    """Writes <answer> after <search_complete>: policy (frozen, mask 0), none (the policy answers), hf:<path>, openai."""
    answer_base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL (.../v1) of the answer generator when answer_generator is openai."""
    answer_model: str = ""
    """Model name sent to the OpenAI-compatible answer generator."""
    answer_api_key_env: str = ""
    """Name of the environment variable holding the answer generator's API key ("" = send none)."""
    answer_max_tokens: int = 256
    """Most tokens the answer generator writes."""
    answer_timeout_s: float = 60.0
    """Per-request timeout of the OpenAI-compatible answer generator, in seconds."""
    max_observation_tokens: int = 512
    """Most tokens an observation takes as the policy is fed it: text, image tokens and the chat turn markers (images shrunk or left out, then text cut); 0 = no limit."""
    max_response_tokens: int = 0
    """Most response tokens per trajectory, observations included (0 = no limit); reaching it ends the trajectory."""
    on_unfinished: Literal["answer", "no_answer"] = "answer"
    """Trajectory that never finished (max turns, token budget): the answer generator still answers, or no answer."""
    observation_role: str = "user"
    """Chat role of observation messages (user, or tool where the chat template knows it)."""
    system_prompt: str | None = None
    """System prompt that teaches the action protocol (None = the built-in one)."""
    reuse_kv_cache: bool = True
    """Keep each trajectory's KV cache across turns and prefill only the new tokens."""
    schedule: Literal["trajectory", "turn"] = "trajectory"
    """trajectory: each trajectory's next turn joins the engine's running batch as soon as its tool call is back; turn: every turn waits for the slowest generation and tool call of the batch (lock step)."""
    retriever: AgentRetrieverConfig = field(default_factory=AgentRetrieverConfig)
    """Where <search> queries go."""

    def __post_init__(self) -> None:
        need(self.max_turns >= 1, f"config key 'agent.max_turns' must be >= 1, got {self.max_turns!r}")
        gen = self.answer_generator
        need(
            gen in ("policy", "none", "openai") or (gen.startswith("hf:") and len(gen) > 3),
            f"config key 'agent.answer_generator' must be policy, none, hf:<path> or openai, got {gen!r}",
        )
        need(
            gen != "openai" or bool(self.answer_model),
            "config key 'agent.answer_model' must be set when agent.answer_generator is openai",
        )
        for key in ("max_observation_tokens", "max_response_tokens"):
            need(getattr(self, key) >= 0, f"config key 'agent.{key}' must be >= 0, got {getattr(self, key)!r}")
        need(self.answer_max_tokens >= 1, "config key 'agent.answer_max_tokens' must be >= 1")
        need(self.answer_timeout_s > 0, "config key 'agent.answer_timeout_s' must be > 0")
        for name in self.tools:
            need(name in ("search", "bbox"), f"config key 'agent.tools' may hold search and bbox, got {name!r}")
