"""Launchers other than torchrun: `trainer.launcher=ray` runs the ranks as Ray Train workers.

`grouprl train cfg.yaml trainer.launcher=ray trainer.ray_workers=N` connects to the Ray cluster
at RAY_ADDRESS (or starts a local one, as `ray.init()` does) and starts N workers with
`ray.train.torch.TorchTrainer`. Ray Train joins their process group with the backend torchrun's
ranks get (`parallel.process_group_backend`: gloo on CPU; on GPUs NCCL and gloo beside it for
CPU tensors, where Ray's own choice is NCCL alone) and sets RANK, WORLD_SIZE, LOCAL_RANK (and
MASTER_ADDR/PORT) as torchrun does, so each worker runs the ordinary local loop,
`Trainer(cfg).fit()`, and `Ranks.from_env` finds the group joined: the run folder and what
rank 0 writes there are those of a torchrun run. Ray is an optional extra
(`pip install 'grouprl[ray]'`); nothing here imports it before a run asks.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from grouprl.config import Config, from_dict, to_dict
from grouprl.errors import UserError

log = logging.getLogger(__name__)

MISSING_RAY = "trainer.launcher=ray needs Ray Train: pip install 'grouprl[ray]'"


def _import_ray():
    try:
        import ray
        import ray.train
        import ray.train.torch
    except ImportError:
        raise UserError(MISSING_RAY) from None
    return ray


def placement(cfg: Config, resources: Mapping[str, float]) -> tuple[int, bool]:
    """(workers, a GPU each) for `cfg` on a cluster with `resources` (ray.cluster_resources()):
    GPUs when trainer.device asks for CUDA or is auto and the cluster has some; 0 workers = one
    per GPU. A cluster that is short of what the run asks for is only warned about: an
    autoscaling one grows while the run waits."""
    t = cfg.trainer
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    use_gpu = t.device == "cuda" or (t.device == "auto" and gpus > 0)
    workers = t.ray_workers or (gpus if use_gpu else 0)
    if not workers:
        what = "it has no GPUs now" if use_gpu else "a CPU run has no GPU count to go by"
        raise UserError(f"set trainer.ray_workers (the number of ranks to start on the Ray cluster): {what}")
    if workers * t.ray_cpus_per_worker > cpus or (use_gpu and workers > gpus):
        log.warning(
            "the Ray cluster has %d CPUs and %d GPUs; %d workers need %d CPUs%s: the run waits for them",
            cpus, gpus, workers, workers * t.ray_cpus_per_worker, f" and {workers} GPUs" if use_gpu else "",
        )  # fmt: skip
    return workers, use_gpu


def _secrets(tree: Any) -> dict[str, str]:
    """The environment variables the config names as holding secrets (`*_env` keys: API keys;
    GROUPRL_ENGINE_KEY for a run with rollout.engine_address), with their values here: a worker
    on another node does not share this shell."""
    from grouprl.rollout.engines.process import KEY_ENV

    found: dict[str, str] = {}
    rollout = tree.get("rollout") if isinstance(tree, dict) else None
    if isinstance(rollout, dict) and rollout.get("engine_address") and KEY_ENV in os.environ:
        found[KEY_ENV] = os.environ[KEY_ENV]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            found.update(_secrets(value))
        elif str(key).endswith("_env") and isinstance(value, str) and value in os.environ:
            found[value] = os.environ[value]
    return found


def _worker(job: dict[str, Any]) -> None:
    """One rank: the driver's folder, secrets and logging, its share of threads, then the loop."""
    import torch

    if os.path.isdir(job["cwd"]):  # Ray starts workers in its session folder; paths are the driver's
        os.chdir(job["cwd"])
    import ray

    os.environ.update(ray.get(job["secrets"]))  # an object reference: Ray's run state never holds the values
    os.environ["OMP_NUM_THREADS"] = str(job["threads"])  # for anything this rank starts
    torch.set_num_threads(job["threads"])  # the CPUs Ray reserved, not every core of the node
    if job["setup"] is not None:
        job["setup"]()
    from grouprl.trainer.trainer import Trainer

    Trainer(from_dict(job["config"])).fit()


def _user_error(error: BaseException) -> UserError | None:
    """The first UserError a worker raised (by rank), wherever Ray Train put it."""
    failures = getattr(error, "worker_failures", None) or {}
    found = [failures[rank] for rank in sorted(failures)] + [error]
    seen: set[int] = set()
    while found:
        e = found.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        # Ray wraps a task's exception (RayTaskError.cause, Ray Train V1's __cause__)
        found += [getattr(e, "cause", None), e.__cause__]
    return None


def run_on_ray(cfg: Config, setup: Callable[[], None] | None = None) -> None:
    """Train `cfg` on Ray Train workers and return when every rank is done. `setup` (a
    module-level function, it travels by name) runs first on each worker: the CLI's logging."""
    ray = _import_ray()
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from grouprl.trainer.parallel import process_group_backend

    started = not ray.is_initialized()
    if started:
        ray.init()  # the cluster at RAY_ADDRESS; a local one when there is none
    try:
        workers, use_gpu = placement(cfg, ray.cluster_resources())
        tree = to_dict(cfg)
        tree["trainer"]["launcher"] = "local"  # each worker is one rank of an ordinary run
        tree["trainer"]["device"] = "cuda" if use_gpu else "cpu"
        job = {
            "config": tree,
            "cwd": os.getcwd(),
            # by reference: train_loop_config is kept (and shown) in Ray Train's run state
            "secrets": ray.put(_secrets(tree)),
            "threads": cfg.trainer.ray_cpus_per_worker,
            "setup": setup,
        }
        resources = {"CPU": cfg.trainer.ray_cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        options: dict[str, Any] = {}
        if hasattr(ray.train, "LoggingConfig"):
            # a failed worker is reported once, below, not as tracebacks from each Ray process
            options["logging_config"] = ray.train.LoggingConfig(log_level="CRITICAL")
        log.info("training on %d Ray workers (%s)", workers, "a GPU each" if use_gpu else "CPU")
        # Ray Train's own records (no checkpoints are reported to it) go to a folder that goes
        # away with the run, not to ~/ray_results or the run folder
        with tempfile.TemporaryDirectory(prefix="grouprl-ray-") as storage:
            trainer = TorchTrainer(
                _worker,
                train_loop_config=job,
                torch_config=TorchConfig(backend=process_group_backend(tree["trainer"]["device"])),
                scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker=resources),
                run_config=RunConfig(name=cfg.trainer.experiment_name, storage_path=storage, **options),
            )
            try:
                trainer.fit()
            except Exception as e:  # TrainingFailedError; its module moved between Ray versions
                user = _user_error(e)
                if user is None:
                    raise
                raise user from None
    finally:
        if started:
            ray.shutdown()
