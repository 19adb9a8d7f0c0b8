"""The package's public names: every name in ``vtrain_plugin.__all__`` resolves, to its home module's
object, and ``import vtrain_plugin`` alone loads none of the modules behind them.

Why: the names load on first use (PEP 562), so a name missing from the table, or a submodule that
shadows its function, would only show when a user touches it.
"""

import importlib
import subprocess
import sys

import vtrain_plugin as vtrain


def test_every_public_name_resolves_to_its_home_modules_object():
    assert vtrain.__all__ == sorted(vtrain._HOMES)
    for name in vtrain.__all__:
        home = importlib.import_module(f"vtrain_plugin.{vtrain._HOMES[name]}")
        assert getattr(vtrain, name) is getattr(home, name), name
        assert name in dir(vtrain)


def test_the_estimate_function_survives_importing_the_estimate_module():
    importlib.import_module("vtrain_plugin.estimate")
    assert callable(vtrain.estimate) and vtrain.estimate.__module__ == "vtrain_plugin.estimate"
    namespace: dict = {}
    exec("from vtrain_plugin import estimate", namespace)
    assert namespace["estimate"] is vtrain.estimate


def test_importing_the_package_loads_none_of_its_layers():
    code = ("import sys, vtrain_plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vtrain_plugin', 'torch', 'megatron', 'megatron_adapters', 'numpy', 'yaml')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['vtrain_plugin']"
