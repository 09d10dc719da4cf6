"""Environments: the protocol (:mod:`hisr_core.envs.base`) and the registered benchmarks.

Importing this package registers every built-in environment.
"""

from hisr_core.envs import (
    alfworld,  # noqa: F401  (registers "alfworld")
    household,  # noqa: F401  (registers "household")
    virtualhome,  # noqa: F401  (registers "virtualhome")
)
from hisr_core.envs.base import (
    NOTHING_HAPPENS,
    UNKNOWN_DISTANCE,
    Environment,
    Episode,
    ExpertEpisode,
    GoalEpisode,
    StepResult,
    Task,
    Turn,
    environment_class,
    make_environment,
    register,
    registered,
)

__all__ = [
    "NOTHING_HAPPENS",
    "UNKNOWN_DISTANCE",
    "Environment",
    "Episode",
    "ExpertEpisode",
    "GoalEpisode",
    "StepResult",
    "Task",
    "Turn",
    "environment_class",
    "make_environment",
    "register",
    "registered",
]
