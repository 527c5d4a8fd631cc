"""Single-turn rollout: one response per trajectory, the engine's generations made into
`Trajectory`s with the agent loop's interface, so the trainer runs either the same way."""

from __future__ import annotations

from collections.abc import Callable

from grouprl.data.sample import Sample
from grouprl.rollout.engines.base import Generation, RolloutEngine, SamplingParams
from grouprl.rollout.engines.streams import Randomness
from grouprl.rollout.trajectory import Trajectory

GroupCallback = Callable[[int, list[Trajectory]], None]


class SingleTurn:
    """`run` as `AgentLoop.run`: n trajectories per prompt, prompt-major, each group handed to
    `on_group_done(i, group)` as soon as its n samples have ended (while others still generate)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.stats: dict[str, float] = {}  # the agent loop's counts; a single turn has none

    def run(
        self,
        samples: list[Sample],
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: Randomness = None,
        on_group_done: GroupCallback | None = None,
        images: list[list] | None = None,
    ) -> list[Trajectory]:
        """`images[i]`: prompt i's processed images (a VLM policy)."""
        made: dict[int, Trajectory] = {}

        def make(k: int, gen: Generation) -> Trajectory:
            i, j = divmod(k, n)
            made[k] = Trajectory(
                sample=samples[i],
                index=j,
                prompt_ids=prompts[i],
                response_ids=gen.token_ids,
                loss_mask=[1] * len(gen.token_ids),
                rollout_log_probs=gen.log_probs,
                response_text=gen.text,
                finish_reason=gen.finish_reason,
                prompt_images=images[i] if images is not None else [],
                version=gen.version,  # the engine's, where it was told one (else the collector's)
            )
            return made[k]

        def group_done(i: int, generations: list[Generation]) -> None:
            on_group_done(i, [make(i * n + j, gen) for j, gen in enumerate(generations)])

        with_images = {"images": images} if images is not None else {}
        generations = self.engine.generate(
            prompts, n, params, generator, on_group_done=group_done if on_group_done is not None else None, **with_images
        )
        return [made.get(k) or make(k, gen) for k, gen in enumerate(generations)]
