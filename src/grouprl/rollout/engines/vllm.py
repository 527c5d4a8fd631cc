"""The vLLM engine: rollouts on vLLM's paged attention and continuous batching, in the trainer's
process, colocated with training.

Token ids in, token ids out: prompts go to vLLM as ids, each sample comes back as the ids vLLM
sampled with their log-probs (see `logprobs_mode` for which distribution), and the text is
decoded here with the policy's tokenizer, as the hf engine does. A prompt's n samples are one
request with `n`; prefix caching shares a prompt's KV blocks between its samples and, for
agents, between the turns of a conversation (each turn feeds the conversation whole).

The engine holds its own copy of the weights: after every optimizer step the trainer calls
`weights_updated(model)`, which streams the policy's parameters into vLLM's model in place
(`vllm_weights.py`: LoRA merged on the fly, one layer at a time, gathered module by module on
several ranks) and resets the prefix cache. Several ranks each run an engine of their own
(`vllm_ranks.py`); a VLM policy's images go with its requests, checked against the trainer's
(`vllm_vision.py`); where the engine reaches into vLLM's internals is `vllm_shims.py`.

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

vLLM must run in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM is first
imported) for the weight push to reach the model without serialising it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch

from grouprl.devices import release_cached_memory
from grouprl.errors import ConfigError, ModelLoadError
from grouprl.rollout.engines.base import (
    Generation,
    GroupDone,
    SamplingParams,
    WeightOffers,
    rollout_phase,
)
from grouprl.rollout.engines.sampling import request_seeds, seeded
from grouprl.rollout.engines.streams import Randomness
from grouprl.rollout.engines.vllm_ranks import beside_ranks, launcher_env
from grouprl.rollout.engines.vllm_shims import (
    guard_kernel_scan,
    leave_groups_to_the_trainer,
    register_image_only,
)
from grouprl.rollout.engines.vllm_vision import (
    ImageMismatch,
    ImageRequests,
    collapse_images,
    placeholder_text,
    renormalised,
)
from grouprl.rollout.engines.vllm_weights import merged_state, push, sharded_state

# the engine's module is where callers have always found these
__all__ = [
    "ImageMismatch",
    "VLLMEngine",
    "collapse_images",
    "import_vllm",
    "logprobs_mode",
    "merged_state",
    "placeholder_text",
    "request_seeds",
    "sharded_state",
]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: pip install 'grouprl[vllm]' on a CUDA machine, or the CPU "
    "build (see docs/scale/vllm.md)"
)



def import_vllm():
    """The vllm module, in-process; one clear line when it is not installed or cannot load."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise ModelLoadError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from None
    guard_kernel_scan()
    return vllm


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


class VLLMEngine:
    """RolloutEngine on an in-process vLLM `LLM` holding its own copy of the policy's weights."""

    # sleep off CUDA too: for tests against a fake vLLM that keeps sleep mode's rules (vLLM's CPU
    # build has no sleep mode, so production sleeps on CUDA only)
    emulate_sleep = False
    reads_trainer_weights = False  # RolloutEngine: vLLM samples from a copy of its own, pushed to

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
        # a VLM policy's requests: their images, checked; image tokens never sampled
        self.images = ImageRequests(tokenizer, vision) if vision is not None else None
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
        self.push_seconds = 0.0  # RolloutEngine.push_seconds: time spent pushing weights, in all
        self.last_sleep_freed_bytes = 0  # accelerator memory the last sleep gave back (0 off CUDA)
        self._asleep: set[str] = set()  # vLLM's sleeping allocations: "weights", "kv_cache"
        self._source = model  # the policy whose weights vLLM holds, or is to hold
        self._pending: torch.nn.Module | None = None  # a policy to push at the next wake
        self._rollouts = 0  # open rollouts: begin_rollout calls not yet ended
        self.policy_version: int | None = None  # RolloutEngine: the version weights_updated named
        self.offers = WeightOffers()  # newer weights offered between turns
        self.running_turns = 0  # a session's turn requests in vLLM: offers wait for them
        self._requests = 0  # request ids handed out
        self._finished: dict[str, Any] = {}  # finished requests' outputs, by id, until their caller takes them
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
        if beside:  # vLLM's groups from the trainer's, one engine per rank (vllm_ranks.py)
            extra["distributed_executor_backend"] = "external_launcher"
        with launcher_env(self._device) if beside else contextlib.nullcontext():
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
            leave_groups_to_the_trainer(llm)
        return llm

    @property
    def device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Nothing to end: vLLM runs in this process, and its memory goes with the engine."""

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
            if self.images is not None:  # the rollout's processed images: a host copy of each
                self.images.forget(self.llm)
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
    def weights_updated(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Stream the policy's weights into vLLM's model in place, then drop the prefix cache
        (its blocks hold keys and values of the old weights). Asleep, the push waits for the
        next wake: waking the weights only to push would take their memory during the update."""
        self._source, self.policy_version = model, version
        if "weights" in self._asleep:
            self._pending = model
            return
        self._push(model)

    @torch.no_grad()  # LoRA deltas from trainable adapters: no graph
    def _push(self, model: torch.nn.Module) -> None:
        t0 = time.perf_counter()
        push(self.llm, self._weights(model), images=self.vision is not None)
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
            **(self.images.never(self.llm) if self.images is not None else {}),
        )

    def _raw_banned(self) -> list[int]:
        """A VLM policy's never-sampled tokens whose mass comes out of raw log-probs
        (`ImageRequests.raw_banned`); none for a text policy."""
        return self.images.raw_banned(self.logprobs_mode) if self.images is not None else []

    def _log_prob_args(self) -> dict:
        banned = self._raw_banned()
        if banned:  # the sampled token's and the never-sampled tokens' log-probs
            return {"logprobs": len(banned), "logprob_token_ids": banned}
        return {"logprobs": 0}  # the sampled token's own log-prob

    def offer_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Taken into `model` (and pushed) where no turn runs (`between_turns`)."""
        self.offers.put(version, weights)

    def between_turns(self) -> None:
        """No turn of this call runs yet: offered weights are taken unless a session still has turn
        requests in vLLM (they wait for those to end)."""
        if self.offers.pending and self.running_turns == 0:
            self.offers.take(self)

    def _generation(self, out, version: int | None = -1) -> Generation:
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
            log_probs = renormalised(log_probs, out.logprobs or [], banned)
        return Generation(
            token_ids=token_ids,
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
            finish_reason=reason,
            log_probs=log_probs if len(log_probs) == len(token_ids) else None,
            version=self.policy_version if version == -1 else version,
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
            self.between_turns()
            return self._generate(prompts, n, params, generator, on_group_done, images)

    def _generate(self, prompts, n, params, generator, on_group_done, images=None) -> list[Generation]:
        # greedy samples of one prompt are all alike: vLLM takes n = 1 there, copied n times
        copies = n if params.temperature == 0 else 1
        sampling = self._params(n // copies, params)
        seeds = request_seeds(generator, len(prompts), n)
        done: dict[int, list[Generation]] = {}
        if self.images is not None:  # all checked before any is queued
            inputs = self.images.inputs(self.llm, prompts, images)
        else:
            inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        ids = [self.add_request(request, sampling if seeds is None else seeded(sampling, seeds[i])) for i, request in enumerate(inputs)]
        index = {rid: i for i, rid in enumerate(ids)}
        while len(done) < len(ids):
            if not self.llm.llm_engine.has_unfinished_requests() and not any(rid in self._finished for rid in index):
                raise RuntimeError(f"vLLM has no request left, {len(index)} of this call's unanswered")
            self.step(seeded=seeds is not None)
            for rid in [rid for rid in index if rid in self._finished]:
                out, i = self._finished.pop(rid), index.pop(rid)
                ordered = sorted(out.outputs, key=lambda o: o.index)
                done[i] = [self._generation(o) for o in ordered for _ in range(copies)]
                if on_group_done is not None:
                    on_group_done(i, done[i])
        self.prefill_tokens += sum(len(p) for p in prompts)
        self.decode_tokens += sum(len(g.token_ids) for gens in done.values() for g in gens)
        return [g for i in range(len(prompts)) for g in done[i]]

    # ------------------------------------------------------------------ requests
    def add_request(self, request: dict, sampling) -> str:
        """Queue one request in vLLM (it joins the running batch at vLLM's next step); its id."""
        self._requests += 1
        rid = str(self._requests)
        self.llm.llm_engine.add_request(rid, request, sampling)
        return rid

    def step(self, seeded: bool = True) -> None:
        """One vLLM engine step (nothing when no request is unfinished); the requests that finish
        in it are kept in `_finished` by id until their caller takes them (generate and sessions
        share the engine). Seeded requests sample from generators of their own, but vLLM's CPU
        sampler still draws from the global one for the whole batch: the trainer's stays as it was."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return
        devices = [torch.cuda.current_device()] if self.on_cuda else []
        with torch.random.fork_rng(devices=devices, enabled=seeded):
            for out in engine.step():
                if out.finished:
                    self._finished[out.request_id] = out

    def abort(self, rid: str) -> None:
        """Drop a request, finished or not."""
        self._finished.pop(rid, None)
        self.llm.llm_engine.abort_request([rid])

    def open_session(
        self, prompts: list[list[int]], n: int, reuse_cache: bool = True, images: list[list] | None = None
    ):
        """Every turn feeds each conversation whole; vLLM's prefix cache finds the part it has
        already computed, which takes the place of the hf engine's per-row KV reuse. Turns run
        together (`generate`) or one request each, joining vLLM's running batch (`submit` / `step`)."""
        from grouprl.rollout.engines.vllm_session import VLLMSession

        return VLLMSession(self, prompts, n, images)
