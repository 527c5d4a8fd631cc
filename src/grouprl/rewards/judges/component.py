"""A judge as a reward component: `function: "judge:<name>"` in `reward.components`.

The component builds a `JudgeRequest` from the trajectory and returns the judge's
`JudgeResult`; `CompositeReward` takes its aggregate as the component's value and counts the
call in `judge/<component>/*` metrics. What the judge sees:
- question: the prompt's last user turn; response: the full response text;
- answer: the last `<answer>...</answer>` block (rules.extract_answer), "" if none;
- gold_answer: the sample's ground truth (a list is joined with " | ");
- retrieved images: `trajectory.retrieved` doc ids resolved in `image_base_path` (only when set);
- gold images: `extra_info["reference_images"]` (bytes or paths), else `extra_info["gold_docs"]`
  doc ids resolved in `image_base_path` (only when set);
- extra: `extra_info`, for `{key}` placeholders in the template.
"""

from __future__ import annotations

from typing import Any

from grouprl.rewards.judges.base import Judge, JudgeRequest, JudgeResult
from grouprl.rewards.judges.images import JudgeImageError, resolve_doc_image
from grouprl.rewards.rules import extract_answer
from grouprl.rollout.trajectory import Trajectory


def gold_text(ground_truth: Any) -> str:
    if ground_truth is None:
        return ""
    if isinstance(ground_truth, (list, tuple)):
        return " | ".join(str(g) for g in ground_truth)
    return str(ground_truth)


def doc_images(doc_ids: list[Any], base_path: str) -> list[Any]:
    """Paths of the doc ids' image files; raises JudgeImageError for one that has none."""
    return [resolve_doc_image(str(doc_id), base_path) for doc_id in doc_ids] if base_path else []


def build_request(
    *,
    question: str,
    response: str,
    ground_truth: Any,
    retrieved: list[Any],
    extra_info: dict[str, Any] | None,
    image_base_path: str,
    request_id: str,
) -> JudgeRequest:
    extra_info = extra_info or {}
    gold_images = extra_info.get("reference_images") or []
    if not isinstance(gold_images, (list, tuple)):
        gold_images = [gold_images]
    if not gold_images:
        gold_docs = extra_info.get("gold_docs") or []
        gold_images = doc_images(
            list(gold_docs) if isinstance(gold_docs, (list, tuple)) else [gold_docs], image_base_path
        )
    return JudgeRequest(
        question=question,
        response=response,
        answer=extract_answer(response) or "",
        gold_answer=gold_text(ground_truth),
        retrieved_images=doc_images(list(retrieved), image_base_path),
        gold_images=list(gold_images),
        extra=dict(extra_info),
        request_id=request_id,
    )


class JudgeComponent:
    """`await component(prompt=..., trajectory=...)` -> JudgeResult (never raises for judge faults)."""

    def __init__(self, judge: Judge, image_base_path: str = "") -> None:
        self.judge = judge
        self.image_base_path = image_base_path

    async def __call__(self, prompt: str, trajectory: Trajectory) -> JudgeResult:
        sample = trajectory.sample
        try:
            request = build_request(
                question=prompt,
                response=trajectory.response_text,
                ground_truth=sample.ground_truth,
                retrieved=trajectory.retrieved,
                extra_info=sample.extra_info,
                image_base_path=self.image_base_path,
                request_id=f"{sample.uid}/{trajectory.index}",
            )
        except JudgeImageError as e:
            return JudgeResult(error=f"bad input: {e}")
        return await self.judge.judge(request)

    def __repr__(self) -> str:
        return f"JudgeComponent({self.judge!r})"
