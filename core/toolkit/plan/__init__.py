"""``toolkit plan``: a memory and step-time model that ranks parallel layouts for a model on a machine.

Public entry points: :func:`plan_model` (what the command runs) and :func:`choose_strategy`
(what ``--strategy auto`` runs). Pure Python: no torch at import.
"""

from __future__ import annotations

from toolkit.plan.auto import choose_strategy
from toolkit.plan.hardware import GPU_KINDS, Cluster, make_cluster, parse_memory
from toolkit.plan.memory import Layout, MemoryBreakdown, Workload, layout_memory
from toolkit.plan.model import ModelShape, load_shape, shape_from_config
from toolkit.plan.search import Candidate, PlanResult, evaluate, plan
from toolkit.plan.timing import TimeBreakdown, step_time

__all__ = ["GPU_KINDS", "Candidate", "Cluster", "Layout", "MemoryBreakdown", "ModelShape", "PlanResult", "TimeBreakdown",
           "Workload", "choose_strategy", "evaluate", "layout_memory", "load_shape", "make_cluster", "parse_memory",
           "plan", "shape_from_config", "step_time"]
