"""What measures on a real device: op replay, collective benchmarks, the SQLite profile database.

The import below sets the load order, nothing else: importing any vtrain_plugin module loads the
vtrain_plugin package first, and its public ``estimate`` reads the profile database through
:mod:`profiler.lookup`. Loading the package here, before any module of this one starts, means no
module of this package is ever found half-loaded whichever package a program imports first.
"""

import vtrain_plugin.core.errors  # noqa: F401  (load order, see above)
