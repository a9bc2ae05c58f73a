"""attn-otel's exporters: where a finished capture goes once it is off the engine loop.

One interface, three small modules (one per destination)::

    zarr_store   the capture's arrays as a Zarr v3 group on local disk or S3 (``ATTN_OTEL_STORE``)
    otel         one ``attn_capture`` span per capture, child of the request's traceparent, with one
                 event per captured layer (``OTEL_*`` variables configure the SDK)
    prometheus   per-layer histograms and pipeline counters, readable from vLLM's own ``/metrics``

Contract: an exporter's :meth:`Exporter.export` runs in the writer (a child process by default, see
``ATTN_OTEL_WRITER``), never on the engine loop.  It may block on I/O; it may raise, and the fan-out then
counts the failure under the exporter's name and goes on with the next exporter.  The engine side feeds the
writer through a bounded hand-off: when it is full the capture is dropped and counted, never waited for.

This directory sits at the repository's top level and is packed into wheels as ``attn_otel.exporters``;
in a source checkout ``attn_otel`` finds it there (see ``attn_otel/__init__.py``).
"""

from ._base import Exporter, ExportItem, FanOut, build_exporters

__all__ = ["ExportItem", "Exporter", "FanOut", "build_exporters"]
