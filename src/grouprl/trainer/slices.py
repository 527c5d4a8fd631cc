"""Each rank reads its own slices of the checkpoint: loading a policy sharded over ranks.

Every rank builds the model with its parameters on the meta device, FSDP shards it (still on
meta), and each rank then reads from the model's safetensors files only the part of each tensor
its shard holds (a byte range: FSDP shards the first dimension), straight into the shard where it
lives (host memory read into directly; the device, or pinned host memory under FSDP's offload,
through a buffer of that range). No rank holds a whole copy of the model in
host memory and nothing is broadcast; a whole copy (the generation copy of asynchronous runs)
reads whole tensors the same way, one at a time.

The checkpoint's names become the model's through transformers' own conversion table (the
renames `from_pretrained` applies, e.g. a VLM's `model.language_model.` prefix); a tensor that
transformers would build from several of the file's (fused or split weights) has no slice of its
own, and such a model, like one whose weights are not safetensors (pytorch_model.bin), loads the
old way (`fill_from_rank0`): rank 0 reads the whole model into host memory and broadcasts it a
tensor at a time, which costs a whole host copy on rank 0 and every tensor crossing the network.
A LoRA policy's adapters are in no checkpoint: every rank makes them from the run's seed
(`adapter_init`), as one process does, so they too need no broadcast.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def safetensors_files(model_path: str) -> dict[str, Path] | None:
    """{checkpoint key: its file} of the safetensors files at `model_path` (a folder, or a hub id
    in the local cache); None when the weights are not safetensors."""
    folder = Path(model_path)
    if not folder.is_dir():
        folder = _cached_folder(model_path)
        if folder is None:
            return None
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    if (folder / SINGLE).is_file():
        single = SafetensorsFile(folder / SINGLE)
        single.close()
        return {key: folder / SINGLE for key in single.header if key != "__metadata__"}
    return None


def _cached_folder(model_id: str) -> Path | None:
    """The local folder of a hub model's safetensors (fetched by transformers, as from_pretrained
    would); None when it has none."""
    from transformers.utils import cached_file

    for name in (INDEX, SINGLE):
        try:
            found = cached_file(model_id, name, _raise_exceptions_for_missing_entries=False)
        except Exception:  # noqa: BLE001 - no such file on the hub or in the cache: not safetensors
            found = None
        if found:
            if name == INDEX:  # every shard the index names, fetched beside it
                for shard in sorted(set(json.loads(Path(found).read_text())["weight_map"].values())):
                    cached_file(model_id, shard)
            return Path(found).parent
    return None


def _base(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def base_name(name: str) -> str:
    """A policy's parameter name as the base model knows it (peft's wrapper and LoRA's
    `base_layer` taken out)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def checkpoint_names(model: torch.nn.Module, keys) -> dict[str, str] | None:
    """{base model's name: checkpoint key} for the checkpoint's `keys`, through transformers'
    conversion table as `from_pretrained` applies it; None when some tensor needs more than a
    rename (a converter that fuses or splits tensors)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    base = _base(model)
    mapping = get_model_conversion_mapping(base)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = {base_name(k): v for k, v in base.state_dict().items() if adapter_kind(k) is None}  # LoRA's wrappers out
    prefix = base.base_model_prefix
    names: dict[str, str] = {}
    for key in sorted(keys):
        renamed, converted = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed, converted = rename_source_key(key, [], [], prefix, meta)
        if renamed in meta:
            if converted is not None:
                return None
            names[renamed] = key
    return names


ADAPTER_INIT = {
    # peft's default (init_lora_weights=True): A as nn.Linear's own init, B zeros (the update
    # starts from the base model); embeddings the other way round
    "lora_A": lambda t, g: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g),
    "lora_B": lambda t, g: torch.nn.init.zeros_(t),
    "lora_embedding_A": lambda t, g: torch.nn.init.zeros_(t),
    "lora_embedding_B": lambda t, g: torch.nn.init.normal_(t, generator=g),
}


def adapter_kind(name: str) -> str | None:
    """Which adapter tensor `name` is (a key of ADAPTER_INIT), None for another weight."""
    parts = name.split(".")
    return next((p for p in parts if p in ADAPTER_INIT), None)


def adapter_init(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every LoRA adapter tensor of `model`, whole and on the CPU, as peft's default initialises
    them, drawn in parameter order from a generator of `seed`: every rank and one process make
    the same ones, whatever they did with the global generator before."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        kind = adapter_kind(name)
        if kind is not None:
            out[name] = ADAPTER_INIT[kind](torch.empty(p.shape, dtype=torch.float32), g)
    return out


def seed_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give a LoRA policy's adapters `adapter_init`'s values (in place)."""
    values = adapter_init(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in values:
                p.copy_(values[name])


class Checkpoint:
    """A policy's safetensors files, addressed by its own parameter names."""

    def __init__(self, files: dict[str, Path], names: dict[str, str], seed: int):
        self.files, self.names, self.seed = files, names, seed
        self.read_bytes = 0  # what the fills so far read from the files

    @classmethod
    def of(cls, model: torch.nn.Module, model_path: str, seed: int) -> Checkpoint | None:
        """The checkpoint of `model` (built, on the meta device, from `model_path`) if every
        weight can be read in slices; None otherwise (the reason logged)."""
        files = safetensors_files(model_path)
        if files is None:
            log.info("model.path %s holds no safetensors: rank 0 reads it whole and broadcasts it", model_path)
            return None
        names = checkpoint_names(model, files)
        if names is None:
            log.info("%s: some weights are converted on loading: rank 0 reads them whole and broadcasts them", model_path)
            return None
        missing = [
            n for n, _ in model.named_parameters() if adapter_kind(n) is None and base_name(n) not in names
        ]
        unknown = [n for n, _ in model.named_parameters() if "lora_" in n and adapter_kind(n) is None]
        if missing or unknown:
            log.info("%s: %s not in its files: rank 0 reads it whole and broadcasts it", model_path, (missing + unknown)[0])
            return None
        return cls(files, names, seed)

    def fill(self, model: torch.nn.Module, device: torch.device) -> None:
        """`model`'s parameters (on the meta device; FSDP's shards or whole tensors) and the
        persistent buffers the files hold, read from the files: each shard its own slice, read
        (not mapped: the resident set holds what is copied, not the file's pages) into the
        shard where it lives, converted to its dtype on the way. Buffers the files do not hold
        stay as built (rotary tables)."""
        from grouprl.trainer.parallel import materialize

        materialize(model, device)
        adapters = adapter_init(model, self.seed) if any(adapter_kind(n) for n, _ in model.named_parameters()) else {}
        files: dict[Path, SafetensorsFile] = {}
        done: set[int] = set()
        try:
            with torch.no_grad():
                for name, held in model.state_dict(keep_vars=True).items():
                    if not isinstance(held, torch.Tensor) or id(held) in done:
                        continue
                    done.add(id(held))  # tied weights: one tensor under two names
                    local, index = _local_part(held)
                    if local.numel() == 0:
                        continue
                    if name in adapters:
                        local.copy_(adapters[name][index])
                        continue
                    key = self.names.get(base_name(name))
                    if key is None:  # a buffer the files do not hold
                        continue
                    path = self.files[key]
                    if path not in files:
                        files[path] = SafetensorsFile(path)
                    self.read_bytes += files[path].read_into(key, index, local)
        finally:
            for f in files.values():
                f.close()


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    """One safetensors file read by byte ranges: a tensor's rows (its first dimension's slice,
    the way FSDP shards) are one contiguous range, read straight into the destination when it
    is host memory of the file's dtype, else through a buffer of that range alone."""

    def __init__(self, path: Path):
        self.handle = open(path, "rb")  # noqa: SIM115 - closed by close()
        size = int.from_bytes(self.handle.read(8), "little")
        self.header = json.loads(self.handle.read(size))
        self.start = 8 + size

    def read_into(self, key: str, index: tuple[slice, ...], out: torch.Tensor) -> int:
        """Rows `index` of tensor `key` (whole in every other dimension) into `out`; the bytes read."""
        entry = self.header[key]
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        rows = index[0] if index else slice(0, 1)
        if any((s.start, s.stop) != (0, n) for s, n in zip(index[1:], shape[1:])):
            raise ValueError(f"{key}: only slices of the first dimension are read, not {index}")
        row_bytes = math.prod(shape[1:]) * torch.empty(0, dtype=dtype).element_size()
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        buffer = out if direct else torch.empty(out.shape, dtype=dtype)
        self.handle.seek(self.start + entry["data_offsets"][0] + rows.start * row_bytes)
        view = memoryview(buffer.view(torch.uint8).numpy()).cast("B") if buffer.numel() else memoryview(b"")
        if self.handle.readinto(view) != view.nbytes:
            raise ValueError(f"{key}: the file ends before the tensor does")
        if not direct:
            out.copy_(buffer)
        return view.nbytes

    def close(self) -> None:
        self.handle.close()


def _local_part(held: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank holds of `held`, where it sits in the whole one): a DTensor's local
    shard and its offsets, a plain tensor whole."""
    if hasattr(held, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(held.shape, held.device_mesh, held.placements)
        return held.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return held, tuple(slice(0, s) for s in held.shape)
