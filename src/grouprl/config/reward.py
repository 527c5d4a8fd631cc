"""The reward section: components, LLM/VLM judges and reward models, and how components name
them (`judge:<name>`, `model:<name>`) and gate each other. The rewards room imports the judge
and model names and the gate stages from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from grouprl.errors import ConfigError, need


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
        need(bool(self.fields), f"{where}: `fields` must name at least one score field")
        for name, weight in self.fields.items():
            need(
                isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight >= 0,
                f"{where}: field weight of {name!r} must be a number >= 0, got {weight!r}",
            )
        need(sum(self.fields.values()) > 0, f"{where}: field weights must not all be 0")
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
            need(ok, f"{where}: {message}")


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


MODEL_PREFIX = "model:"
JUDGE_PREFIX = "judge:"
DRAWS = ("text_to_image", "http_image", "scene_renderer")  # reward models that draw images, giving no score


def model_name(function: str) -> str | None:
    """ "model:clip" -> "clip"; None for any other reward spec."""
    function = function.strip()
    return function[len(MODEL_PREFIX) :].strip() if function.startswith(MODEL_PREFIX) else None


def judge_name(function: str) -> str | None:
    """ "judge:vlm" -> "vlm"; None for any other reward spec."""
    function = function.strip()
    return function[len(JUDGE_PREFIX) :].strip() if function.startswith(JUDGE_PREFIX) else None


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
        need(
            self.max_consecutive_failures >= 0,
            "config key 'reward.max_consecutive_failures' must be >= 0 (0 = never stop), "
            f"got {self.max_consecutive_failures}",
        )
        need(
            0 <= self.max_failed_share <= 1,
            f"config key 'reward.max_failed_share' must be in [0, 1] (1 = never stop), got {self.max_failed_share}",
        )
        judges = [j.name for j in self.judges]
        need(
            len(set(judges)) == len(judges) and all(judges),
            f"config key 'reward.judges' needs unique, non-empty names, got {judges}",
        )
        models = {m.name: m for m in self.models}
        need(
            len(models) == len(self.models) and all(models),
            f"config key 'reward.models' needs unique, non-empty names, got {[m.name for m in self.models]}",
        )
        for m in self.models:
            _check_model(m, models)
        self._check_references(judges, models)
        stages_of({c.name: c.gate for c in self.components})
        need(bool(self.components), "config key 'reward.components' must name at least one reward")
        names = [c.name for c in self.components]
        need(len(set(names)) == len(names), f"config key 'reward.components' has duplicate names: {names}")

    def _check_references(self, judges: list[str], models: dict[str, RewardModelConfig]) -> None:
        """Each component's `model:` / `judge:` names a defined one (a model that scores), its gate a component."""
        for component in self.components:
            name = model_name(component.function or component.name)
            if name is None:
                continue
            need(
                name in models,
                f"reward component {component.name!r} uses model {name!r}, but reward.models defines "
                f"{', '.join(models) or 'none'}",
            )
            need(
                models[name].kind not in DRAWS,
                f"reward component {component.name!r}: model {name!r} draws images and gives no score; "
                "score its images with a clip or scene_scorer model (images_from)",
            )
        components = {c.name: c for c in self.components}
        for component in self.components:
            name = judge_name(component.function or component.name)
            need(
                name is None or name in judges,
                f"reward component {component.name!r} uses judge {name!r}, but reward.judges defines "
                f"{', '.join(judges) or 'none'}",
            )
            need(
                not component.gate or component.gate in components,
                f"reward component {component.name!r}: gate {component.gate!r} is not a component "
                f"({', '.join(components)})",
            )


def _check_model(m: RewardModelConfig, models: dict[str, RewardModelConfig]) -> None:
    """One reward model's settings, and the model it scores the images of (images_from)."""
    if m.images_from:
        source = models.get(m.images_from)
        need(m.kind in ("clip", "scene_scorer"), f"reward model {m.name!r}: images_from is for clip and scene_scorer models")
        need(
            source is not None and source.kind in DRAWS,
            f"reward model {m.name!r}: images_from {m.images_from!r} is not a text_to_image, "
            "http_image or scene_renderer model in reward.models",
        )
    else:
        need(
            m.kind not in ("clip", "scene_scorer"),
            f"reward model {m.name!r} ({m.kind}) needs images_from: the model drawing the images",
        )
    need(
        m.kind not in ("clip", "sequence_classifier", "text_to_image") or bool(m.path),
        f"reward model {m.name!r} ({m.kind}) needs a path (local folder or hub id)",
    )
    need(m.kind != "http_image" or bool(m.base_url), f"reward model {m.name!r} (http_image) needs base_url")
    need(m.batch_size >= 1, f"reward model {m.name!r}: batch_size must be >= 1")



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

