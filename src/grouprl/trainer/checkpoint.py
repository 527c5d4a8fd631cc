"""Atomic, verified, resumable checkpoints.

<run>/checkpoints/step_<N>/ is written in a temp folder and renamed once complete; the file
`latest` names the newest complete one. A checkpoint holds the trainable weights
(safetensors; LoRA adapters only when LoRA is on), optimizer and scheduler state, and the
trainer state (step, sampler position, RNG states, evaluation history), so a resumed run draws
the same next batches as an uninterrupted one.

Loading executes nothing from the folder: the trainer state is JSON with its tensors (RNG
states) in safetensors, the optimizer state is read with `torch.load(weights_only=True)`.
`manifest.json`, written last, lists every file with its size and SHA-256; a checkpoint whose
files do not match it is skipped (with a warning naming what is wrong) in favour of the newest
one that does.

With several ranks (FSDP2) nothing is gathered: the weights, the reference weights and the
sharded optimizer state go through `torch.distributed.checkpoint` (DCP) into `sharded/`, one
safetensors file per rank with its shard offsets in the file's header (DCP's Hugging Face
storage, no pickled metadata). DCP reads the shards back into any other sharding, so a run
saved on N ranks resumes on M (one process included); a one-process checkpoint holds whole
tensors and resumes on any number of ranks too. Several nodes need a shared run folder.

A writer killed mid-write (kill -9, a lost node) leaves its temp folder behind, as large as a
checkpoint; `CheckpointManager.sweep` removes those of this run (and of its exports) when the
next run starts, by their exact naming. A step saved again (an interrupt after a save) moves
the old folder aside by a rename rather than removing it first, so a kill leaves the step
missing for an instant only, not for the length of a removal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grouprl.errors import UserError
from grouprl.trainer.export import RANDOM_PART, stale_temp_folders
from grouprl.trainer.parallel import full_tensor, inner

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 2
SHARDED = "sharded"  # DCP folder of a checkpoint written by several ranks
_SHARD_MARK = "__sharded__"  # in optim.pt: this state tensor lives in sharded/ (value: its dtype)
# save()'s temp folders: ".tmp-step_<N>" then mkdtemp's part (one process), or alone (several
# ranks: one name every rank knows)
_TEMP = re.compile(rf"\.tmp-step_(\d+)(?:-{RANDOM_PART})?")


def _temp_name(step: int) -> str:
    return f".tmp-step_{step}"


def _bytes(folder: Path) -> int:
    return sum(f.lstat().st_size for f in folder.rglob("*") if not f.is_dir() or f.is_symlink())


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def is_sharded(model) -> bool:
    """Whether the model's parameters are DTensor shards (FSDP2 over several ranks)."""
    return any(hasattr(p, "device_mesh") for p in inner(model).parameters())


def trainable_state(model) -> dict[str, torch.Tensor]:
    """Trainable parameters by name (tied weights appear once), whole: sharded ones are gathered
    (every rank must call this)."""
    return {
        n: full_tensor(p.detach()).contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad
    }


def load_trainable_state(model, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise UserError(
            f"checkpoint does not match the model: {len(missing)} unknown tensors, e.g. {missing[0]}"
        )
    with torch.no_grad():
        for name, value in state.items():
            param = params[name]
            value = value.to(param.device, param.dtype)
            if hasattr(param, "device_mesh"):  # a sharded parameter takes its own shard
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)


def optimizer_state(model, optimizer, whole: bool = True) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, so a checkpoint resumes on any number of
    ranks: whole (sharded state gathered from the ranks; every rank must call this), or with
    `whole=False` sharded tensors left as they are (DTensors, for DCP)."""
    names = {id(p): n for n, p in inner(model).named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()

    def whole_or_shard(v):
        if not isinstance(v, torch.Tensor) or (not whole and hasattr(v, "device_mesh")):
            return v
        return full_tensor(v).detach().cpu()

    return {
        "state": {
            order[i]: {k: whole_or_shard(v) for k, v in state.items()} for i, state in saved["state"].items()
        },
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]],
    }


def load_optimizer_state(model, optimizer, saved: dict[str, Any]) -> None:
    params = dict(inner(model).named_parameters())
    order = [n for group in optimizer.param_groups for n in _names_of(group["params"], params)]
    index = {n: i for i, n in enumerate(order)}
    missing = [n for n in saved["state"] if n not in index]
    if missing:
        raise UserError(f"checkpoint's optimizer state does not match the model: e.g. {missing[0]}")

    def local(name, v):  # a sharded parameter's state takes its own shard
        p = params[name]
        whole = isinstance(v, torch.Tensor) and not hasattr(v, "device_mesh")
        if whole and hasattr(p, "device_mesh") and v.shape == p.shape:
            from torch.distributed.tensor import distribute_tensor

            return distribute_tensor(v.to(p.device, p.dtype), p.device_mesh, p.placements)
        return v

    optimizer.load_state_dict(
        {
            "state": {index[n]: {k: local(n, v) for k, v in st.items()} for n, st in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]],
        }
    )


def _names_of(group_params, params: dict) -> list[str]:
    names = {id(p): n for n, p in params.items()}
    return [names[id(p)] for p in group_params]


def rng_state() -> dict[str, Any]:
    """The generators a resume restores: Python's, NumPy's, torch's CPU one and this process's
    CUDA device's (its own only: a rank uses one device, and a resume may see fewer)."""
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(torch.cuda.current_device()) if on_cuda else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        device = torch.cuda.current_device()
        if isinstance(cuda, list):  # a checkpoint of every visible device's: this device's, or the first
            cuda = cuda[device] if device < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, device)


# ----------------------------------------------------------------------------- safe trainer state
def encode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of plain state (dicts with string keys, lists, tuples, numbers, strings),
    its tensors and numpy arrays moved into `tensors` under a reference."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().contiguous().cpu()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_state(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"trainer state keys must be strings: {list(obj)[:3]}")
        return {k: encode_state(v, tensors) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint's trainer state")


def decode_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode_state(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"])
        if "__tuple__" in obj:
            return tuple(decode_state(v, tensors) for v in obj["__tuple__"])
        return {k: decode_state(v, tensors) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- manifest
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Every file of `folder` with its size and checksum, written last (atomically)."""
    files = {
        str(f.relative_to(folder)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != MANIFEST
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def problem(folder: Path) -> str | None:
    """Why `folder` is not a valid checkpoint, or None when its files match its manifest."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the write did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, {want['bytes']} expected"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int, barrier: Callable[[], None] | None = None):
        """`barrier`: waits for every rank (the trainer's `Ranks.barrier`, which runs on a group
        that serves CPU work beside an accelerator-only default group); None in one process."""
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.barrier = barrier or (lambda: None)
        self.swept = False  # sweep() ran

    def sweep(self, exports: tuple[Path, ...] = (), *, remove: bool = True) -> list[Path]:
        """Remove the temp folders that writes a killed run left unfinished: checkpoints' in
        checkpoints/ and those of exports to `exports` (export_model's naming); nothing of any
        other name. One line says what went and how big it was. Call it before this run writes
        anything (a live writer's folder looks the same); with several ranks only one removes
        (`remove`), the others note that it ran. Returns the folders removed."""
        self.swept = True
        if not remove:
            return []
        stale = []
        if self.root.is_dir():
            stale = sorted(
                p for p in self.root.iterdir() if _TEMP.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
            )
        for target in exports:
            stale += stale_temp_folders(target)
        if stale:
            size = sum(_bytes(p) for p in stale)
            for p in stale:
                shutil.rmtree(p, ignore_errors=True)
            run = self.root.parent
            names = ", ".join(str(p.relative_to(run)) if p.is_relative_to(run) else str(p) for p in stale)
            log.warning(
                "removed %d temp folder%s of writes a stopped run left unfinished (%s): %s",
                len(stale),
                "" if len(stale) == 1 else "s",
                _size(size),
                names,
            )
        return stale

    def save(
        self,
        step: int,
        model,
        optimizer,
        scheduler,
        trainer_state: dict[str, Any],
        ref_model=None,
        write=True,
    ) -> Path:
        """Every rank calls this; the one with `write` writes the folder. One process: whole
        tensors in safetensors. Several ranks: each writes its shards (DCP, `sharded/`)."""
        final = self.root / f"step_{step}"
        sharded = is_sharded(model)
        optim = {
            "optimizer": optimizer_state(model, optimizer, whole=not sharded),
            "scheduler": scheduler.state_dict(),
        }
        if sharded:
            tmp = self.root / _temp_name(step)  # one name every rank knows
            if write:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.barrier()  # the folder exists before any rank writes into it
            try:
                _save_shards(tmp / SHARDED, model, ref_model, optim["optimizer"])
                optim["reference"] = ref_model is not None
            except BaseException:
                if write:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            if not write:
                return final
        else:
            weights = trainable_state(inner(model))
            ref = None
            if ref_model is not None:
                ref = {
                    n: full_tensor(p.detach()).contiguous().cpu()
                    for n, p in inner(ref_model).named_parameters()
                }
            if not write:
                return final
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=_temp_name(step) + "-", dir=self.root))
        old = None  # a folder of the same step saved before, moved aside
        try:
            if not sharded:
                save_file(weights, str(tmp / "model.safetensors"))
                if ref is not None:
                    save_file(ref, str(tmp / "ref_model.safetensors"))
            torch.save(optim, tmp / "optim.pt")
            tensors: dict[str, torch.Tensor] = {}
            (tmp / "trainer.json").write_text(json.dumps(encode_state(trainer_state, tensors)))
            save_file(tensors, str(tmp / "trainer.safetensors"))
            write_manifest(tmp)
            if final.exists():  # aside by a rename (a sweep's name), removed once the new one is in place
                old = self.root / f"{_temp_name(step)}-{secrets.token_hex(4)}"
                os.replace(final, old)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not final.exists():
                os.replace(old, final)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        latest_tmp = self.root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, self.root / "latest")
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Checkpoint folders whose write finished (a manifest), oldest first (not verified)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if (p / MANIFEST).is_file()), key=_step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint whose files match its manifest. Newer ones that do not are
        skipped with a warning; when there are checkpoints and none is valid, one line says why."""
        candidates = [p for p in self.root.glob("step_*") if p.is_dir()] if self.root.is_dir() else []
        candidates.sort(key=_step_of, reverse=True)
        marker = self.root / "latest"
        named = self.root / marker.read_text().strip() if marker.is_file() else None
        if named in candidates:  # the last one written (a restarted run's steps may be lower)
            candidates = [named] + [p for p in candidates if _step_of(p) < _step_of(named)]
        skipped = []
        for path in candidates:
            why = problem(path)
            if why is None:
                if skipped:
                    log.warning(
                        "skipped invalid checkpoints (%s); resuming from %s",
                        "; ".join(skipped),
                        path.name,
                    )
                return path
            if (path / MANIFEST).is_file():  # a finished write damaged since; unfinished ones are silent
                skipped.append(f"{path.name}: {why}")
        if skipped:
            raise UserError(
                f"no valid checkpoint in {self.root} ({'; '.join(skipped)}); "
                "set trainer.resume_mode=disable to start afresh"
            )
        return None

    @staticmethod
    def load(path: Path, model, optimizer, scheduler, ref_model=None) -> dict[str, Any]:
        path = Path(path)
        why = problem(path)
        if why is not None:
            raise UserError(f"not a valid checkpoint: {path} ({why})")
        try:  # tensors and plain containers only: nothing in the file can run
            optim = torch.load(path / "optim.pt", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UserError(
                f"{path / 'optim.pt'} holds objects other than tensors and plain data; not loading it "
                f"({str(e).splitlines()[0][:120]})"
            ) from None
        if (path / SHARDED).is_dir():  # written by several ranks: each reads what it holds
            ref = ref_model if optim.get("reference") else None
            _load_shards(path / SHARDED, model, ref, optim["optimizer"])
        else:
            load_trainable_state(inner(model), load_file(str(path / "model.safetensors")))
            if ref_model is not None and (path / "ref_model.safetensors").is_file():
                load_trainable_state(inner(ref_model), load_file(str(path / "ref_model.safetensors")))
        load_optimizer_state(model, optimizer, optim["optimizer"])
        scheduler.load_state_dict(optim["scheduler"])
        tensors = load_file(str(path / "trainer.safetensors"))
        return decode_state(json.loads((path / "trainer.json").read_text()), tensors)


# ----------------------------------------------------------------------------- sharded (DCP)
def _save_shards(folder: Path, model, ref_model, optim: dict[str, Any]) -> None:
    """Every rank writes its shards of the trainable weights, the reference weights and the
    optimizer's sharded state; in `optim` those tensors become a mark naming their dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors = {f"model/{n}": p.detach() for n, p in inner(model).named_parameters() if p.requires_grad}
    if ref_model is not None:
        tensors.update({f"ref/{n}": p.detach() for n, p in inner(ref_model).named_parameters()})
    for name, state in optim["state"].items():
        for key, v in state.items():
            if hasattr(v, "device_mesh"):
                tensors[f"optim/{name}/{key}"] = v.detach()
                state[key] = {_SHARD_MARK: str(v.dtype).removeprefix("torch.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def _load_shards(folder: Path, model, ref_model, optim: dict[str, Any]) -> None:
    """Read a DCP checkpoint into the model as it is sharded now (or whole, in one process):
    weights in place, the optimizer's marked state into tensors shaped like their parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    params = dict(inner(model).named_parameters())
    targets = {f"model/{n}": p.detach() for n, p in params.items() if p.requires_grad}
    if ref_model is not None:
        targets.update({f"ref/{n}": p.detach() for n, p in inner(ref_model).named_parameters()})
    for name, state in optim["state"].items():
        if name not in params:
            raise UserError(f"checkpoint's optimizer state does not match the model: e.g. {name}")
        for key, v in state.items():
            if isinstance(v, dict) and _SHARD_MARK in v:
                state[key] = torch.zeros_like(params[name].detach(), dtype=getattr(torch, v[_SHARD_MARK]))
                targets[f"optim/{name}/{key}"] = state[key]
    reader = HuggingFaceStorageReader(str(folder))
    missing = sorted(set(targets) - set(reader.read_metadata().state_dict_metadata))
    if missing:
        raise UserError(
            f"checkpoint does not match the model: {len(missing)} tensors not in {folder}, e.g. {missing[0]}"
        )
    with warnings.catch_warnings():  # one process reading shards is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader)
