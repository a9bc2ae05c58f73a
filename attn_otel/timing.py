"""Device time of capture work: CUDA events around its launches, summed once they complete (never a sync)."""

from __future__ import annotations

import threading

import torch


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
        where untimed).  Completed pairs are summed here too, so that none pile up unread."""
        if started is None:
            return None
        end = torch.cuda.Event(enable_timing=True)
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
