"""A policy's weights written as a Hugging Face checkpoint, a tensor at a time.

`write_weights` goes through the model one FSDP module at a time (the root's own weights, then
each layer: `units`): a sharded module's weights are gathered whole (every rank takes part), the
rank that writes adds each LoRA delta into its base weight, casts to the model's published dtype,
copies the tensor to host memory and writes it straight into its file; the others drop what they
gathered. The files are safetensors written as a stream (`SafetensorsStream`): the names, dtypes
and shapes are known before the first byte (from the parameters' metadata), so each file's header
goes first and every tensor follows as it comes. Host memory: one tensor and the file's buffer.
Names are the checkpoint's own, as save_pretrained writes them (transformers' conversion table
reversed, e.g. a VLM's `model.language_model.` prefix taken out).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from grouprl.trainer.slices import SAFETENSORS_DTYPES

DTYPES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
MAX_FILE_BYTES = 5 * 1024**3  # as save_pretrained shards: files of at most this many bytes



class SafetensorsStream:
    """Safetensors files written in order: `plan` (name, dtype, shape) fixes every file's header
    before any tensor, then `write(name, tensor)` appends the tensors in that order."""

    def __init__(self, folder: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int = MAX_FILE_BYTES):
        files: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = [[]]
        size = 0
        for name, dtype, shape in plan:
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if files[-1] and size + nbytes > max_bytes:
                files.append([])
                size = 0
            files[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        count = len(files)
        self.names = [
            "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)
        ]
        self.folder, self.files = Path(folder), files
        self.order = [(i, name) for i, entries in enumerate(files) for name, *_ in entries]
        self.next, self.handle, self.total = 0, None, sum(e[3] for f in files for e in f)

    def _open(self, index: int) -> None:
        if self.handle is not None:
            self.handle.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape, nbytes in self.files[index]:
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.handle = open(self.folder / self.names[index], "wb")  # noqa: SIM115 - closed by the next file or close()
        self.handle.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, expected = self.order[self.next]
        if name != expected:
            raise RuntimeError(f"weights out of order: {name} where {expected} was planned")
        if self.next == 0 or self.order[self.next - 1][0] != index:
            self._open(index)
        data = tensor.detach().contiguous().cpu()
        self.handle.write(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise RuntimeError(f"{len(self.order) - self.next} planned weights were never written")
        if self.handle is not None:
            self.handle.close()
        if len(self.names) > 1:
            weight_map = {name: self.names[i] for i, name in self.order}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def units(base: torch.nn.Module) -> list[list[str]]:
    """`base`'s parameter names (tied weights once, LoRA adapters with their layer) by the FSDP
    module that holds them: the root's own first, then each layer, in order (every rank alike)."""
    from torch.distributed.fsdp import FSDPModule

    layers = [n for n, m in base.named_modules() if isinstance(m, FSDPModule) and n]
    owned: dict[str, list[str]] = {"": [], **{n: [] for n in layers}}
    for name, _ in base.named_parameters():
        parts = name.split(".")
        owner = next((p for k in range(len(parts) - 1, 0, -1) if (p := ".".join(parts[:k])) in owned), "")
        owned[owner].append(name)
    return [names for names in owned.values() if names]


def checkpoint_names(base: torch.nn.Module, names: list[str]) -> dict[str, str]:
    """{the model's name of a weight: the checkpoint's}, as save_pretrained renames them."""
    from transformers.core_model_loading import revert_weight_conversion

    metas = {name: torch.empty(0, device="meta") for name in names}
    reverted = revert_weight_conversion(base, dict(metas))
    of = {id(t): name for name, t in metas.items()}
    out = {of[id(t)]: key for key, t in reverted.items() if id(t) in of}
    if len(out) != len(names):  # a converter fuses or splits tensors: no rename alone
        raise RuntimeError(f"{type(base).__name__}: its checkpoint names are not renames of its weights")
    return out


def lora_delta(module, whole: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """The summed delta (scale * B @ A, peft's merge) of a LoRA layer's active adapters, from the
    whole adapter tensors in `whole` (names under `prefix`); None for another module."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer) or module.merged:
        return None
    delta = None
    for adapter in module.active_adapters:
        if adapter in module.lora_A:
            a, b = whole[f"{prefix}.lora_A.{adapter}.weight"], whole[f"{prefix}.lora_B.{adapter}.weight"]
            part = b.float() @ a.float()
            part = part.T if module.fan_in_fan_out else part
        elif adapter in getattr(module, "lora_embedding_A", {}):
            a, b = whole[f"{prefix}.lora_embedding_A.{adapter}"], whole[f"{prefix}.lora_embedding_B.{adapter}"]
            part = (b.float() @ a.float()).T
        else:
            continue
        part = part * module.scaling[adapter]
        delta = part if delta is None else delta + part
    return delta


def write_weights(base, dtype: torch.dtype, folder: Path | None) -> None:
    """The weights of `base` (the Hugging Face model inside the policy; a sharded policy's
    gathered one module at a time; LoRA merged) into `folder` in `dtype` (its published one);
    every rank of a sharded policy calls this, and the one with a `folder` (None elsewhere) writes."""
    from grouprl.trainer.parallel import full_tensor

    params = dict(base.named_parameters())
    modules = dict(base.named_modules())
    plain = lambda name: name.replace(".base_layer.", ".")  # noqa: E731 - LoRA's wrapper out
    groups = units(base)
    kept = [n for unit in groups for n in unit if ".lora_" not in n]  # in the order they are written
    stream = None
    if folder is not None:
        names = checkpoint_names(base, [plain(n) for n in kept])
        cast = lambda t: dtype if t.is_floating_point() else t.dtype  # noqa: E731
        stream = SafetensorsStream(folder, [(names[plain(n)], cast(params[n]), tuple(params[n].shape)) for n in kept])
    with torch.no_grad():
        for unit in groups:
            whole = {n: full_tensor(params[n].detach()) for n in unit}  # every rank gathers
            if stream is None:
                del whole
                continue
            for name in unit:
                if ".lora_" in name:
                    continue
                tensor = whole.pop(name)
                if name.endswith(".base_layer.weight"):
                    prefix = name.removesuffix(".base_layer.weight")
                    delta = lora_delta(modules.get(prefix), whole, prefix)
                    tensor = tensor.float() + delta if delta is not None else tensor
                stream.write(names[plain(name)], tensor.to(dtype) if tensor.is_floating_point() else tensor)
                del tensor
            del whole
    if stream is not None:
        stream.close()
