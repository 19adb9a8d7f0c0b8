"""``vtrain validate`` says when its measured times are noisy: a loaded machine, or a wide spread."""

from vtrain_plugin.measured.one_device import noise_warnings


def test_an_idle_machine_and_steady_iterations_give_no_warning():
    assert noise_warnings(0.9, 2, [100.0, 110.0, 119.0]) == ()  # 0.45 per CPU; spread 19%


def test_a_loaded_machine_is_one_line():
    assert noise_warnings(1.01, 2, [100.0, 100.0]) == (
        "the machine is loaded (load average 1.01 over 1 min on 2 CPUs, above 0.5 per CPU): measured times are noisy",)


def test_a_wide_spread_is_one_line():
    assert noise_warnings(0.0, 16, [100.0, 125.0, 90.0]) == (
        "the measured iterations spread by 35% of their median (90.0 to 125.0 ms, above 20%): measured times "
        "are noisy",)


def test_the_package_exports_validate_as_a_function():
    """``vtrain.validate(run)`` trains and compares (it was the module of that name, not callable)."""
    import inspect

    import vtrain_plugin as vtrain
    from vtrain_plugin.measured.one_device import validate

    assert callable(vtrain.validate) and vtrain.validate is validate and "validate" in vtrain.__all__
    assert list(inspect.signature(vtrain.validate).parameters) == ["run", "device", "db_path", "iterations", "warmup"]
