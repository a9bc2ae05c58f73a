"""Engines a test module serves in subprocesses, started as the module begins, two at a time (one at a time in
each of run-tests.sh's two pytest-xdist workers, which already keep both cores busy, and four engines at once
would not fit the CI machine's memory).

A served engine is mostly one Python thread while it starts (imports, vLLM's set-up, dynamo's trace), and the
checks against HF run in the test process meanwhile, so on the 2-core CI machine two at once take about the time
of one and a half.  A module lists what its selected tests need (:func:`selected`, so ``-k`` starts only
those), starts them in the order the tests take them, and each test waits for its own::

    runs = Prefetch()
    for key in selected(request, key_of):
        runs.start(key, serve, ...)      # the arguments built here: model builders seed torch's global generator
    yield runs                           # runs[key]: that call's result, or its exception, raised here
    runs.close()
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


def params_of(item) -> dict:
    """A collected test's parameters (``{}`` where it has none)."""
    return getattr(getattr(item, "callspec", None), "params", {})


def selected(request, key_of: Callable[[Any], str | list[str] | None]) -> list[str]:
    """The keys of this module's selected tests (``key_of(item)``: a key, a list of them, or None for a test that
    needs none), in the order they run, each once."""
    keys = []
    for item in request.session.items:
        if item.module is request.module:
            k = key_of(item)
            keys += [] if k is None else [k] if isinstance(k, str) else list(k)
    return list(dict.fromkeys(keys))


class Prefetch:
    def __init__(self, workers: int | None = None):
        if workers is None:  # one at a time in each of pytest-xdist's workers (run-tests.sh runs two)
            workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch")
        self._futures: dict[str, Future] = {}

    def start(self, key: str, fn: Callable, *args, **kwargs) -> None:
        if key in self._futures:
            raise KeyError(f"{key!r} was started already")
        self._futures[key] = self._pool.submit(fn, *args, **kwargs)

    def __getitem__(self, key: str):
        if key not in self._futures:
            raise KeyError(f"{key!r} was not started (started: {', '.join(self._futures) or 'none'})")
        return self._futures[key].result()

    def close(self) -> None:
        """Waits for the calls running (their subprocesses have timeouts); the ones not started are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
