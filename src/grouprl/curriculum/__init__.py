"""Difficulty statistics from earlier runs' logs, buckets, orderings (`grouprl curriculum
build`), and the online curriculum sampler with dynamic filtering of zero-variance groups."""

from grouprl.curriculum.buckets import BUCKETS, assign_buckets, check_thresholds
from grouprl.curriculum.build import BuildOptions, build_curriculum
from grouprl.curriculum.filtering import GroupSelection, keep_groups, prompts_to_draw, select_groups
from grouprl.curriculum.logs import LogFields, read_logs
from grouprl.curriculum.online import OnlineCurriculum
from grouprl.curriculum.order import ORDERS, curriculum_order
from grouprl.curriculum.stats import UidStats, uid_stats

__all__ = [
    "BUCKETS",
    "ORDERS",
    "BuildOptions",
    "GroupSelection",
    "LogFields",
    "OnlineCurriculum",
    "UidStats",
    "assign_buckets",
    "build_curriculum",
    "check_thresholds",
    "curriculum_order",
    "keep_groups",
    "prompts_to_draw",
    "read_logs",
    "select_groups",
    "uid_stats",
]
