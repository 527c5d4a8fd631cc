"""`python tests/recipes/forced_vllm.py train ...` (or as torchrun's script): grouprl's command
line with every vLLM engine it starts taking scripted actions, so that a tiny random policy
searches, crops and finishes in the agent loop on vLLM as `ForcedTurns` makes it do on the
built-in engine.

GROUPRL_FORCED_TURNS holds JSON {"scripts": token-id lists, "after": the token-id lists an
observation may open with, right after the action}: turn k of every trajectory is script k while there is one, then sampled as usual. A vLLM logits processor leaves only the scripted
token's logit (every other one -inf), so the scripted token is drawn, while the log-prob vLLM
reports is the model's own (the engine takes raw log-probs, from before any logits processor,
renormalised over the tokens the policy may sample, as it does under top-k/top-p at temperature
1), so the engine-trainer gap stays what it is. A request's turn is the number of
scripts already in its prompt, each followed by an observation: the agent loop sends each
conversation whole, earlier actions and their observations included.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import vllm
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

import grouprl.rollout.engines.vllm as engines_vllm

_FORCED = json.loads(os.environ.get("GROUPRL_FORCED_TURNS", "{}"))
SCRIPTS: list[list[int]] = _FORCED.get("scripts", [])
AFTER: list[list[int]] = _FORCED.get("after", [])  # what may follow a turn the policy took: an observation's opening


def _holds(seq: list[int], sub: list[int], start: int) -> int:
    """The end of the first `sub` in `seq` at or after `start`, or -1."""
    n = len(sub)
    for i in range(start, len(seq) - n + 1):
        if seq[i : i + n] == sub:
            return i + n
    return -1


def turn_of(prompt: list[int]) -> int:
    """How many scripts, in order, the prompt holds as turns taken: each followed at once by an
    observation's opening (an observation may quote an action, e.g. the last turn's correction)."""
    at = 0
    for k, script in enumerate(SCRIPTS):
        end = _holds(prompt, script, at)
        if end < 0 or not any(prompt[end : end + len(mark)] == mark for mark in AFTER):
            return k
        at = end
    return len(SCRIPTS)


class ForcedTurns(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int] | None, list[int]]] = {}  # batch index -> (script, output so far)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, _params, prompt, output in batch_update.added:
            turn = turn_of(list(prompt or []))
            self.rows[index] = (SCRIPTS[turn] if turn < len(SCRIPTS) else None, output)
        for a, b, direction in batch_update.moved:
            first, second = self.rows.pop(a, None), self.rows.pop(b, None)
            if first is not None:
                self.rows[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.rows[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, output) in self.rows.items():
            if script is None or index >= logits.shape[0]:
                continue
            token = script[min(len(output), len(script) - 1)]
            kept = logits[index, token].clone()
            logits[index].fill_(float("-inf"))
            logits[index, token] = kept
        return logits


_init = vllm.LLM.__init__


def _with_forced_turns(self, *args, **kwargs):
    kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), ForcedTurns]
    _init(self, *args, **kwargs)


vllm.LLM.__init__ = _with_forced_turns
# log-probs from before any logits processor, which the engine renormalises over the tokens a VLM
# may sample (as it does with top-k/top-p at temperature 1): at temperature 1 without truncation,
# what the test runs, the numbers grouprl takes otherwise, without the forcing
engines_vllm.logprobs_mode = lambda cfg: "raw_logprobs"

if __name__ == "__main__":
    from grouprl.cli import main

    sys.exit(main(sys.argv[1:]))
