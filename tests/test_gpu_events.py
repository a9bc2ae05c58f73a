"""attn_otel.timing.wait_event on a GPU: a thread that waits for device work on attn-otel's events sleeps
(ATTN_OTEL_EVENT_WAIT=sleep, the default) instead of polling the driver, whose lock the engine loop's launches
need; ``spin`` is the plain event, polled.

Run on the lent GPU machine: ``python3 -P -m pytest -m gpu tests/test_gpu_events.py``.
"""

import threading
import time

import pytest
import torch

from attn_otel import timing

pytestmark = pytest.mark.gpu


def _wait_cpu_share(sleep: bool, timer: bool) -> tuple[float, float]:
    """A thread's CPU time over its wall time, waiting on an event recorded after ~0.3 s of device work."""
    was = timing.SLEEP[0]
    timing.SLEEP[0] = sleep
    try:
        torch.cuda._sleep(1000)  # the sleep kernel loaded before the clock starts
        torch.cuda.synchronize()
        started = timing.DeviceTimer.start("cuda") if timer else None
        torch.cuda._sleep(int(0.3 * torch.cuda.get_device_properties(0).clock_rate * 1000))  # ~0.3 s at its clock
        event = timing.DeviceTimer().stop(started) if timer else timing.wait_event()
        if not timer:
            event.record()
        out = {}

        def waiter():
            t0, c0 = time.perf_counter(), time.thread_time()
            event.synchronize()
            out["wall"], out["cpu"] = time.perf_counter() - t0, time.thread_time() - c0

        th = threading.Thread(target=waiter)
        th.start()
        th.join()
        return out["cpu"] / out["wall"], out["wall"]
    finally:
        timing.SLEEP[0] = was


@pytest.mark.parametrize("timer", [False, True], ids=["wait_event", "DeviceTimer.stop"])
def test_a_thread_waiting_on_attn_otel_s_events_sleeps_unless_told_to_spin(timer):
    sleep_share, sleep_wall = _wait_cpu_share(True, timer)
    spin_share, spin_wall = _wait_cpu_share(False, timer)
    assert sleep_wall > 0.1 and spin_wall > 0.1  # the device work was there to wait for
    assert sleep_share < 0.2, f"the waiting thread used {sleep_share:.0%} of a CPU on a blocking-sync event"
    assert spin_share > 0.6, f"a plain event's wait used only {spin_share:.0%} of a CPU: not a polled wait?"
