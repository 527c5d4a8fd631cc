"""Tiny causal LMs and a character-level tokenizer, built in the test (no hub, no downloads).

    from helpers import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer()                      # Llama, float32, seed 0
    model, tokenizer = tiny_model_and_tokenizer(arch="qwen2", dtype=torch.float64)
    model, tokenizer = tiny_model_and_tokenizer(tmp_path)              # also saved there:
    AutoModelForCausalLM.from_pretrained(tmp_path); AutoTokenizer.from_pretrained(tmp_path)

The tokenizer maps every printable ASCII character (letters, digits, punctuation, space,
newline) to one token and decodes by concatenation, so `decode(encode(text)) == text` and
token boundaries are character boundaries. Special tokens: <pad> = 0, <eos> = 1, <unk> = 2.
It carries a small chat template ("role: content\\n" per message, then "assistant:"), so
`grouprl.data.prompts.encode_prompt` works on it like on a real chat model; pass
`chat_template=None` for a base-model tokenizer.

The model (Llama, or Qwen2 which adds attention biases) has 2 layers, hidden size 32,
4 heads / 2 KV heads, tied embeddings and vocab_size == len(tokenizer); its weights are a
deterministic function of `seed`. The `tests` folder is on sys.path (tests/conftest.py),
so test modules anywhere below it can `from helpers import ...`.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A PreTrainedTokenizerFast with one token per character (see the module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte, GPT-2/Qwen/Llama-3 style
    spelling: a space is the piece "Ġ", a newline "Ċ"); <pad> = 0, <eos> = 1, 258 tokens.
    For tests of code that looks at token pieces rather than decoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1}
    for piece in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, padding_side="left")


def tiny_config(arch: str = "llama", vocab_size: int = 128, **overrides):
    """A 2-layer config of `arch` ("llama" or "qwen2"); `overrides` replace any field."""
    from transformers import LlamaConfig, Qwen2Config

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    fields.update(overrides)
    if arch == "llama":
        return LlamaConfig(**fields)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **fields)
    raise ValueError(f"unknown tiny architecture {arch!r}; allowed: llama, qwen2")


def tiny_model_and_tokenizer(
    tmp_path: str | Path | None = None,
    *,
    arch: str = "llama",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    init_std: float = 0.2,
    chat_template: str | None = CHAT_TEMPLATE,
    **config_overrides,
):
    """(model, tokenizer): a seeded tiny causal LM in eval mode and the character tokenizer.

    init_std: the weights' init std. The transformers default (0.02) makes a 2-layer model's
    next-token distribution almost uniform, so greedy choices hinge on near-ties; 0.2 gives
    peaked, distinct logits.
    tmp_path: when given, the model and tokenizer are saved there with save_pretrained (a
    folder `from_pretrained` and grouprl's model loader accept), and the path stays usable.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = char_tokenizer(chat_template)
    config = tiny_config(arch, vocab_size=len(tokenizer), initializer_range=init_std, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.eval()
    if tmp_path is not None:
        Path(tmp_path).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
    return model, tokenizer


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Prompts of the given lengths made of ordinary (non-special) token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def exact_float64_norms(model):
    """Make every RMSNorm of `model` compute in the model's own dtype, in place; returns model.

    transformers' Llama/Qwen2 RMSNorm casts its input to float32 (a *down*cast for a float64
    model), so gradients that reach the same position along two routes (one shared prompt
    under several responses) are rounded to float32 once instead of twice: the float64 model
    is then only float32-accurate. Tests that compare gradients at ~1e-8 need this.
    """
    import types

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    return model


def reference_log_probs(model, prompt_ids, response_ids, response_mask, temperature: float = 1.0):
    """The obvious per-token log-probs and entropy, row by row, for checking faster code.

    Each row runs model(prompt + its unpadded response) alone; the logits predicting response
    token t (position len(prompt) - 1 + t), divided by `temperature`, go through log_softmax
    and gather, and through grouprl.algorithms.entropy_from_logits. Differentiable.
    prompt_ids: N lists; response_ids, response_mask: [N, R]. -> (log_probs, entropy), both
    [N, R] in float64, 0 at padding.
    """
    from grouprl.algorithms import entropy_from_logits

    rows_lp, rows_ent = [], []
    for i, prompt in enumerate(prompt_ids):
        length = int(response_mask[i].sum())
        response = response_ids[i, :length]
        ids = torch.tensor(list(prompt) + response.tolist(), device=response_ids.device).unsqueeze(0)
        logits = model(input_ids=ids).logits[0].double() / temperature  # [P + r, V]
        predicting = logits[len(prompt) - 1 : len(prompt) - 1 + length]  # [r, V]
        rows_lp.append(torch.log_softmax(predicting, -1).gather(-1, response.unsqueeze(-1)).squeeze(-1))
        rows_ent.append(entropy_from_logits(predicting))
    mask = response_mask.bool()
    zeros = torch.zeros(response_ids.shape, dtype=torch.float64, device=response_ids.device)
    return zeros.masked_scatter(mask, torch.cat(rows_lp)), zeros.masked_scatter(mask, torch.cat(rows_ent))


def saved_activation_bytes(model, run, context) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `run()` executes inside
    `context` (a `with` block), the model's parameters excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


def weighted_loss_and_grads(model, ids, context):
    """Inside `context` (a `with` block yielding a value): that value, a fixed random weighting of
    the model's log-softmax over `ids` summed (detached), and its gradients for the trainable
    parameters (`torch.autograd.grad`)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    with context as yielded:
        logits = model(input_ids=ids).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1), dtype=logits.dtype)
        loss = (logits.log_softmax(-1) * weights).sum()
        grads = torch.autograd.grad(loss, params)
    return yielded, loss.detach(), grads


# The same computation done in another order: another torch thread count, another process, another
# rank layout or another kernel (MKL and oneDNN block their sums by CPU model and thread count;
# torch picks AVX2 or AVX-512 kernels by CPU, ATEN_CPU_CAPABILITY forces one). Two such runs agree
# exactly in what is counted or sampled (token ids, rollouts, versions, uids, dropped groups) and
# only within these in their floats. Tests comparing runs across processes or thread counts use
# them rather than bitwise equality (which held on one Intel CPU and not on an AMD EPYC: issue 36).
# A float32 metric is a sum or mean of O(1) terms: reordered, it moves by some ulps (1.2e-7) of
# each term, which after a few updates on weights that moved by ADAM_NOISE is up to a few 1e-6;
# relative 1e-4 covers the larger ones, absolute 1e-6 the ones near zero (a loss, a KL).
REORDERED = {"rel": 1e-4, "abs": 1e-6}
# Adam divides by the root of small second moments, so reordering noise in a tiny gradient moves
# its weight by a few percent of one step (lr 1e-2): seen up to 1.04e-4 on an Intel Xeon, below
# 1e-4 on an AMD EPYC; the steps are 1e-2.
ADAM_NOISE = 3e-4


def assert_metrics_agree(got: list[dict], want: list[dict], skip: tuple[str, ...] = ("time/", "perf/")) -> None:
    """Two runs' per-step metrics (metrics.jsonl rows) are the same run computed in another
    order: the same steps and keys, counts equal, floats within REORDERED (timings skipped)."""
    import pytest

    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = {k: v for k, v in g.items() if not k.startswith(skip)}
        w = {k: v for k, v in w.items() if not k.startswith(skip)}
        assert g.keys() == w.keys(), (w.get("step"), sorted(g.keys() ^ w.keys()))
        for key, value in w.items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, **REORDERED), (w.get("step"), key, g[key], value)
            else:
                assert g[key] == value, (w.get("step"), key)


def assert_weights_agree(got: dict, want: dict, atol: float = ADAM_NOISE) -> None:
    """Two state dicts from runs of the same updates computed in another order (Adam's noise)."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


class LogProbs(tuple):
    """A generation's log-probs that equal another's within 1e-9: float64 engines (the tests'
    tiny models) in another process compute them on other threads, the same sums in another
    order (a few ulps of numbers of size ~5); rounding both would not be a tolerance (two
    values an ulp apart can round apart)."""

    def __eq__(self, other):
        return len(self) == len(other) and all(abs(a - b) <= 1e-9 for a, b in zip(self, other))

    __hash__ = tuple.__hash__


def generation_rows(generations) -> list[tuple]:
    """Each generation's token ids and finish reason (exactly) and its log-probs (LogProbs)."""
    return [(g.token_ids, g.finish_reason, LogProbs(g.log_probs)) for g in generations]


def free_port() -> int:
    """A port of 127.0.0.1 free right now (for a test's server or a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, *args: str, script: str | None = None) -> list[str]:
    """The command that runs `grouprl *args` (or the Python `script` with those arguments) in one
    process, or in `ranks` processes under torchrun on 127.0.0.1."""
    import sys

    target = [script] if script else ["-m", "grouprl"]
    if ranks == 1:
        return [sys.executable, *target, *args]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", *target, *args,
    ]  # fmt: skip


def train_here(config, *overrides: str) -> dict:
    """`grouprl train config overrides` in this process on one torch thread: the numbers of
    `run_grouprl(1, "train", ...)` without a new interpreter's imports (seconds a run). Returns
    the run's summary."""
    import torch

    from grouprl.config import load_config
    from grouprl.trainer.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return Trainer(load_config(str(config), list(overrides))).fit()
    finally:
        torch.set_num_threads(threads)


def run_grouprl(ranks: int, *args: str, timeout: float = 600, **kwargs):
    """`launch(ranks, *args, **kwargs)` with one torch thread per process; its CompletedProcess,
    asserted successful (the output's end in the message otherwise)."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launch(ranks, *args, **kwargs), env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


ENGINE_KEY = "a-test-key-of-the-engine-service"


def start_engine_service(log, devices: str = "cpu,cpu"):
    """`grouprl engine serve --devices DEVICES` on 127.0.0.1 (any free port, one torch thread an
    engine, GROUPRL_ENGINE_KEY = ENGINE_KEY, the tests' modules importable there); (its address,
    its process). Stop it with SIGTERM."""
    import os
    import re
    import select
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests), str(tests / "rollout"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "GROUPRL_ENGINE_KEY": ENGINE_KEY, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "grouprl", "engine", "serve", "--host", "127.0.0.1", "--port", "0", "--devices", devices]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    found = re.search(r"^engine service on (\S+) \(", line)
    assert found, (line, Path(log).read_text()[-2000:])
    return found.group(1), proc
