"""The runtime's one command, ``hicache-async-ack doctor`` (its exit codes: :class:`Exit`),
and what the lab shares of it: the rank spawner and the option types."""

from .cli import LAB_COMMANDS, LAB_PROG, main
from .doctor import Report, diagnose
from .exits import Exit, exit_table
from .options import int_in, nonneg_float, ranks_and_step_parent, subcommand
from .ranks import Job, RankContext, RanksFailed, describe_exit, run_ranks

__all__ = ["LAB_COMMANDS", "LAB_PROG", "Exit", "Job", "RankContext", "RanksFailed", "Report",
    "describe_exit", "diagnose", "exit_table", "int_in", "main", "nonneg_float",
    "ranks_and_step_parent", "run_ranks", "subcommand"]  # fmt: skip
