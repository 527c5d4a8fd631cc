"""Reward models on their own devices: `function: "model:<name>"` over `reward.models`.

A `ModelPool` runs every configured model in one worker process (`worker.py`), each on its own
device (`cuda:1`, `cpu`) and dtype. Components submit one item per trajectory; the pool batches
what is queued (up to a model's batch_size) while the worker is busy, so groups scored by the
streaming path as they finish overlap generation, and the trainer's process only waits on a pipe.
Kinds (`kinds.py`): `clip` (CLIP/SigLIP image-text similarity), `sequence_classifier` (a reward
model over prompt + response), `text_to_image` (a diffusers pipeline whose images a scorer reads
through `images_from`), and the built-in Pillow stand-ins `scene_renderer` / `scene_scorer`.
Drawn images are cached on disk by (prompt, seed, settings) and recorded on the trajectory
(`artifacts`), so the run folder can keep them beside their rewards.
"""

from grouprl.rewards.models.client import ModelComponent, ModelPool

__all__ = ["ModelComponent", "ModelPool"]
