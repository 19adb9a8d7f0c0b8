"""Scheduling policies, by name in :data:`POLICIES` (see :mod:`.base`).

Every module of this package is imported here, so a policy registers itself by being a file.
"""

import importlib
import pkgutil

from vtrain_plugin.planning.cluster.policies.base import (POLICIES, ClusterView, Decision, JobView, Policy,
                                                          arrival_order, deadline_order)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["POLICIES", "ClusterView", "Decision", "JobView", "Policy", "arrival_order", "deadline_order"]
