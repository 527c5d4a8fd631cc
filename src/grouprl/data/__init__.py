"""Datasets, prompt building, samplers and built-in tasks."""

from grouprl.data.dataset import load_samples
from grouprl.data.prompts import encode_prompt, fit_prompt
from grouprl.data.sample import Sample
from grouprl.data.sampler import PromptSampler, Sampler
from grouprl.data.tasks import TASKS, make_task

__all__ = ["TASKS", "PromptSampler", "Sample", "Sampler", "encode_prompt", "fit_prompt", "load_samples", "make_task"]
