"""Several processes training one policy: ranks, group sharding, FSDP2 wrapping.

Launched by `torchrun --nproc-per-node N -m grouprl train cfg.yaml` (or `--nnodes`), every rank
runs the same loop. All ranks draw the same global batch; rank r keeps a contiguous block of
whole groups (a group's n samples never span ranks, so advantages stay exact), generates,
scores and updates on it. The model is sharded with FSDP2 (`fully_shard` per decoder layer, a
VLM's vision layers too, and once at the root); the loss weights are global (see update.py), so
the summed gradient equals the gradient of one process on the whole batch.

Everything the update runs goes through `ShardedRoot.__call__(fn, ...)`, a root module whose forward
calls `fn(model, ...)`, so FSDP's hooks see it while the log-prob code keeps reading the head's
weight itself. Parameters stay sharded between passes: each layer is gathered for its forward
and again for its backward (FSDP2's default), and each pass's backward reduce-scatters its
gradients into the sharded accumulators (`set_gradient_sync`: every k passes, a setting). A
rank's peak in the update is its shards of the weights, gradients and optimizer state, the
root's own weights and a layer or two whole, and the activations (ZeRO-3). The price: every
rank must run the same passes in the same order, whatever its rows, or the collectives get out
of step; `trainer/lockstep.py` pads the ranks to the same pass count with passes of zero
weight. Generation and exports run on gathered weights (`gathered`), as an inference engine
would be given them.

The loop's own collectives (counts, metrics, gathered groups) move CPU tensors and Python
objects, which an NCCL-only group refuses: on CUDA the group is joined as "cpu:gloo,cuda:nccl"
(gloo for CPU tensors, NCCL for the model's), and a group someone else joined for the device
alone (a user's script; Ray Train is asked for both, see launch.py) gets a gloo group of the same
ranks beside it, which `Ranks` uses for everything it reduces, gathers and waits on.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grouprl.errors import UserError


def process_group_backend(device_type: str) -> str:
    """The backend a run on `device_type` joins its ranks with: gloo on a CPU; on CUDA, NCCL for
    device tensors and gloo beside it for CPU ones (the loop's reductions and gathers; FSDP's
    on offloaded shards)."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def serves_cpu(group=None) -> bool:
    """Whether `group` (the default one when None) has a backend for CPU tensors: not so for a
    group joined as "nccl" alone, where a CPU tensor's collective fails."""
    from torch.distributed.distributed_c10d import _get_default_group

    try:  # the look-up every collective makes for its tensors' device type
        (group or _get_default_group())._get_backend(torch.device("cpu"))
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    return True


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this process joined the group (torchrun), not its launcher (Ray)
    # what reduce, gather and barrier go over: None, the default group (it serves CPU tensors),
    # or a gloo group of the same ranks beside a default group that does not
    group: Any = field(default=None, compare=False, repr=False)
    local_world: int = 1  # the ranks on this node

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, device_type: str) -> Ranks:
        """The ranks torchrun (or a Ray worker group) described in the environment; one rank
        when there is none. Joins the process group (`process_group_backend`) unless the
        launcher did; beside a joined group that serves no CPU tensors, makes a gloo one."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group(process_group_backend(device_type))
        # every rank gets here, as new_group (a collective) wants
        group = None if serves_cpu() else dist.new_group(backend="gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or dist.get_world_size())
        return cls(dist.get_rank(), dist.get_world_size(), local, owns, group, per_node)

    def close(self) -> None:
        """Leave the process group once every rank is done (a group left to the interpreter's
        exit can abort a process whose communication threads are still up). A launcher's group
        is the launcher's to leave, and the gloo group beside it goes with it (Ray Train's
        `destroy_process_group()` ends every group)."""
        if self.owns_group and dist.is_initialized():
            dist.barrier(group=self.group)
            dist.destroy_process_group()

    def fork(self) -> Ranks:
        """The same ranks over a gloo group of their own (every rank calls this, in the same
        order): a thread whose collectives must not interleave with the ones on this group (the
        asynchronous rollout's, beside the update's) gathers and reduces over it."""
        if not self.distributed:
            return self
        return Ranks(self.rank, self.world, self.local_rank, False, dist.new_group(backend="gloo"), self.local_world)

    def share(self, num: int, what: str = "data.train_batch_size", block: int = 0) -> list[int]:
        """This rank's items (groups) of `num`: of every `block` of them (a mini-batch), its
        contiguous part; `num` and `block` multiples of the world size."""
        block = block or num
        for size, name in ((num, what), (block, "actor.mini_batch_size")):
            if size % self.world:
                raise UserError(f"{name}={size} must be a multiple of the number of ranks ({self.world})")
        k = block // self.world
        return [start + self.rank * k + i for start in range(0, num, block) for i in range(k)]

    def split(self, num: int) -> range:
        """This rank's block of `num` items, as even as may be (evaluation)."""
        lo, hi = num * self.rank // self.world, num * (self.rank + 1) // self.world
        return range(lo, hi)

    def reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """`values` combined element-wise over the ranks (in float64, on the CPU)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op], group=self.group)
        return t.tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


# metrics whose global value is not the mean of the ranks' values
_SUMMED = ("reward/errors", "batch/dropped_groups")
_MAXED = ("time/", "perf/peak_", "perf/state_")


def reduce_metrics(metrics: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """One value per metric over the ranks: counts summed, times and peaks the slowest rank's,
    maxima/minima as such, the rest (means over equal shares) averaged; every rank must pass the
    same keys (the loop computes the same metrics everywhere)."""
    if not ranks.distributed:
        return {**metrics, "dist/world_size": 1.0}
    keys = sorted(metrics)
    if len(set(map(tuple, ranks.gather(keys)))) != 1:
        raise RuntimeError("ranks report different metrics")
    values = [float(metrics[k]) for k in keys]
    total, most, least = (ranks.reduce(values, op) for op in ("sum", "max", "min"))
    out = {}
    for i, k in enumerate(keys):
        summed_count = k.startswith("reward_model/") and k.endswith(("/items", "/batches", "/busy_s"))
        if k.startswith(_SUMMED) or summed_count or k.startswith("perf/") and k.endswith("tokens_per_s"):
            out[k] = total[i]
        elif k.startswith(_MAXED) or k.endswith("max"):
            out[k] = most[i]
        elif k.endswith("min"):
            out[k] = least[i]
        else:
            out[k] = total[i] / ranks.world
    out["dist/world_size"] = float(ranks.world)
    return out


class ShardedRoot(torch.nn.Module):
    """The root of the sharded model: `policy(fn, *args)` runs `fn(model, *args)` inside the
    root's forward, so FSDP gathers what `fn` touches and reduces its gradients."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.whole = False  # inside `gathered`

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP shards one by one: the classes transformers names as never to be
    split across devices (a VLM's decoder and vision layers), each widened to the layer list's
    entry that holds it alone (Idefics3 names its vision attention: its encoder layer is the
    block, MLP included)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    modules = dict(model.named_modules())
    # (FSDP renames a class it wraps FSDP<name>: the layers of a sharded model are found too)
    found = [n for n, m in modules.items() if type(m).__name__.removeprefix("FSDP") in names]
    lists = [(n, m) for n, m in modules.items() if isinstance(m, torch.nn.ModuleList)]
    entries = {f"{n}.{i}" for n, m in lists for i in range(len(m))}
    blocks: list[str] = []
    for name in found:
        parts = name.split(".")
        entry = next((e for k in range(len(parts), 0, -1) if (e := ".".join(parts[:k])) in entries), None)
        held = [f for f in found if entry is not None and (f == entry or f.startswith(entry + "."))]
        block = entry if len(held) == 1 else name
        if block not in blocks:
            blocks.append(block)
    if not blocks:
        raise UserError(f"cannot find the decoder layers of {type(base).__name__} to shard")
    return [modules[b] for b in blocks]


def device_mesh(ranks: Ranks, device_type: str, shard_size: int = -1):
    """The ranks FSDP shards over: all of them (None: FSDP's default mesh), or groups of
    `shard_size` ranks each holding one sharded copy, replicated across the groups (HSDP)."""
    if shard_size in (-1, ranks.world):
        return None
    if shard_size < 1 or ranks.world % shard_size:
        raise UserError(
            f"actor.fsdp_size={shard_size} must divide the number of ranks ({ranks.world}), or be -1"
        )
    from torch.distributed.device_mesh import init_device_mesh

    shape = (ranks.world // shard_size, shard_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


def shard(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    offload: bool = False,
    mesh=None,
    source=None,
    device: torch.device | None = None,
) -> ShardedRoot:
    """FSDP2 over `model`: each decoder layer, then the root (everything else); over `mesh`
    (`device_mesh`) when given, else over every rank. `source` (sharded loading, `model`'s
    parameters on the meta device): the checkpoint each rank reads its shards' slices from
    (slices.Checkpoint), or rank 0's whole state dict ({} on the others, `fill_from_rank0`);
    each rank's shards are made where they live, so no rank ever holds the whole model."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict = {"mesh": mesh} if mesh is not None else {}
    if param_dtype is not None or reduce_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy()
    # FSDP warns that an in-place change of a view output would skip its pre-backward gather;
    # the outputs that are views (the root's image features, reshaped) are never changed in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    policy = ShardedRoot(model)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(policy, **options)
    if source is not None:
        load_into(model, source, device)
    init_root(policy)
    return policy


def init_root(policy: ShardedRoot) -> None:
    """Make `policy` FSDP's root before any layer runs a forward of its own (a layer whose forward
    came first would take itself for the root). FSDP settles the root lazily, at the first forward
    through it, which also gathers the root's own weights (embeddings, head, norms) whole and the
    all-gather's buffer beside them, twice their size, only to give them back: at start-up that was
    each rank's peak (0.49 GiB a rank of a 331M Llama with a 32,000 x 2048 embedding, over its 0.62
    GiB of shards on 2 ranks). FSDP's own lazy initialisation sets up the same state without the
    gather; where this torch lacks it, the first forward it is, its weights given back after."""
    lazy_init = fsdp_lazy_init(policy)
    if lazy_init is not None:
        lazy_init()
        return
    with torch.no_grad():
        policy(lambda model: None)
    policy.reshard()  # the root keeps its weights whole after a forward: the optimizer takes shards


def fsdp_lazy_init(policy: ShardedRoot):
    """FSDP's lazy initialisation of `policy`'s state (torch 2.4-2.13 have it), None without it."""
    state = getattr(policy, "_get_fsdp_state", None)
    return getattr(state(), "_lazy_init", None) if state is not None else None


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Storage for a model whose parameters are on the meta device (FSDP's shards, or whole
    tensors), on `device` (FSDP moves a shard it offloads to pinned host memory itself), tied
    weights tied again; buffers built with the model (rotary tables) kept as they were."""
    if not any(p.is_meta for p in model.parameters()):
        return
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    shared: dict[int, list[tuple[torch.nn.Module, str]]] = {}  # tied weights (embeddings and head)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                shared.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)  # storage for the parameters (and buffers, put back below)
    for places in shared.values():  # to_empty gives each holder a tensor of its own: tie them again
        first = getattr(*places[0])
        for module, name in places[1:]:
            module._parameters[name] = first
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def fill_from_rank0(model: torch.nn.Module, source: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give `model` (sharded or whole; on ranks other than 0 its parameters on the meta device)
    the weights of rank 0's state dict `source`, broadcast a tensor at a time over `device` (the
    ranks' compute device, where the group communicates, wherever a shard lives); each rank
    keeps its shard (DTensor parameters) or the whole tensor (plain ones). Buffers built on each
    rank (rotary tables) are kept as they were. The way for checkpoints that cannot be read in
    slices (slices.py): a whole host copy on rank 0, every tensor crossing the network."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    materialize(model, device)
    # a tensor at a time: rank 0's whole tensor broadcast to every rank's device, each rank
    # copying its own part into its parameter (set_model_state_dict would hold every new shard
    # until its end, a second copy of the model's shards)
    main = dist.get_rank() == 0
    with torch.no_grad():
        for name, held in model.state_dict(keep_vars=True).items():
            if not isinstance(held, torch.Tensor):
                continue
            local = held.to_local() if isinstance(held, DTensor) else held
            whole = torch.empty(held.shape, dtype=held.dtype, device=device)
            if main:
                whole.copy_(source[name])
            dist.broadcast(whole, src=0)
            if isinstance(held, DTensor):  # this rank's part, computed here (no more communication)
                whole = distribute_tensor(whole, held.device_mesh, held.placements, src_data_rank=None).to_local()
            local.copy_(whole)
            del whole


def load_into(model: torch.nn.Module, source, device: torch.device) -> None:
    """`model`'s weights from `source`: a checkpoint read in slices (slices.Checkpoint), or rank
    0's whole state dict ({} on the other ranks: `fill_from_rank0`)."""
    if isinstance(source, dict):
        fill_from_rank0(model, source, device)
    else:
        source.fill(model, device)


def run(model, fn, *args, **kwargs):
    """`fn(model, *args)`, through the FSDP root when `model` is a sharded `ShardedRoot`."""
    if isinstance(model, ShardedRoot):
        return model(fn, *args, **kwargs)
    return fn(model, *args, **kwargs)


def inner(model) -> torch.nn.Module:
    """The Hugging Face model (inside a `ShardedRoot`, or itself)."""
    return model.model if isinstance(model, ShardedRoot) else model


def _fsdp_modules(policy: ShardedRoot) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in policy.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model) -> Iterator[None]:
    """Within the block every parameter of a sharded policy is whole on every rank (and stays
    so through forward passes): generation and exports run on the plain model."""
    if not isinstance(model, ShardedRoot) or model.whole:  # not sharded, or gathered already
        yield
        return
    modules = _fsdp_modules(model)
    layers = [m for m in modules if m is not model]  # the root's own forward is not called here
    model.whole = True
    for m in modules:
        m.unshard()
    for m in layers:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        model.whole = False
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)
        for m in modules:
            m.reshard()


def set_gradient_sync(model, sync: bool) -> None:
    """Whether the backward passes that follow reduce-scatter a sharded policy's gradients into
    its shards (True: FSDP's default) or keep accumulating them whole, unreduced, until a pass
    that does (actor.fsdp_reduce_every > 1: less communication, whole gradients held)."""
    if isinstance(model, ShardedRoot):
        model.set_requires_gradient_sync(sync, recurse=True)


def reshard_root(model) -> None:
    """Give back a sharded policy's root weights (embeddings, head, norms: FSDP keeps the
    root's whole after a forward for the backward that follows) after passes without one."""
    if isinstance(model, ShardedRoot):
        model.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or gradient gathered whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def whole_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with sharded tensors gathered whole on CPU (every rank must call
    this); tied weights stay one tensor."""
    whole: dict = {}
    out = {}
    for name, value in model.state_dict().items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's view is new
        key = (local.data_ptr(), local.shape, local.dtype) if local.numel() else id(value)
        if key not in whole:
            whole[key] = full_tensor(value).detach().cpu()
        out[name] = whole[key]
    return out


def state_gb(model: torch.nn.Module, optimizer) -> float:
    """GB this rank holds of the model's weights and the optimizer's state (its shards, when
    sharded), counted once each."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        # a tensor parked in host memory (offload.py) has no storage here but still counts
        key = local.data_ptr() if local.untyped_storage().nbytes() else id(local)
        if local.numel() and key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total / 1024**3
