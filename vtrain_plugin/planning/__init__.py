"""Planning on top of the estimate: plan search, time and cost to train, compute-optimal model size."""

from vtrain_plugin.planning.pareto import pareto_front
from vtrain_plugin.planning.search import SearchResult, search
from vtrain_plugin.planning.space import Candidate, Enumeration, GpuBudget, SearchSpace, enumerate_plans

__all__ = ["Candidate", "Enumeration", "GpuBudget", "SearchResult", "SearchSpace", "enumerate_plans",
           "pareto_front", "search"]
