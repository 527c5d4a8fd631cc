"""The trainer section: the loop, checkpoints, evaluation, logging, launchers and the memory plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grouprl.errors import need, one_of


@dataclass
class TrainerConfig:
    total_steps: int = 0
    """Training steps; 0 = total_epochs passes over the data."""
    total_epochs: int = 1
    """Passes over the training data when total_steps is 0."""
    max_time_minutes: float = 0.0
    """Stop training (then evaluate and save) after this much wall time of this process's training steps, counted from the first step: the baseline evaluation before it is not counted (0 = no limit)."""
    seed: int = 42
    """Seed for sampling, generation and initialisation."""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    output_dir: str = "runs"
    """Parent folder of runs."""
    experiment_name: str = "default"
    """Run folder name inside output_dir."""
    project_name: str = "grouprl"
    """Project name for wandb/TensorBoard."""
    save_freq: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    save_last: bool = True
    """Checkpoint the end of the run (what continuing it later needs: weights, optimizer, sampler). false: only the save_freq ones (a quick trial whose final/ export is all it keeps; a full fine-tune's optimizer state is twice its weights)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted)."""
    resume_mode: Literal["auto", "disable", "path"] = "auto"
    """auto: continue from the newest complete checkpoint; disable: start fresh; path: resume_from_path."""
    resume_from_path: str | None = None
    """Checkpoint folder for resume_mode=path."""
    test_freq: int = 0
    """Evaluate every N steps (0 = only before and after training)."""
    val_before_train: bool = True
    """Evaluate the starting model (the baseline)."""
    eval_dir: str = ""
    """`grouprl eval` writes answers.jsonl (one line per held-out sample, in file order) and metrics.json here; "" = <output_dir>/<experiment_name>/eval."""
    val_breakdown: str = ""
    """Also log held-out accuracy per value of this key: data_source, or a key of the samples' extra_info (e.g. kind): val/accuracy/<value>."""
    save_best: bool = True
    """Keep the model with the best mean evaluation metric in <run>/best."""
    save_final: bool = True
    """Save the final model in Hugging Face format in <run>/final."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console, jsonl, wandb, tensorboard (the last two only when installed)."""
    log_rollouts: bool = True
    """Write every trajectory to rollouts.jsonl."""
    skip_nonfinite_loss: bool = True
    """Skip (and count) an optimizer step whose loss or gradient is NaN/inf."""
    launcher: Literal["local", "ray"] = "local"
    """local: this process (or the ranks torchrun started); ray: ray_workers ranks on the Ray cluster at RAY_ADDRESS (else a local one), a GPU each when device is cuda, or auto and the cluster has GPUs (`pip install 'grouprl[ray]'`)."""
    ray_workers: int = 0
    """launcher=ray: training processes (ranks); 0 = one per GPU of the cluster."""
    ray_cpus_per_worker: int = 1
    """launcher=ray: CPUs Ray reserves for each worker, which is also its number of torch threads."""
    nnodes: int = 1
    """Nodes the memory plan is for, with n_gpus_per_node (verl's names): a plan (`--dry-run`) for a cluster from any machine."""
    n_gpus_per_node: int = 0
    """GPUs per node the memory plan is for (0 = the ranks this run has, on its devices)."""
    gpu_memory_gb: float = 0.0
    """The memory of one device for the memory plan, in GiB as the card reports it (nvidia-smi's total MiB / 1024: 79.2 for an "80 GB" H100 or A100); 0 = read it from the device present (a CPU's is the host's), or, for GPUs this machine lacks, plan without checking the fit."""
    memory_check: Literal["refuse", "warn", "off"] = "refuse"
    """The memory plan at a run's start: refuse stops a run whose plan does not fit before anything loads (one line: the phase, its figure, settings that would fit); warn logs that line and runs; off plans nothing."""


    def __post_init__(self) -> None:
        # counts and periods where 0 means "off": a negative value would silently misbehave
        for key in ("save_freq", "test_freq", "max_time_minutes"):
            need(getattr(self, key) >= 0, f"config key 'trainer.{key}' must be >= 0, got {getattr(self, key)!r}")
        need(self.total_steps >= 0, "config key 'trainer.total_steps' must be >= 0")
        need(
            self.total_steps > 0 or self.total_epochs >= 1,
            "config key 'trainer.total_epochs' must be >= 1 when trainer.total_steps is 0",
        )
        need(self.keep_last >= 1, "config key 'trainer.keep_last' must be >= 1")
        need(self.ray_workers >= 0, "config key 'trainer.ray_workers' must be >= 0 (0 = one per GPU of the cluster)")
        need(self.ray_cpus_per_worker >= 1, "config key 'trainer.ray_cpus_per_worker' must be >= 1")
        need(self.nnodes >= 1, "config key 'trainer.nnodes' must be >= 1")
        need(self.n_gpus_per_node >= 0, "config key 'trainer.n_gpus_per_node' must be >= 0 (0 = the ranks present)")
        need(self.gpu_memory_gb >= 0, "config key 'trainer.gpu_memory_gb' must be >= 0 (0 = read it from the device)")
        need(
            self.launcher != "ray" or self.device in ("auto", "cpu", "cuda"),
            "config key 'trainer.device' must be auto, cpu or cuda with trainer.launcher=ray (Ray gives each "
            f"worker its GPU), got {self.device!r}",
        )
        need(
            self.resume_mode != "path" or bool(self.resume_from_path),
            "config key 'trainer.resume_from_path' must be set when trainer.resume_mode is 'path'",
        )
        for logger in self.loggers:
            one_of("trainer.loggers", logger, {"console", "jsonl", "wandb", "tensorboard"})
