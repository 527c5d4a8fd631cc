"""LLM/VLM judges as rewards: API judges (OpenAI-compatible, Gemini) and an in-process one.

    from grouprl.rewards.judges import JudgeClient, JudgeRequest
    judge = JudgeClient(JudgeConfig(name="vlm", model="gemini-2.5-flash", api_key_env="JUDGE_API_KEY"))
    result = await judge.judge(JudgeRequest(question=..., response=..., gold_answer=...))
    result.scores, result.aggregate, result.error

In a run, a component with `function: "judge:<name>"` uses `reward.judges[<name>]`
(see `component.py`); `grouprl judge score` re-scores a rollouts.jsonl (`score_log.py`).
Files: base (types, protocols), parsing, prompt + prompts/ (templates), images, cache (SQLite),
log (judge.jsonl), client (concurrency, retries, cache), openai_compat / gemini / local_hf
(backends), component, score_log + cli (the command). Their settings are checked in
`grouprl.config` (JudgeConfig, RewardConfig); an OpenAI-compatible fake server for tests and
benchmarks lives in tests/rewards/judges/fake_server.py.
"""

from grouprl.rewards.judges.base import Completion, JudgeBackendError, JudgePrompt, JudgeRequest, JudgeResult
from grouprl.rewards.judges.client import JudgeClient, build_backend
from grouprl.rewards.judges.component import JudgeComponent
from grouprl.rewards.judges.parsing import JudgeParseError, parse_scores

__all__ = [
    "Completion",
    "JudgeBackendError",
    "JudgeClient",
    "JudgeComponent",
    "JudgeParseError",
    "JudgePrompt",
    "JudgeRequest",
    "JudgeResult",
    "build_backend",
    "parse_scores",
]
