"""The update phase's activations: the micro-batch one rank runs (from its share of the batch,
its prompts at their longest, its responses at their limit) and what a pass over it holds.

Counted per pass, in bytes (`compute` = the compute dtype's size, `stream` = the residual
stream's; `kv` = key/value heads x head size, `q` = query heads x head size):
- what autograd keeps per token and decoder layer (`activation_bytes_per_token`, held against
  autograd's saved tensors in the tests), over the pass's tokens: each distinct prompt once
  where the shared prefix runs a group's prompt once, plus every response at its limit; with
  gradient checkpointing each layer's input and one layer's worth;
- on CUDA, transformers' `sdpa` repeats keys and values to the query heads when it is given a
  mask (always here: padding, the shared prefix's block masks), and keeps the repeated ones:
  2 x (q - kv) x compute more per token and layer (a CPU's `lean_attention` keeps them unrepeated);
- the shared prefix: the response pass attends to its prompt's keys and values, copied for
  each packed row of responses (`bins`) for every layer up front (the cache holds them through
  the pass) and kept by each layer's attention (CPU: joined to the responses' own; CUDA:
  repeated to the query heads);
- 4-D attention masks: the response pass's [bins, width, prompt + width] (bool, held through
  the pass) and its floating copy in the compute dtype (one per forward under CPU's
  `lean_attention`; one per layer elsewhere, since torch converts a boolean mask in every layer
  and keeps it for backward); the prompts' own [prompts, prompt, prompt] where they are padded;
  without the shared prefix, the whole rows' [rows, length, length];
- the backward of the layer being differentiated (recomputed first under checkpointing): the
  gradients flowing through it (`backward_bytes_per_token`, measured) and those of the prompt's
  keys and values it attended to;
- the LM head's chunk of float32 logits (and their softmax and gradient) and the hidden states
  at the response positions with their gradient;
- the shared prefix's key/value gradients of every layer, which wait for the prompts' backward
  once the responses' has run (beyond what that backward frees by then).
"""

from __future__ import annotations

from dataclasses import dataclass

from grouprl.trainer.memory.inputs import GIB, Shape


def backward_bytes_per_token(shape: Shape, *, stream: int, compute: int, lean: bool) -> int:
    """What the backward of one decoder layer holds per token beyond the activations it frees
    meanwhile (measured: the resident set's peak over a forward and backward of Llama layers
    whose large blocks are mmapped, h 1024, i 2816, 2,048-4,096 tokens): the gradients flowing
    through it, (2 h + i) in the residual stream's dtype (float32 18.4 KB a token measured
    against 19.5 counted; bf16 autocast 16.3 against 19.5); with a CPU's lean layers also what
    they recompute and its gradient, (h + 3 i) in the compute dtype (float32 59.1 KB against
    57.3, bf16 33.0 against 38.4)."""
    h, i = shape.hidden, shape.intermediate
    return (2 * h + i) * stream + ((h + 3 * i) * compute if lean else 0)


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch one rank runs at its largest: `rows` responses of `response_len` tokens
    continuing `prompts` distinct prompts of `prompt_len` (the shared prefix: each prompt once),
    the responses packed into `bins` rows of `width` tokens."""

    rows: int
    prompts: int
    prompt_len: int
    response_len: int
    shared: bool
    bins: int
    width: int

    @property
    def tokens(self) -> int:
        """Tokens the pass runs through the decoder."""
        if self.shared:
            return self.prompts * self.prompt_len + self.bins * self.width
        return self.rows * (self.prompt_len + self.response_len)

    @property
    def response_tokens(self) -> int:
        return self.rows * self.response_len


def micro_batch(
    cfg, world: int, context: int, longest_prompt: int | None = None, pack_tokens: int | None = None
) -> MicroBatch:
    """The largest micro-batch a rank runs: its share of a mini-batch's groups (the largest
    share), cut as `trainer/micro_batches.py` cuts it (whole groups while they fit a token
    budget, else a group's rows over several), the prompts at the longest the data holds (images
    counted; the limit when the data is not read), the responses at their limit (`context`
    less the prompt limit)."""
    if pack_tokens is None:
        from grouprl.trainer.logprobs import PACK_TOKENS as pack_tokens
    a, n = cfg.actor, cfg.rollout.n_agent
    limit = cfg.data.max_prompt_length
    prompt = min(longest_prompt, limit) if longest_prompt else limit
    response = max(context - limit, 1)
    groups = max(1, -(-(a.mini_batch_size or cfg.data.train_batch_size) // max(world, 1)))
    shared = a.shared_prefix and n > 1
    if a.micro_batch_tokens:
        budget = max(a.micro_batch_tokens, prompt + response)
        if shared and prompt + n * response <= budget:
            prompts = min(groups, budget // (prompt + n * response))
            rows = prompts * n
        elif shared:
            prompts, rows = 1, max(1, min(n, (budget - prompt) // response))
        else:
            rows = max(1, min(groups * n, budget // (prompt + response)))
            prompts = rows
    else:
        rows = min(a.micro_batch_size, groups * n)
        prompts = -(-rows // n) if shared else rows
    if not shared:
        return MicroBatch(rows, prompts, prompt, response, False, rows, prompt + response)
    capacity = max(pack_tokens, response) if pack_tokens else response  # logprobs._pack's bins
    per_bin = max(1, capacity // response)
    per_prompt = -(-rows // prompts)
    bins = prompts * -(-per_prompt // per_bin)
    return MicroBatch(rows, prompts, prompt, response, True, bins, min(per_bin, per_prompt) * response)


def activation_bytes_per_token(shape: Shape, *, param_bytes: int, compute_bytes: int, lean: bool) -> int:
    """What autograd keeps for backward per token and decoder layer (no checkpointing), with
    attention by a fused kernel (flash / memory-efficient SDPA: no [T, T] scores kept), counted
    off transformers' Llama/Qwen2 layers (tests/trainer/test_memory.py holds the count against
    autograd's saved tensors). In elements of hidden size h, intermediate size i and key/value
    width kv:
    - float32 throughout: 8 h (each norm's input, normalised input and output, the queries, the
      attention's output), 4 i (gate, up, activation, product), 2 kv (keys, values);
    - bf16 autocast over float32 weights: the norms' input and normalised input stay float32
      (4 h), and 7 h in bf16: the first norm's output cast once for each of q, k, v, the second's
      once for each of gate and up, the queries and the attention's output; 4 i and 2 kv in bf16;
    - bf16 weights (model.dtype, or FSDP's gathered mixed precision): 2 h float32 inside the norms,
      6 h, 4 i and 2 kv in bf16.
    `lean` (a CPU's actor.lean_norm and lean_mlp) recomputes the normalised inputs (2 h float32)
    and the MLP's activation and product (2 i)."""
    h, i = shape.hidden, shape.intermediate
    kv = shape.kv_heads * shape.head_dim
    if param_bytes == 4 and compute_bytes == 4:
        total = 4 * (8 * h + 4 * i + 2 * kv)
    elif param_bytes == 4:
        total = 4 * 4 * h + compute_bytes * (7 * h + 4 * i + 2 * kv)
    else:
        total = 4 * 2 * h + param_bytes * (6 * h + 4 * i + 2 * kv)
    if lean:
        total -= 4 * 2 * h + compute_bytes * 2 * i
    return total


@dataclass(frozen=True)
class PassSettings:
    """How a pass computes: the residual stream's and the compute dtype's bytes, gradient
    checkpointing, a CPU's lean layers (norms and MLPs recomputed) and attention (keys unrepeated,
    one floating mask per forward), and whether it runs on CUDA (keys repeated under a mask)."""

    stream: int
    compute: int
    checkpointing: bool
    lean_layers: bool
    lean_attention: bool
    logits_chunk: int


def activation_parts(shape: Shape, mb: MicroBatch, s: PassSettings, heads: bool = True) -> dict[str, float]:
    """GiB of one pass over `mb` at its backward's start, by part (see the module docstring).
    `heads=False`: where the responses' backward has ended (`mb` its prompts alone): no LM head,
    every layer's prompt key/value gradients waiting."""
    h, layers, c = shape.hidden, shape.layers, s.compute
    kv, q = shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim
    attended = kv if s.lean_attention else q  # the width attention keeps keys and values at
    per_token = activation_bytes_per_token(shape, param_bytes=s.stream, compute_bytes=c, lean=s.lean_layers)
    per_token += 2 * (attended - kv) * c
    tokens, prompt = mb.tokens, mb.prompt_len
    parts: dict[str, float] = {}
    if s.checkpointing:  # each layer's input, and one layer's activations while it is recomputed
        parts["activations (layer inputs, checkpointed)"] = tokens * layers * h * s.stream / GIB
        parts["activations (the recomputed layer)"] = tokens * per_token / GIB
    else:
        parts["activations"] = tokens * layers * per_token / GIB
    saving_layers = 1 if s.checkpointing else layers
    if mb.shared:
        copies = layers * 2 * mb.bins * prompt * kv * c  # the cache's copies for the packed rows
        kept = saving_layers * 2 * mb.bins * prompt * attended * c  # what attention keeps of them
        if s.checkpointing:  # the prompts' keys and values, outputs of the checkpointed prefix pass
            kept += layers * 2 * mb.prompts * prompt * kv * c
        parts["prompt keys and values (shared prefix)"] = (copies + kept) / GIB
        masks = [(mb.bins * mb.width * (prompt + mb.width), True)]
        if mb.prompts > 1:  # prompts of different lengths are left-padded: a mask of their own
            masks.append((mb.prompts * prompt * prompt, False))
    else:
        length = mb.prompt_len + mb.response_len
        masks = [(mb.rows * length * length, True)]
    floats = 1 if s.lean_attention else saving_layers
    parts["attention masks (4-D)"] = sum(elems * (1 + floats * c) for elems, _ in masks) / GIB
    scratch = tokens * backward_bytes_per_token(shape, stream=s.stream, compute=c, lean=s.lean_layers)
    if mb.shared:  # and the gradients of the prompt's keys and values each packed row attended to
        scratch += 2 * mb.bins * prompt * attended * c
    parts["backward of one layer"] = scratch / GIB
    if heads:
        chunk = min(s.logits_chunk or mb.response_tokens, mb.response_tokens)
        parts["LM head chunk"] = (chunk * shape.vocab * 4 * 3 + mb.response_tokens * h * s.stream * 2) / GIB
    if mb.shared:  # every layer's prompt key/value gradients wait for the prompts' backward
        waiting = layers * 2 * mb.prompts * prompt * kv * c
        freed = mb.bins * mb.width * (layers * per_token if not s.checkpointing else layers * h * s.stream)
        if not heads or waiting > freed:
            parts["prompt key/value gradients (shared prefix)"] = (waiting - (freed if heads else 0)) / GIB
    return {k: v for k, v in parts.items() if v > 0}


def longest(prompts) -> int | None:
    """The longest of encoded prompts (token ids, images expanded), None for none."""
    lengths = [len(p) for p in prompts if p]
    return max(lengths) if lengths else None
