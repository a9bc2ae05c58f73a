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

This directory sits at the repository's top level and is the subpackage ``attn_otel.exporters``, in
wheels and editable installs alike (``package-dir`` in pyproject.toml).
"""

from __future__ import annotations

import importlib
import logging

from ..config import Config
from ._base import Exporter, ExportItem, FanOut
from .zarr_store import ZarrExporter

__all__ = ["ExportItem", "Exporter", "FanOut", "build_exporters"]

logger = logging.getLogger("attn_otel")


def build_exporters(config: Config) -> FanOut:
    """The exporters this configuration asks for: the Zarr store always, then OpenTelemetry and
    Prometheus when their libraries are importable and they are not turned off."""
    exporters: list[Exporter] = [ZarrExporter(config.store, config.row_metrics)]
    for module in ("otel", "prometheus"):
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ImportError:  # its library is not installed: that exporter is simply off
            continue
        except Exception as e:  # noqa: BLE001 - a broken exporter module must not stop the store
            logger.warning("attn-otel: exporter %s is off: %s: %s", module, type(e).__name__, e)
            continue
        factory = getattr(mod, "from_config", None)
        if factory is None:
            continue
        try:
            exp = factory(config)
        except Exception as e:  # noqa: BLE001 - a misconfigured exporter must not stop the store
            logger.warning("attn-otel: exporter %s is off: %s", module, e)
            continue
        if exp is not None:
            exporters.append(exp)
    return FanOut(exporters)
