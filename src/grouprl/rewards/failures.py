"""When a reward fails too often: every component's calls and failures are tallied per process,
and `rewards_down` (given every rank's tallies) says whether the run must stop, saved, rather
than train on fallback values (reward.max_consecutive_failures / max_failed_share)."""

from __future__ import annotations

from dataclasses import dataclass

from grouprl.errors import UserError


class RewardUnavailableError(UserError):
    """A reward failed too often (reward.max_consecutive_failures / max_failed_share): the run
    stops, saved, rather than train on fallback values."""


class JudgeUnavailableError(RewardUnavailableError):
    """A judge failed too often; resuming helps once it answers again."""


class RewardFailingError(RewardUnavailableError):
    """A reward function (rule, user file, reward model) failed too often: a bug or a mismatch
    between it and the data; resuming helps once it is fixed."""


COMPONENT = "component:"  # report keys of reward components that are not judges


@dataclass
class JudgeTally:
    """One judge's (or reward component's) calls in one process since the last report, and its
    failed calls in a row."""

    calls: int = 0
    failures: int = 0
    in_row: int = 0
    error: str = ""  # a judge's last failure's; a component's first


def rewards_down(
    reports: list[dict[str, JudgeTally]], max_in_row: int, max_share: float
) -> RewardUnavailableError | None:
    """Why the run must stop for a judge or a reward component, given every rank's
    `failure_report()` (the same answer on every rank), or None. Failures in a row add up over
    the ranks (each counts its own calls)."""
    for key in sorted({key for report in reports for key in report}):
        tallies = [report[key] for report in reports if key in report]
        calls, failures = sum(t.calls for t in tallies), sum(t.failures for t in tallies)
        in_row = sum(t.in_row for t in tallies)
        component = key.startswith(COMPONENT)
        errors = [t.error for t in tallies if t.error]
        error = ((errors[0] if component else errors[-1]) if errors else "").splitlines() or [""]
        what = f"reward component {key[len(COMPONENT):]!r}" if component else f"judge {key!r}"
        which = "first" if component else "last"
        kind = RewardFailingError if component else JudgeUnavailableError
        if max_in_row and in_row >= max_in_row:
            return kind(
                f"{what} failed {in_row} calls in a row (reward.max_consecutive_failures="
                f"{max_in_row}; {which} error: {error[0][:200]})"
            )
        if calls and failures / calls > max_share:
            return kind(
                f"{what} failed {failures} of {calls} calls (more than reward.max_failed_share="
                f"{max_share:g}; {which} error: {error[0][:200]})"
            )
    return None
