"""Device time of capture work: CUDA events around its launches, summed once they complete (never a sync)."""

from __future__ import annotations

import threading

import torch


SLEEP = [True]  # ATTN_OTEL_EVENT_WAIT=sleep (the default); the capture engine sets it from its config


def wait_event(enable_timing: bool = False) -> torch.cuda.Event:
    """A CUDA event that some host thread will wait on (``synchronize``).  With ``ATTN_OTEL_EVENT_WAIT=sleep``
    (the default) it is a blocking-sync event: the waiting thread sleeps in the driver until the device
    reaches it.  A plain event's wait polls the driver instead: a CPU core busy for as long as it waits (the
    writer threads wait on a finish batch's event for up to tens of milliseconds), and the driver's lock, which
    the engine loop's launches need too, taken over and over (vLLM made its own per-step events blocking for
    that reason, vllm-project/vllm#47081).  Run 43 (H200, mixed workload): the writer threads' CPU x0.15 with
    ``sleep``, throughput level with ``spin``.  ``spin``: plain events, as up to 2026-11-29."""
    return torch.cuda.Event(enable_timing=enable_timing, blocking=SLEEP[0])


class DeviceTimer:
    """Seconds of device time between :meth:`start` and :meth:`stop` pairs, as far as completed.  The engine
    loop times its launches; the stats thread reads :attr:`seconds`."""

    def __init__(self) -> None:
        self._done = 0.0
        self._pending: list = []  # (start, end) events, oldest first
        self._lock = threading.Lock()

    @staticmethod
    def start(device: torch.device | str) -> torch.cuda.Event | None:
        """An event recorded now on the current stream where ``device`` is a GPU; None elsewhere (untimed)."""
        if torch.device(device).type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """The end of the work launched since ``started`` (from :meth:`start`): its event, recorded now (None
        where untimed), one a thread may wait on (:func:`wait_event`: the writers wait on a finish batch's).
        Completed pairs are summed here too, so that none pile up unread."""
        if started is None:
            return None
        end = wait_event(enable_timing=True)
        end.record()
        with self._lock:
            self._pending.append((started, end))
            self._poll()
        return end

    @property
    def seconds(self) -> float:
        with self._lock:
            self._poll()
            return self._done

    def _poll(self) -> None:
        while self._pending and self._pending[0][1].query():
            a, b = self._pending.pop(0)
            self._done += a.elapsed_time(b) / 1000.0
