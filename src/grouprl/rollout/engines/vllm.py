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

Sampling randomness: vLLM draws from the global torch generator when a request has no seed of
its own (a per-request seed fails on vLLM's CPU backend), so each `generate` reseeds it from the
trainer's generator inside `torch.random.fork_rng`: the same generator state gives the same
samples, and the trainer's own global RNG is left as it was.

vLLM must run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM is first
imported) for the weight push to reach the model without serialising it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

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
        if ".lora_" in name:
            continue
        tensor = param.detach()
        if name.endswith(".base_layer.weight"):
            delta = _lora_delta(modules.get(name.removesuffix(".base_layer.weight")))
            if delta is not None:
                tensor = tensor + delta.to(tensor.dtype)
                del delta  # gone before the tensor leaves: the consumer may hold on to it
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name.replace(".base_layer.", "."), tensor


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
    keep a repacked copy of it for its matrix products (vLLM's CPU backend does): redo that."""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if head is not None and getattr(config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


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
    ):
        """`cfg` is the rollout config; `model_path` the folder the policy was loaded from (vLLM
        reads its config and tokenizer there; its weights are the trainer's, pushed below)."""
        vllm = import_vllm()
        self.model, self.tokenizer = model, tokenizer
        self.dtype = dtype
        self.sleep_level = cfg.sleep_level
        self.on_cuda = next(model.parameters()).device.type == "cuda"
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
            raise ConfigError("rollout.engine=vllm runs one in-process worker: rollout.tensor_parallel_size must be 1")
        return vllm.LLM(
            model=model_path,
            tokenizer=model_path,
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=int(cfg.kv_cache_gb * 2**30) or None,  # an explicit KV budget wins over the share
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleeps,
            enforce_eager=cfg.enforce_eager,
            logprobs_mode=self.logprobs_mode,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------ rollouts and sleep
    def begin_rollout(self) -> None:
        """Wake for a rollout (the outermost one, when they nest): the weights, then the push of
        a policy that changed meanwhile (or of any policy after level 2), then the KV cache."""
        if self._rollouts == 0 and self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
            if self._pending is not None:
                self._push(self._pending)
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")
        self._rollouts += 1

    def end_rollout(self) -> None:
        """Sleep once the outermost rollout has ended, so the update has the memory."""
        self._rollouts = max(self._rollouts - 1, 0)
        if self._rollouts == 0:
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
        with _quiet("vllm"):  # a line per push, and one per weightless layer: not the user's business
            # `weights_iterator` / `is_checkpoint_format` came with vLLM 0.16 (0.15 takes no arguments)
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": merged_state(model, self.dtype), "is_checkpoint_format": True},
            )
            self.llm.collective_rpc(_refresh_tied_head)
            self.llm.reset_prefix_cache()
        self._pending = None
        self.push_seconds += time.perf_counter() - t0

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
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,  # the hf engine keeps the stop string too
            logprobs=0,  # the sampled token's own log-prob
            detokenize=bool(params.stop),  # text is decoded here; vLLM needs it for stop strings only
            skip_special_tokens=False,  # stop strings are matched on the full text, as the hf engine does
            output_kind=RequestOutputKind.FINAL_ONLY,  # a prompt's n samples together, once all ended
        )

    def _generation(self, out) -> Generation:
        token_ids = list(out.token_ids)
        if out.finish_reason == "length":
            reason = "length"
        elif out.stop_reason is None or isinstance(out.stop_reason, int):
            reason = "eos"  # an EOS token, kept as the hf engine keeps it
        else:
            reason = "stop"
        log_probs = [step[t].logprob for step, t in zip(out.logprobs or [], token_ids)]
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
        `on_group_done` as soon as vLLM has finished all of them."""
        if images is not None and any(images):
            raise ValueError("the vllm engine takes text prompts only; VLM policies generate on rollout.engine=hf")
        if not prompts:
            return []
        with rollout_phase(self):  # outside the trainer's rollouts a call is a rollout of its own
            return self._generate(prompts, n, params, generator, on_group_done)

    def _generate(self, prompts, n, params, generator, on_group_done) -> list[Generation]:
        engine = self.llm.llm_engine
        # greedy samples of one prompt are all alike: vLLM takes n = 1 there, copied n times
        copies = n if params.temperature == 0 else 1
        sampling = self._params(n // copies, params)
        if isinstance(generator, RowStreams):  # vLLM seeds per call: one seed from the rows' streams
            seed = generator.call_seed()
        elif generator is not None:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        else:
            seed = None
        devices = [torch.cuda.current_device()] if self.on_cuda else []
        done: dict[int, list[Generation]] = {}
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": list(prompt)}, sampling)
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
