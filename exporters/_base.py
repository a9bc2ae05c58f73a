from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol, Sequence

from ..store import CaptureRecord

logger = logging.getLogger("attn_otel")


@dataclasses.dataclass
class ExportItem:
    """One capture on its way through the exporters.

    ``record`` holds the arrays (metrics per row, maps when selected).  ``latency_s`` is the time from the
    request's finish to its metrics being on the host.  Exporters earlier in the fan-out leave what later
    ones reference: the Zarr exporter sets ``uri`` (where the capture is, or None when it was not stored).

    Tensor/pipeline parallel: a record that is one rank's part (``record.part``) is written by the Zarr
    exporter; only the part that completes the capture goes on to the other exporters, and for them the
    Zarr exporter replaces ``record`` by the whole capture's view (no arrays) and sets the merged summary
    it read back.  The other parts come out ``deferred``: the fan-out stops after the store.
    """

    record: CaptureRecord
    latency_s: float = 0.0
    uri: str | None = None
    bytes_written: int = 0
    _summary: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    deferred: bool = False  # a part that did not complete its capture: nothing after the store
    maps_stored: bool | None = None  # set by the store; None: whether the record carries maps

    @property
    def complete(self) -> bool:
        return not self.deferred

    @property
    def summary(self) -> dict[str, Any]:
        """:func:`attn_otel.metrics.summarize` of the record's metrics, computed once for all exporters."""
        if self._summary is None:
            from ..metrics import summarize

            self._summary = summarize(self.record.metrics, self.record.prompt_len)
        return self._summary


class Exporter(Protocol):
    name: str

    def export(self, item: ExportItem) -> None:
        """Send one capture.  May block on I/O (it runs off the engine loop); raises on failure."""

    def shutdown(self) -> None:
        """Flush what is buffered and release resources; called once, at the writer's exit."""


class FanOut:
    """Runs every exporter on each capture, in order; one exporter's failure does not stop the others.

    ``export`` returns ``{exporter name: error message}`` for the exporters that failed (empty when all
    succeeded).  The first exporter is the store: when it fails, the capture counts as dropped
    (``store_error``) on the engine side; the others' failures count as ``export_errors{exporter}``.
    """

    def __init__(self, exporters: Sequence[Exporter]):
        self.exporters = list(exporters)
        self._warned: set[str] = set()

    def export(self, item: ExportItem) -> dict[str, str]:
        errors: dict[str, str] = {}
        for exp in self.exporters:
            if item.deferred:
                break
            try:
                exp.export(item)
            except Exception as e:  # noqa: BLE001 - counted by the caller, logged once per exporter and type
                errors[exp.name] = f"{type(e).__name__}: {e}"[:500]
                key = f"{exp.name}:{type(e).__name__}"
                if key not in self._warned:
                    self._warned.add(key)
                    logger.warning("attn-otel: exporter %s failed on trace %s: %s (counted; logged once per "
                                   "exporter and error type)", exp.name, item.record.trace_id, errors[exp.name])
        return errors

    def shutdown(self) -> None:
        for exp in self.exporters:
            try:
                exp.shutdown()
            except Exception as e:  # noqa: BLE001
                logger.warning("attn-otel: exporter %s did not shut down cleanly: %s", exp.name, e)
