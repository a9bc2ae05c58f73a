"""The store exporter: each capture as one Zarr v3 group (layout in :mod:`attn_otel.store`), marker last."""

from __future__ import annotations

from ..store import capture_prefix, open_zarr_store, redact_url, write_capture
from ._base import ExportItem


class ZarrExporter:
    name = "zarr"

    def __init__(self, store_url: str, row_metrics: str = "maps"):
        self.store_url = str(store_url)
        self.row_metrics = row_metrics  # ATTN_OTEL_ROW_METRICS: "maps" or "all"
        self._store = None

    def export(self, item: ExportItem) -> None:
        if self._store is None:
            self._store = open_zarr_store(self.store_url)
        rec = item.record
        rows = self.row_metrics == "all" or rec.maps is not None
        item.bytes_written = write_capture(self._store, rec, rows=rows,
                                           summary=item.summary if rec.metrics else None)
        prefix = capture_prefix(item.record.trace_id, item.record.request_id)
        item.uri = f"{redact_url(self.store_url).rstrip('/')}/{prefix}"  # open_zarr_store refuses credentials

    def shutdown(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - nothing left to flush on close
                pass
