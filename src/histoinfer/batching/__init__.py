"""Dynamic batching: a scheduler per event loop, knowing nothing of models or transports."""

from .perloop import PerLoop, call_soon_in_loop, current_loop_key, wait_future
from .scheduler import BatchScheduler, Reservation
from .stats import DURATION_BOUNDS, BatchStats, StatsSnapshot

__all__ = [
    "DURATION_BOUNDS",
    "BatchScheduler",
    "BatchStats",
    "PerLoop",
    "Reservation",
    "StatsSnapshot",
    "call_soon_in_loop",
    "current_loop_key",
    "wait_future",
]
