"""DeviceHealth: degraded once half of the recent forwards (and at least min_failures) raised; recovers."""

from mlxb.engine.device_health import DeviceHealth


def test_a_few_failures_among_successes_stay_healthy():
    h = DeviceHealth(window=8, min_failures=3)
    for _ in range(6):
        h.ok()
    h.failed(RuntimeError("x"))
    h.failed(RuntimeError("y"))
    assert h.degraded() is None and h.failures == 2


def test_half_failing_is_degraded_with_the_last_error_then_recovers():
    h = DeviceHealth(window=8, min_failures=3)
    for i in range(4):
        h.ok()
        h.failed(RuntimeError(f"boom {i}"))
    why = h.degraded()
    assert why is not None and "4 of the last 8" in why and "boom 3" in why
    h.ok()
    assert h.degraded() is not None  # the oldest success left the window: still 4 of 8
    h.ok()  # the oldest failure left: 3 of 8, below half
    assert h.degraded() is None


def test_min_failures_guards_a_fresh_engine():
    h = DeviceHealth(window=32, min_failures=4)
    for _ in range(3):
        h.failed(RuntimeError("first"))
    assert h.degraded() is None  # three in a row at start-up: not yet
    h.failed(RuntimeError("fourth"))
    assert h.degraded() is not None
