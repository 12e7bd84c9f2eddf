"""Hybrid scheduling of a dataflow graph on Ray: placement, co-location, stages, backpressure, status."""

from hybridflow.scheduler.backpressure import BackpressureDecision, BackpressurePolicy, QueueSignal
from hybridflow.scheduler.edges import EdgeChannel, LatencyStats, percentile
from hybridflow.scheduler.hybrid import DIST_BACKEND, Host, HybridScheduler
from hybridflow.scheduler.placement import PlacementError, PlacementPlan, Stage, plan_placement, stages_of

__all__ = [
    "DIST_BACKEND",
    "BackpressureDecision",
    "BackpressurePolicy",
    "EdgeChannel",
    "Host",
    "HybridScheduler",
    "LatencyStats",
    "PlacementError",
    "PlacementPlan",
    "QueueSignal",
    "Stage",
    "percentile",
    "plan_placement",
    "stages_of",
]
