"""The vLLM engine: rollouts on vLLM's paged attention and continuous batching, in the trainer's
process, colocated with training.

Token ids in, token ids out: prompts go to vLLM as ids, each sample comes back as the ids vLLM
sampled with their log-probs (see `logprobs_mode` for which distribution), and the text is
decoded here with the policy's tokenizer, as the hf engine does. A prompt's n samples are one
request with `n`; prefix caching shares a prompt's KV blocks between its samples and, for
agents, between the turns of a conversation (each turn feeds the conversation whole).

Weights: after every optimizer step the trainer calls `weights_updated(model)`, which streams
the policy's parameters into vLLM's model in place (`reload_weights` on the worker, no disk),
LoRA adapters merged on the fly, one layer at a time (the trainer's model is not touched), and
resets the prefix cache, whose blocks were computed with the old weights.

Memory: with `rollout.sleep_level` > 0 the engine sleeps on CUDA between rollouts (the trainer's
`begin_rollout` / `end_rollout`), never between the turns, chunks or refills of one rollout, so
the update has the accelerator's memory. Level 1 frees the KV cache and offloads the weights to
host memory; level 2 discards the weights too. An update while asleep is not pushed at once: the
next wake brings weights back first, then pushes the policy's (always after level 2, since the
woken weights are garbage), then the KV cache, so the push's temporaries never share the device
with a full KV cache (verl's order). At level 1 that wake first copies the old weights back from
host memory, only for the push to overwrite them: vLLM's allocator restores every offloaded
allocation on wake and cannot drop the host copy, so training, where each rollout is followed by
an update, is better served by level 2.

Sampling randomness: each request (a prompt's n samples) carries a seed drawn from the stream of
its first row (`request_seeds`), and vLLM samples a seeded request from a generator of its own:
a group's samples depend on its rows' keys alone, not on the call's other requests, batching or
the rank, as on the hf engine. Generation runs inside `torch.random.fork_rng` (vLLM's CPU sampler
draws from the global generator for the whole batch even so): the trainer's RNG is left as it was.

Several ranks: each rank runs an engine of its own on its own groups (data-parallel engines,
tensor parallel 1), on the trainer's device. In-process vLLM does not start a world of its own
where a process group exists: it builds its groups from the default group, the trainer's. Its
"external_launcher" executor is made for that (torchrun ranks, verl's layout): rank and device
from RANK and LOCAL_RANK (set here to the trainer's), no process group or port of its own; its
world group spans the trainer's ranks, used at start-up only (node count, the smallest KV budget),
and with tensor parallel 1 every model-parallel group is the rank alone, so the engines never
wait on each other. (The default "uni" executor would build the same groups, but puts the engine
on cuda:0 on every rank.) Starting is a collective: every rank starts its engine at the same
point. A push gathers the sharded weights one FSDP module at a time (`sharded_state`), every
rank the same all-gathers in the same order. vLLM's teardown ends by destroying the default
group; it runs here without that step (`_leave_groups_to_the_trainer`).

Vision-language policies (`vision=` the family): a prompt or a conversation with images goes to
vLLM as token ids, each image's expansion collapsed to the placeholder vLLM's processor expands
(`<|image_pad|>` between Qwen's vision markers, Idefics3/SmolVLM's `<image>`), plus the source
images (`ImageInput.source`, the very image the trainer's processor read) keyed by their pixel
fingerprints (`ImageInput.key`). vLLM processes them with the same image processor class and
settings (its on-device normalisation is off, so the processor normalises as the trainer's does)
and runs its own vision tower on the result. Every request is checked before it is queued: each
image's token count in vLLM's expansion equals the trainer's, the expanded prompt equals the
trainer's ids, and vLLM's pixel tensors equal the trainer's exactly (`ImageMismatch` otherwise,
naming the prompt and the image). A prompt's n samples are one request, so its images are
processed once; later turns of a session send the same images under the same keys, which vLLM's
processor cache (emptied after each rollout) and prefix cache find. Image and frame tokens are
never sampled (`bad_words`), so vLLM's log-probs are the update's, renormalised over the others.
A weight push also drops vLLM's encoder cache (image features of the old vision tower).

vLLM must run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM is first
imported) for the weight push to reach the model without serialising it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from grouprl.devices import release_cached_memory
from grouprl.errors import ConfigError, ModelLoadError
from grouprl.rollout.engines.base import (
    Generation,
    GroupDone,
    ReprefillSession,
    SamplingParams,
    rollout_phase,
)
from grouprl.rollout.engines.streams import Randomness, RowStreams

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: pip install 'grouprl[vllm]' on a CUDA machine, or the CPU "
    "build (see README, 'Rollout on vLLM')"
)


def import_vllm():
    """The vllm module, in-process; one clear line when it is not installed or cannot load."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise ModelLoadError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    _guard_kernel_scan()
    return vllm


def request_seeds(generator: Randomness, prompts: int, n: int) -> list[int] | None:
    """vLLM's seed for each of `prompts` requests of n samples (vLLM seeds a request's sample j
    with seed + j). From row streams: one draw of each request's first row, so a group's samples
    depend on its rows' keys alone, not on the call's other requests, its batching or the rank
    that runs it. From a torch generator: drawn in order. None: vLLM's own randomness."""
    if isinstance(generator, RowStreams):
        if len(generator) != prompts * n:
            raise ValueError(f"{len(generator)} row streams for {prompts} prompts x {n} samples")
        draws = generator.select([i * n for i in range(prompts)]).uniform(dtype=torch.float64)
        return [int(u * (2**31 - 1)) for u in draws.tolist()]
    if generator is not None:
        return torch.randint(0, 2**31 - 1, (prompts,), generator=generator).tolist()
    return None


def _seeded(sampling, seed: int):
    """`sampling` for one request seeded with `seed` (a shallow copy, as vLLM's own `clone`
    makes where it may)."""
    params = copy.copy(sampling)
    params.seed = seed
    return params


def _mapping_vars(value) -> Mapping:
    """vars(value) where that is a mapping, else an empty one."""
    try:
        found = vars(value)
    except TypeError:
        return {}
    return found if isinstance(found, Mapping) else {}


def _guard_kernel_scan() -> None:
    """vLLM's CPU build rebinds kernels at every engine start by scanning all loaded modules and
    calling `vars(x).get(...)` on their attributes; an object whose `__getattr__` answers any
    name (llvmlite's `ffi.lib`, loaded with numba, which bm25s imports when present) makes that
    scan raise. Give the scan a `vars` that returns a mapping or nothing (a module global
    shadows the builtin for that module only); builds without the scan are left alone."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if hasattr(dispatcher, "_rebind_kernels"):
        dispatcher.vars = _mapping_vars


def logprobs_mode(cfg: Any) -> str:
    """vLLM's log-prob mode for the training rollouts' sampling settings (`cfg`: the rollout
    config), chosen once, when the engine starts.

    The trainer's log-probs are log softmax(logits / temperature) over the whole vocabulary.
    vLLM's `processed_logprobs` are taken after temperature and after top-k/top-p (the kept
    tokens renormalised, the rest -inf); its `raw_logprobs` are log softmax(logits), before
    temperature (and before penalties, which the engine never sets). So: no truncation, or greedy
    sampling (which skips both): processed, the trainer's numbers; truncation at temperature 1:
    raw, the trainer's numbers; truncation at another temperature: neither is, and processed is
    kept, with a warning. Evaluation (`val_temperature`) gets the same mode; its log-probs train
    nothing."""
    if cfg.temperature == 0 or (cfg.top_k <= 0 and cfg.top_p >= 1):
        return "processed_logprobs"
    if cfg.temperature == 1:
        return "raw_logprobs"
    log.warning(
        "rollout.top_k/top_p truncate sampling at rollout.temperature=%s: vLLM's log-probs are of the "
        "truncated distribution (the kept tokens renormalised), the trainer's of the whole one, so "
        "rollout/mismatch_* measure the truncation (each token's log of the probability mass kept) "
        "and algorithm.rollout_is weights become that mass (below 1) instead of about 1; at "
        "temperature 1 both sides compute the same",
        cfg.temperature,
    )
    return "processed_logprobs"


def merged_state(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """(name, tensor) of the policy's weights as a plain checkpoint names them: LoRA adapters
    added into their base weights (W + scale * B @ A), the model unchanged; floating-point
    tensors cast to `dtype` (the engine's) when given. A layer's delta is computed when its base
    weight goes out and dropped right after, so one delta at a time exists (all of them at once
    would be the size of the adapted layers: ~26 GB for a 7B model with LoRA on every linear).
    Tied weights go out once (`named_parameters` skips repeats; vLLM ties the head itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules()) if base is not model else {}
    for name, param in base.named_parameters():
        if ".lora_" not in name:
            yield _merged(name, param, modules, dtype)


def _merged(name: str, param: torch.Tensor, modules: Mapping, dtype, own: bool = False):
    """One weight as `merged_state` sends it (its LoRA delta added, cast to `dtype`); `own`: in
    storage of its own, never the parameter's (which FSDP frees when it reshards)."""
    tensor = param.detach()
    made = False
    if name.endswith(".base_layer.weight"):
        delta = _lora_delta(modules.get(name.removesuffix(".base_layer.weight")))
        if delta is not None:
            tensor, made = tensor + delta.to(tensor.dtype), True
            del delta  # gone before the tensor leaves: the consumer may hold on to it
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor, made = tensor.to(dtype), True
    if own and not made:
        tensor = tensor.clone()
    return name.replace(".base_layer.", "."), tensor


def sharded_state(root: torch.nn.Module, dtype: torch.dtype | None = None):
    """`merged_state` of the policy an FSDP2 root shards over the ranks (`root.model`, the root's
    forward running it), gathered one FSDP module at a time: the root's own weights (embeddings,
    final norm, head: what no layer holds), then each layer in order, each unsharded, streamed
    and resharded before the next, so one layer's weights are whole at a time (plus what the
    consumer keeps of them: yielded tensors are copies, since resharding frees the gathered
    storage). A LoRA layer's adapters sit in the same module as its base weight, so its delta is
    computed from whole tensors. The gathered weights are FSDP's compute copies (its
    `param_dtype` under mixed precision), the weights the update's forward and generation on
    the built-in engine see. Every rank must run this generator to its end, in step: each
    unshard is an all-gather over the ranks. Inside the trainer's `gathered` (`root.whole`)
    the weights are whole already and nothing is gathered."""
    from torch.distributed.fsdp import FSDPModule

    model = root.model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules())
    layers = {name: m for name, m in modules.items() if isinstance(m, FSDPModule) and m is not root}
    owned: dict[str, list[str]] = {"": []}  # a module's name in `base` ("" the root) -> its weights
    owned.update((name, []) for name in layers)
    for name, _ in base.named_parameters():  # tied weights once
        if ".lora_" in name:
            continue
        parts = name.split(".")
        # the innermost FSDP module holding the weight, else the root
        owner = next((p for k in range(len(parts) - 1, 0, -1) if (p := ".".join(parts[:k])) in layers), "")
        owned[owner].append(name)
    whole = getattr(root, "whole", False)
    for owner, names in owned.items():  # the same order on every rank
        unit = layers.get(owner, root)
        if not names:
            continue
        if not whole:
            unit.unshard()
        try:
            for name in names:  # looked up now: unsharding swaps the module's parameters
                yield _merged(name, base.get_parameter(name), modules, dtype, own=True)
        finally:
            if not whole:
                unit.reshard()


def _lora_delta(module) -> torch.Tensor | None:
    """The summed delta weight of a LoRA layer's active adapters; None where there is none."""
    if module is None:
        return None
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or module.merged:
        return None
    # linear adapters live in lora_A, embedding adapters in lora_embedding_A
    held = set(module.lora_A) | set(getattr(module, "lora_embedding_A", {}))
    delta = None
    for adapter in module.active_adapters:
        if adapter in held:
            part = module.get_delta_weight(adapter)
            delta = part if delta is None else delta + part
    return delta


def _refresh_tied_head(worker) -> None:
    """A tied LM head is skipped by the reload (its weight is the embedding's), but a backend may
    keep a repacked copy of it for its matrix products (vLLM's CPU backend does): redo that. A
    VLM's head may sit in its language model (vLLM's Qwen2-VL), whose config says the tie."""
    model = worker.model_runner.get_model()
    owners = [model]
    if hasattr(model, "get_language_model"):
        owners.append(model.get_language_model())
    for owner in owners:
        head = getattr(owner, "lm_head", None)
        config = getattr(owner, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if head is not None and getattr(text, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
            return


@contextlib.contextmanager
def _quiet(name: str, level: int = logging.ERROR):
    """Raise logger `name`'s level inside the block."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(max(level, before))
    try:
        yield
    finally:
        logger.setLevel(before)


def beside_ranks() -> bool:
    """Whether this process is one rank of several in a process group the trainer joined."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@contextlib.contextmanager
def _launcher_env(device: torch.device):
    """RANK and LOCAL_RANK as vLLM's external launcher reads them while the engine starts: this
    process's rank, and the index of the trainer's device (cuda:LOCAL_RANK is where the engine
    lives), whatever the launcher wrote."""
    import torch.distributed as dist

    local = device.index if device.type == "cuda" and device.index is not None else None
    if local is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
    wanted = {"RANK": str(dist.get_rank()), "LOCAL_RANK": str(local)}
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leave_groups_to_the_trainer(llm) -> None:
    """vLLM's teardown (when the engine is collected, or at exit) ends by destroying its groups and
    then the default one, here the trainer's: mid-run that would end the trainer's group, and at
    exit, after the trainer left it (which ends every group, vLLM's with it), it fails on groups
    already gone. Let it run without that last part: the groups are the trainer's to end."""
    client = getattr(llm.llm_engine, "engine_core", None)  # in-process: the engine core's client
    core = getattr(client, "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    core_module = sys.modules.get("vllm.v1.engine.core")
    cleanup = getattr(core_module, "cleanup_dist_env_and_memory", None)
    if core is None or not isinstance(finalizer, weakref.finalize) or cleanup is None:
        return  # another vLLM layout: its own teardown stays
    teardown = core.shutdown

    def shutdown() -> None:
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
        try:
            teardown()
        finally:
            core_module.cleanup_dist_env_and_memory = cleanup

    core.shutdown = shutdown  # what the client's own shutdown calls
    if finalizer.detach() is not None:
        client._finalizer = weakref.finalize(client, shutdown)


class ImageMismatch(ModelLoadError):
    """vLLM's processing of a prompt's images differs from the trainer's (token count, expanded
    ids or pixels); `prompt` is the prompt's index in the `generate` call."""

    def __init__(self, prompt: int, message: str):
        super().__init__(message)
        self.prompt = prompt


# vLLM architectures whose Hugging Face processor class holds a video processor, which needs
# torchvision -> (vLLM's model module, the processor class in transformers)
_WITH_VIDEO_HALF = {
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLProcessor"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLProcessor"),
    "SmolVLMForConditionalGeneration": ("smolvlm", "SmolVLMProcessor"),
}


def register_image_only(architectures: list[str]) -> None:
    """Without torchvision, vLLM cannot build the Hugging Face processor of Qwen2-VL/2.5-VL or
    SmolVLM: the processor class loads its video processor, which needs torchvision. For those
    architectures, register vLLM's own model class again (in this process) with processing info
    whose processor is the image processor `AutoImageProcessor` loads (the class the trainer's
    processor uses) and the tokenizer, without the video half; the engine then takes images
    only. The model, its prompt expansion and its vision tower stay vLLM's. With torchvision
    installed nothing changes."""
    wanted = [a for a in architectures if a in _WITH_VIDEO_HALF]
    if not wanted or importlib.util.find_spec("torchvision") is not None:
        return
    from vllm import ModelRegistry

    for architecture in wanted:
        # a class, not a lazy name: vLLM inspects lazy ones in a subprocess, which would import
        # the module without the stand-in below
        ModelRegistry.register_model(architecture, _image_only_class(architecture))


def _image_only_class(architecture: str):
    """vLLM's model class for `architecture` under processing info that builds the processor
    without its video half and takes images only."""
    import transformers
    from vllm.multimodal import MULTIMODAL_REGISTRY

    module_name, processor_name = _WITH_VIDEO_HALF[architecture]
    model_cls = getattr(_import_without_torchvision(f"vllm.model_executor.models.{module_name}"), architecture)
    processor_cls = getattr(transformers, processor_name)
    factories = model_cls._processor_factory

    class ImageOnlyInfo(factories.info):
        def get_supported_mm_limits(self):
            return {"image": None}

        def get_hf_processor(self, **kwargs):
            return _image_only_processor(processor_cls, self.ctx.model_config.model, self.ctx.tokenizer)

    image_only = type(architecture, (model_cls,), {})
    register = MULTIMODAL_REGISTRY.register_processor(
        factories.processor, info=ImageOnlyInfo, dummy_inputs=factories.dummy_inputs
    )
    return register(image_only)


def _import_without_torchvision(name: str):
    """Import vLLM's model module `name`. vLLM's Qwen2-VL module takes `smart_resize` from
    transformers' torchvision image-processor module, which cannot load without torchvision:
    while it imports, that module's name stands for transformers' PIL one, which carries the
    same function."""
    stand_in = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if name in sys.modules or stand_in in sys.modules:
        return importlib.import_module(name)
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl

    sys.modules[stand_in] = image_processing_pil_qwen2_vl
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules[stand_in]


_PROCESSORS: dict[tuple, Any] = {}


def _image_only_processor(processor_cls, path: str, tokenizer):
    """`processor_cls` of the model at `path` without its video processor: the image processor
    `AutoImageProcessor` loads, `tokenizer`, and the processor's own settings from
    processor_config.json (e.g. SmolVLM's `image_seq_len`)."""
    key = (processor_cls, path, id(tokenizer))
    if key not in _PROCESSORS:
        from transformers import AutoImageProcessor

        class ImageOnly(processor_cls):
            # the processor's sub-processors are the ones its __init__ names: these two
            def __init__(self, image_processor=None, tokenizer=None, **kwargs):
                super().__init__(image_processor, tokenizer, None, **kwargs)

        settings, _ = processor_cls.get_processor_dict(path)
        named = set(inspect.signature(processor_cls.__init__).parameters) - {
            "self", "image_processor", "tokenizer", "video_processor", "args", "kwargs"
        }
        own = {k: v for k, v in settings.items() if k in named}
        _PROCESSORS[key] = ImageOnly(AutoImageProcessor.from_pretrained(path), tokenizer, **own)
    return _PROCESSORS[key]


# vLLM reports at most this many chosen tokens' log-probs a step (its MAX_LOGPROB_TOKEN_IDS)
_MAX_REPORTED = 128
_MOST_MASS = 1 - 1e-12  # the never-sampled tokens' mass, below 1 so the correction stays finite

# where each family's processor settings live, for the token-count error
_SETTINGS_HINT = {
    "idefics": " (Idefics3/SmolVLM: `image_seq_len` in processor_config.json, the tokens per tile)",
    "qwen": " (Qwen: `min_pixels` / `max_pixels` in preprocessor_config.json)",
}


def placeholder_text(family) -> str:
    """The text vLLM's processor expands one image from: Qwen's `<|image_pad|>` inside its vision
    markers (vLLM writes the run of pads), Idefics3/SmolVLM's `<image>` (vLLM writes the frames,
    tile tags and image tokens)."""
    if family.name == "qwen":
        return family.start_text + family.image_text + family.end_text
    if family.name == "idefics":
        return family.image_text
    raise ConfigError(f"rollout.engine=vllm has no image placeholder for the {family.name!r} VLM family")


def collapse_images(ids: list[int], expansions: list[list[int]], placeholder: list[int]) -> list[int]:
    """`ids` with each image's expansion (`expansions[j]`, the token ids of image j's text, in
    order) replaced by `placeholder`. ValueError where an image's tokens are not found in order."""
    out: list[int] = []
    at = 0
    for j, expansion in enumerate(expansions):
        start = _find(ids, expansion, at)
        if start < 0:
            raise ValueError(f"image {j}'s tokens are not in the prompt (after position {at})")
        out.extend(ids[at:start])
        out.extend(placeholder)
        at = start + len(expansion)
    out.extend(ids[at:])
    return out


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The first index >= start where `part` occurs in `ids`, or -1."""
    first, size = part[0], len(part)
    try:
        k = ids.index(first, start)
        while ids[k : k + size] != part:
            k = ids.index(first, k + 1)
        return k
    except ValueError:
        return -1


class VLLMEngine:
    """RolloutEngine on an in-process vLLM `LLM` holding its own copy of the policy's weights."""

    # sleep off CUDA too: for tests against a fake vLLM that keeps sleep mode's rules (vLLM's CPU
    # build has no sleep mode, so production sleeps on CUDA only)
    emulate_sleep = False

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        model_path: str,
        cfg: Any,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        max_model_len: int | None = None,
        vision=None,
        sharded: torch.nn.Module | None = None,
        device: torch.device | None = None,
    ):
        """`cfg` is the rollout config; `model_path` the folder the policy was loaded from (vLLM
        reads its config, tokenizer and image processor there; its weights are the trainer's,
        pushed below); `vision` the VLM family of a policy that reads images; `sharded` the FSDP2
        root over `model` when the policy is sharded over several ranks (each rank then runs an
        engine of its own, see `_start`, and pushes gather the weights layer by layer:
        `sharded_state`); `device` the trainer's device (default: the parameters')."""
        vllm = import_vllm()
        self.model, self.tokenizer = model, tokenizer
        self.sharded = sharded
        self._device = device or next(model.parameters()).device
        self.vision = vision
        if vision is not None:
            self._placeholder = list(tokenizer(placeholder_text(vision), add_special_tokens=False)["input_ids"])
            self._expansions: dict[str, list[int]] = {}  # an image's text -> its token ids
            self._never_sampled = vision.never_sampled()
            self._bad_words = self._banned_words(self._never_sampled)
            self._allowed: list[int] | None = None  # the other tokens, where bad_words cannot say it
        self.dtype = dtype
        self.sleep_level = cfg.sleep_level
        self.on_cuda = self._device.type == "cuda"
        self.sleeps = self.sleep_level > 0 and (self.on_cuda or self.emulate_sleep)
        self.logprobs_mode = logprobs_mode(cfg)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids = set([eos] if isinstance(eos, int) else list(eos or []))
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos_ids)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.push_seconds = 0.0  # time spent pushing weights, in all
        self.last_sleep_freed_bytes = 0  # accelerator memory the last sleep gave back (0 off CUDA)
        self._asleep: set[str] = set()  # vLLM's sleeping allocations: "weights", "kv_cache"
        self._source = model  # the policy whose weights vLLM holds, or is to hold
        self._pending: torch.nn.Module | None = None  # a policy to push at the next wake
        self._rollouts = 0  # open rollouts: begin_rollout calls not yet ended
        t0 = time.perf_counter()
        try:  # vLLM seeds the global torch generator while it starts: keep the trainer's as it was
            with torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.on_cuda else []):
                self.llm = self._start(vllm, model_path, cfg, seed, dtype, max_model_len)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any engine start-up failure is one line
            said = " ".join(str(e).split())  # vLLM's config errors span lines: keep them, on one
            said = said if len(said) <= 400 else said[:400] + " ..."
            raise ModelLoadError(f"vLLM could not start on '{model_path}': {type(e).__name__}: {said}") from None
        log.info("vLLM engine ready in %.1f s", time.perf_counter() - t0)
        # the trainer's weights (LoRA merged, a resumed checkpoint) replace the folder's: now, or
        # at the first wake when the engine sleeps (a push now would be lost to a level-2 sleep)
        if self.sleeps:
            self._pending = model
            self._sleep()
        else:
            self.weights_updated(model)

    def _start(self, vllm, model_path, cfg, seed, dtype, max_model_len):
        if cfg.tensor_parallel_size != 1:  # its workers would be other processes, beyond the push
            raise ConfigError(
                "rollout.engine=vllm runs one in-process engine per rank, each holding the whole model "
                "on its rank's device: rollout.tensor_parallel_size must be 1"
            )
        extra = {}
        if self.vision is not None:
            register_image_only(list(getattr(self.model.config, "architectures", None) or []))
            # normalise on the host, in the image processor, as the trainer's processor does: the
            # pixels vLLM's tower sees are then the trainer's exactly
            extra["mm_device_do_normalize"] = False
        beside = beside_ranks()
        if beside:  # vLLM's groups from the trainer's, one engine per rank (module docstring)
            extra["distributed_executor_backend"] = "external_launcher"
        with _launcher_env(self._device) if beside else contextlib.nullcontext():
            llm = vllm.LLM(
                model=model_path,
                tokenizer=model_path,
                dtype=str(dtype).removeprefix("torch."),
                seed=seed,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                # an explicit KV budget wins over the share
                kv_cache_memory_bytes=int(cfg.kv_cache_gb * 2**30) or None,
                max_model_len=max_model_len,
                enable_prefix_caching=True,
                enable_sleep_mode=self.sleeps,
                enforce_eager=cfg.enforce_eager,
                logprobs_mode=self.logprobs_mode,
                **extra,
            )
        if beside:
            _leave_groups_to_the_trainer(llm)
        return llm

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ rollouts and sleep
    def begin_rollout(self) -> None:
        """Wake for a rollout (the outermost one, when they nest): the weights, then the push of
        a policy that changed meanwhile (or of any policy after level 2), then the KV cache."""
        if self._rollouts == 0 and self._asleep:
            # vLLM allocates through an allocator of its own: what PyTorch's caching allocator
            # keeps of the update (and of the push's copies) would be out of its reach
            release_cached_memory(self._device)
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
            if self._pending is not None:
                self._push(self._pending)
            release_cached_memory(self._device)
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        self._rollouts += 1

    def end_rollout(self) -> None:
        """Sleep once the outermost rollout has ended, so the update has the memory."""
        self._rollouts = max(self._rollouts - 1, 0)
        if self._rollouts == 0:
            if self.vision is not None:  # the rollout's processed images: a host copy of each
                self.llm.reset_mm_cache()
                self._expansions.clear()
            self._sleep()

    def _sleep(self) -> None:
        if not self.sleeps or self._asleep:
            return
        free_before = torch.cuda.mem_get_info()[0] if self.on_cuda else 0
        self.llm.sleep(level=self.sleep_level)  # also drops the prefix cache: its blocks are gone
        self.last_sleep_freed_bytes = torch.cuda.mem_get_info()[0] - free_before if self.on_cuda else 0
        self._asleep = {"weights", "kv_cache"}
        if self.sleep_level == 2 and self._pending is None:  # discarded: garbage on wake until a push
            self._pending = self._source

    # ------------------------------------------------------------------ weights
    def weights_updated(self, model: torch.nn.Module) -> None:
        """Stream the policy's weights into vLLM's model in place, then drop the prefix cache
        (its blocks hold keys and values of the old weights). Asleep, the push waits for the
        next wake: waking the weights only to push would take their memory during the update."""
        self._source = model
        if "weights" in self._asleep:
            self._pending = model
            return
        self._push(model)

    @torch.no_grad()  # LoRA deltas from trainable adapters: no graph
    def _push(self, model: torch.nn.Module) -> None:
        t0 = time.perf_counter()
        weights = self._weights(model)
        with _quiet("vllm"):  # a line per push, and one per weightless layer: not the user's business
            # `weights_iterator` / `is_checkpoint_format` came with vLLM 0.16 (0.15 takes no arguments)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            for _ in weights:  # whatever the load left unread: every rank makes every gather
                pass
            self.llm.collective_rpc(_refresh_tied_head)
            self.llm.reset_prefix_cache()
            if self.vision is not None:  # image features of the old vision tower
                self.llm.llm_engine.reset_encoder_cache()
        self._pending = None
        self.push_seconds += time.perf_counter() - t0

    def _weights(self, model: torch.nn.Module):
        """The policy's weights as vLLM loads them: gathered layer by layer where `model` is the
        sharded policy (or its FSDP root), else as the process holds them."""
        if self.sharded is not None and model in (self.sharded, getattr(self.sharded, "model", None)):
            return sharded_state(self.sharded, self.dtype)
        return merged_state(model, self.dtype)

    # ------------------------------------------------------------------ sampling
    def _params(self, n: int, params: SamplingParams):
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=n,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            ignore_eos=params.ignore_eos,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,  # the hf engine keeps the stop string too
            detokenize=bool(params.stop),  # text is decoded here; vLLM needs it for stop strings only
            skip_special_tokens=False,  # stop strings are matched on the full text, as the hf engine does
            output_kind=RequestOutputKind.FINAL_ONLY,  # a prompt's n samples together, once all ended
            **self._log_prob_args(),
            **self._never(),
        )

    def _raw_banned(self) -> list[int]:
        """The never-sampled tokens whose log-probs each step reports, where vLLM's log-probs are
        its raw ones (taken before any token is masked): their mass is taken out afterwards. vLLM
        reports at most 128 chosen tokens; a family with more stays uncorrected (none has)."""
        if self.vision is None or self.logprobs_mode != "raw_logprobs":
            return []
        return self._never_sampled if 0 < len(self._never_sampled) <= _MAX_REPORTED else []

    def _log_prob_args(self) -> dict:
        banned = self._raw_banned()
        if banned:  # the sampled token's and the never-sampled tokens' log-probs
            return {"logprobs": len(banned), "logprob_token_ids": banned}
        return {"logprobs": 0}  # the sampled token's own log-prob

    def _banned_words(self, banned: list[int]) -> list[str] | None:
        """The never-sampled tokens as vLLM's `bad_words` (each one token, banned everywhere), or
        None where one of them does not encode to itself alone (then `allowed_token_ids`)."""
        words = [self.tokenizer.convert_ids_to_tokens(t) for t in banned]
        for word, token in zip(words, banned):
            if not isinstance(word, str) or self.tokenizer.encode(word, add_special_tokens=False) != [token]:
                return None
        return words

    def _never(self) -> dict:
        """Sampling arguments that keep a VLM's image and frame tokens from being sampled; vLLM
        masks them before its processed log-probs, as the update excludes them."""
        if self.vision is None or not self._never_sampled:
            return {}
        if self._bad_words is not None:
            return {"bad_words": self._bad_words}
        if self._allowed is None:
            banned = set(self._never_sampled)
            vocab = self.llm.llm_engine.model_config.get_vocab_size()
            self._allowed = [t for t in range(vocab) if t not in banned]
        return {"allowed_token_ids": self._allowed}

    def _generation(self, out) -> Generation:
        token_ids = list(out.token_ids)
        if out.finish_reason == "length":
            reason = "length"
        elif out.stop_reason is None or isinstance(out.stop_reason, int):
            reason = "eos"  # an EOS token, kept as the hf engine keeps it
        else:
            reason = "stop"
        log_probs = [step[t].logprob for step, t in zip(out.logprobs or [], token_ids)]
        banned = self._raw_banned()
        if banned:  # renormalise over the tokens that can be sampled, as the update does
            log_probs = [
                lp - math.log1p(-min(sum(math.exp(step[b].logprob) for b in banned if b in step), _MOST_MASS))
                for lp, step in zip(log_probs, out.logprobs or [])
            ]
        return Generation(
            token_ids=token_ids,
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            finish_reason=reason,
            log_probs=log_probs if len(log_probs) == len(token_ids) else None,
        )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: Randomness = None,
        on_group_done: GroupDone | None = None,
        images: list[list] | None = None,
    ) -> list[Generation]:
        """n samples of every prompt, prompt-major; a prompt's n samples are handed to
        `on_group_done` as soon as vLLM has finished all of them. `images[i]`: prompt i's images
        (`ImageInput`s in the order of their tokens), for a VLM policy."""
        if images is not None and any(images) and self.vision is None:
            raise ValueError("images given to a vllm engine started for a text-only policy")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
        if not prompts:
            return []
        with rollout_phase(self):  # outside the trainer's rollouts a call is a rollout of its own
            return self._generate(prompts, n, params, generator, on_group_done, images)

    # ------------------------------------------------------------------ images
    def _inputs(self, prompts: list[list[int]], images: list[list] | None) -> list:
        """vLLM's input of every prompt: its ids, or for a prompt with images the request vLLM's
        processor has expanded, checked against the trainer's (`_check`)."""
        inputs: list = [{"prompt_token_ids": list(p)} for p in prompts]
        with_images = [i for i in range(len(prompts)) if images is not None and images[i]]
        if not with_images:
            return inputs
        requests = [self._image_request(i, prompts[i], images[i]) for i in with_images]
        rendered = self.llm.llm_engine.renderer.render_cmpl(requests)
        try:
            for i, request in zip(with_images, rendered):
                self._check(i, prompts[i], images[i], request)
                inputs[i] = request
        except ImageMismatch:
            self.llm.reset_mm_cache()  # nothing of these requests is queued: forget their images
            raise
        return inputs

    def _image_request(self, i: int, prompt: list[int], images: list) -> dict:
        for j, image in enumerate(images):
            if getattr(image, "source", None) is None:
                raise ValueError(
                    f"image {j} of prompt {i} carries no source image for vLLM "
                    "(images are prepared with VisionProcessor.prepare_image)"
                )
        try:
            ids = collapse_images(list(prompt), [self._expansion(image) for image in images], self._placeholder)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        return {
            "prompt_token_ids": ids,
            "multi_modal_data": {"image": [image.source for image in images]},
            # the pixel fingerprint: vLLM's processor and prefix caches know a repeated image by it
            "multi_modal_uuids": {"image": [image.key for image in images]},
        }

    def _expansion(self, image) -> list[int]:
        if image.text not in self._expansions:
            self._expansions[image.text] = list(self.tokenizer(image.text, add_special_tokens=False)["input_ids"])
        return self._expansions[image.text]

    def _check(self, i: int, prompt: list[int], images: list, request: Mapping) -> None:
        """vLLM's expansion of prompt i holds as many tokens for each image as the trainer's, in
        the same places (the expanded ids equal the trainer's), and its pixel tensors are the
        trainer's (checked where vLLM processed the image for this request; a cached one was
        checked when first processed)."""
        places = request["mm_placeholders"].get("image", [])
        for j, (image, place) in enumerate(zip(images, places)):
            count = place.length if place.is_embed is None else int(place.is_embed.sum())
            if count != image.num_tokens:
                raise ImageMismatch(
                    i,
                    f"prompt {i}, image {j} ({image.original_size[0]}x{image.original_size[1]}): vLLM expands it to "
                    f"{count} image tokens, the trainer's processor to {image.num_tokens}; both must read the "
                    f"model folder's processor settings{_SETTINGS_HINT.get(self.vision.name, '')}",
                )
        got = list(request["prompt_token_ids"])
        if len(places) != len(images) or got != list(prompt):
            at = next((k for k, (a, b) in enumerate(zip(got, prompt)) if a != b), min(len(got), len(prompt)))
            raise ImageMismatch(
                i,
                f"prompt {i}: vLLM's expansion of its {len(images)} images differs from the trainer's "
                f"({len(places)} placed, {len(got)} ids for {len(prompt)}, first difference at token {at})",
            )
        items = request["mm_kwargs"].get("image", [])
        for j, (image, item) in enumerate(zip(images, items)):
            if item is None:
                continue
            for name, tensor in image.tensors.items():
                theirs = item[name].data if name in item else None
                if theirs is not None and not (
                    theirs.numel() == tensor.numel() and torch.equal(theirs, tensor.reshape(theirs.shape))
                ):
                    raise ImageMismatch(
                        i,
                        f"prompt {i}, image {j}: vLLM's processor gives other {name} than the trainer's "
                        "(the two image processors differ in class or settings)",
                    )

    def _generate(self, prompts, n, params, generator, on_group_done, images=None) -> list[Generation]:
        engine = self.llm.llm_engine
        # greedy samples of one prompt are all alike: vLLM takes n = 1 there, copied n times
        copies = n if params.temperature == 0 else 1
        sampling = self._params(n // copies, params)
        seeds = request_seeds(generator, len(prompts), n)
        devices = [torch.cuda.current_device()] if self.on_cuda else []
        done: dict[int, list[Generation]] = {}
        inputs = self._inputs(prompts, images)  # all checked before any is queued
        # seeded requests sample from generators of their own, but vLLM's CPU sampler still draws
        # from the global one for the whole batch: the trainer's stays as it was
        with torch.random.fork_rng(devices=devices, enabled=seeds is not None):
            for i, request in enumerate(inputs):
                seeded = sampling if seeds is None else _seeded(sampling, seeds[i])
                engine.add_request(str(i), request, seeded)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    i = int(out.request_id)
                    ordered = sorted(out.outputs, key=lambda o: o.index)
                    done[i] = [self._generation(o) for o in ordered for _ in range(copies)]
                    if on_group_done is not None:
                        on_group_done(i, done[i])
        self.prefill_tokens += sum(len(p) for p in prompts)
        self.decode_tokens += sum(len(g.token_ids) for gens in done.values() for g in gens)
        return [g for i in range(len(prompts)) for g in done[i]]

    def open_session(
        self, prompts: list[list[int]], n: int, reuse_cache: bool = True, images: list[list] | None = None
    ) -> ReprefillSession:
        """Every turn feeds each conversation whole; vLLM's prefix cache finds the part it has
        already computed, which takes the place of the hf engine's per-row KV reuse."""
        return ReprefillSession(self, prompts, n, images)
