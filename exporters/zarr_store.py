"""The store exporter: each capture as one Zarr v3 group (layout in :mod:`attn_otel.store`), marker last."""

from __future__ import annotations

from ..store import capture_prefix, open_zarr_store, redact_url, write_capture
from ._base import ExportItem


class ZarrExporter:
    name = "zarr"

    def __init__(self, store_url: str):
        self.store_url = str(store_url)
        self._store = None

    def export(self, item: ExportItem) -> None:
        if self._store is None:
            self._store = open_zarr_store(self.store_url)
        item.bytes_written = write_capture(self._store, item.record)
        prefix = capture_prefix(item.record.trace_id, item.record.request_id)
        item.uri = f"{redact_url(self.store_url).rstrip('/')}/{prefix}"  # open_zarr_store refuses credentials

    def shutdown(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - nothing left to flush on close
                pass
