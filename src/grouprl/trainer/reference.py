"""The KL term's reference policy, one object whatever it is.

- `none`: no KL coefficient, no reference (nothing is scored);
- `adapters`: a LoRA policy's own base model, its adapters disabled for the pass (no second copy);
- `frozen`: a frozen copy of the starting weights (sharded as the policy is over several ranks),
  in host memory outside its pass where `actor.reference_offload` asks (`parked`), copied from
  the policy every `algorithm.ref_refresh_steps` steps.

The learner asks it for log-probs; checkpoints save and load its `frozen_model`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from grouprl.trainer.offload import ParkedModule
from grouprl.trainer.parallel import inner


@dataclass(frozen=True)
class Reference:
    kind: Literal["none", "adapters", "frozen"]
    model: torch.nn.Module | None = None  # the frozen copy (kind "frozen")
    parked: ParkedModule | None = None  # its weights in host memory outside its pass

    @property
    def active(self) -> bool:
        """Whether a KL term needs reference log-probs."""
        return self.kind != "none"

    @property
    def frozen_model(self) -> torch.nn.Module | None:
        """The copy a checkpoint saves and loads (None unless kind is "frozen")."""
        return self.model if self.kind == "frozen" else None

    def present(self) -> contextlib.AbstractContextManager:
        """Its weights on the device for the `with` block (a no-op unless parked)."""
        return self.parked.present() if self.parked is not None else contextlib.nullcontext()

    def log_probs(self, updater, model: torch.nn.Module, policy: torch.nn.Module, tensors) -> torch.Tensor:
        """Each sampled token's log-prob under the reference. `model`: the policy's own module
        (its adapters are switched off for `adapters`), `policy`: what the update runs (the
        model, or its FSDP2 root)."""
        if self.kind == "adapters":
            with model.disable_adapter():
                return updater.score_all(policy, tensors)
        if self.kind != "frozen":
            raise RuntimeError("no reference policy: no KL term asks for one")
        with self.present():
            return updater.score_all(self.model, tensors)

    def refresh(self, model: torch.nn.Module) -> None:
        """A frozen copy takes the policy's current weights (algorithm.ref_refresh_steps)."""
        if self.kind == "frozen":
            with self.present():
                inner(self.model).load_state_dict(model.state_dict())
