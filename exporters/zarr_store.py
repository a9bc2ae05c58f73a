"""The store exporter: each capture as one Zarr v3 group (layout in :mod:`attn_otel.store`), marker last."""

from __future__ import annotations

import dataclasses

from ..store import capture_prefix, open_zarr_store, read_stored_summary, redact_url, write_capture_part
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
        item.bytes_written, marker = write_capture_part(self._store, rec, rows=rows,
                                                        summary=item.summary if rec.metrics else None)
        prefix = capture_prefix(rec.trace_id, rec.request_id)
        item.uri = f"{redact_url(self.store_url).rstrip('/')}/{prefix}"  # open_zarr_store refuses credentials
        if rec.part is None:
            item.maps_stored = rec.maps is not None
            return
        if marker is None:  # another rank's part completes this capture and exports it
            item.deferred = True
            return
        # This rank completed the capture: the exporters after the store see the whole capture, merged.
        item.maps_stored = bool(marker.get("maps"))
        item._summary = read_stored_summary(self._store, rec.trace_id, rec.request_id, marker) \
            if marker.get("summary_metrics") is not None else {"prompt": {}, "generated": {}}
        item.record = dataclasses.replace(rec, part=None, maps=None, metrics={}, token_ids=None, vision_mask=None,
                                          created=float(marker.get("created", rec.created)),
                                          mode="maps" if item.maps_stored else rec.mode)

    def shutdown(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - nothing left to flush on close
                pass
