"""The Zarr writer as a process of its own, so storage work never holds the engine process's GIL.

Protocol (no pickle crosses the process boundary): the engine process puts a capture's arrays into one
POSIX shared-memory segment and writes one JSON line on the writer's stdin::

    {"id": 7, "shm": "psm_...", "record": {...CaptureRecord fields...},
     "arrays": {"per_row": [offset, shape, dtype], "maps": [...], "token_ids": [...], "vision_mask": [...]},
     "metrics": {"entropy": 0, ...}}          (metric name -> its row in per_row)

An array entry with a fourth element, ``[offset, shape, dtype, "psm_..."]``, lies in that segment instead
(the engine's maps pool, :mod:`attn_otel.hostmem`; read in place, owned and reused by the engine side).

or, for a capture summarised on the device (no per-row metrics stored), ``"summary"`` ``[part, metric, stat,
layer, head]`` in place of ``"per_row"``.

The writer maps the segment read-only into NumPy views, runs the exporters on the capture (the Zarr store
first, marker last; then OpenTelemetry and Prometheus, see :mod:`attn_otel.exporters`) and answers one JSON
line on stdout: ``{"id": 7, "ok": true, "bytes": N, "errors": {exporter: message}}`` or
``{"id": 7, "ok": false, "error": "..."}`` when the message itself could not be read.
The engine side unlinks the segment after the answer.  EOF on stdin ends the writer.

Several captures (a finish batch's, none with maps) may come in one line, ``{"shm": "psm_...", "batch": [msg,
...]}``, each ``msg`` as above with its arrays in that one segment: the answer is ``{"batch": [reply, ...]}``,
one reply per capture in the same order, each as above.

Started as a process, the writer first imports what it needs and builds its exporters, then says
``{"ready": true}`` on stdout: the engine side's per-capture timeout (``ATTN_OTEL_WRITER_TIMEOUT_S``)
counts from there, so a slow start (a loaded machine, a cold import cache) is not a hung writer.
"""

from __future__ import annotations

import json
import sys


def os_thread_name(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) in the OS too, so ``top -H``, ``py-spy`` and
    /proc show attn-otel's threads and writer processes by name.  Linux only; best effort.  (Here, not in
    the capture engine, so that the writer process names itself without importing torch.)"""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is a convenience
        pass


def _attach(name: str):
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(name=name, create=False)
    try:  # the creator owns (and unlinks) the segment; this process must not track it (Python < 3.13)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    return shm


def _config(store_url: str, config_json: str | None):
    from .config import Config

    if not config_json:
        return Config.from_env(store=store_url)
    fields = json.loads(config_json)
    if isinstance(fields.get("layers"), list):
        fields["layers"] = tuple(fields["layers"])
    return Config(**{**fields, "store": store_url})


def serve(store_url: str, stdin=None, stdout=None, config_json: str | None = None, announce: bool = False) -> None:
    """Answer capture messages from ``stdin`` until EOF; ``announce``: build the exporters first and say
    ``{"ready": true}`` (a writer process does; see the module's docstring)."""
    import numpy as np

    from .exporters import ExportItem, build_exporters
    from .metrics import summary_only
    from .store import CaptureRecord

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    fanout = None
    if announce:
        try:
            fanout = build_exporters(_config(store_url, config_json))
        except Exception:  # noqa: BLE001 - built (and its failure reported) with the first capture instead
            fanout = None
        stdout.write(json.dumps({"ready": True}) + "\n")
        stdout.flush()

    def one(msg: dict, shm) -> dict:
        """Store and export one capture whose arrays are in ``shm`` (and in their own segments where named)."""
        nonlocal fanout
        msg_id = msg.get("id")
        extra: list = []
        views: dict = {}
        try:
            for name, (off, shape, dtype, *own) in msg["arrays"].items():
                buf = shm.buf
                if own:  # an array in a segment of its own (maps: attn_otel.hostmem's pool, read in place)
                    extra.append(_attach(own[0]))
                    buf = extra[-1].buf
                views[name] = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=buf, offset=int(off))
            per_row = views.get("per_row")
            summary = None
            if per_row is not None:
                metrics = {name: per_row[int(i)] for name, i in msg.get("metrics", {}).items()}
            elif views.get("summary") is not None:  # summarised on the device: no rows
                metrics, summary = summary_only(views["summary"], list(msg.get("metrics", {})))
            else:
                metrics = {}
            rec = CaptureRecord(**msg["record"], token_ids=views.get("token_ids"), maps=views.get("maps"),
                                vision_mask=views.get("vision_mask"), metrics=metrics)
            if fanout is None:
                fanout = build_exporters(_config(store_url, config_json))
            item = ExportItem(rec, latency_s=float(msg.get("latency_s", 0.0)), _summary=summary)
            errors = fanout.export(item)
            reply = {"id": msg_id, "ok": True, "bytes": item.bytes_written, "errors": errors,
                     "complete": item.complete, "maps_stored": bool(item.maps_stored)}
            del per_row, metrics, rec, item
        except Exception as e:  # noqa: BLE001 - reported to the engine side, which counts it
            reply = {"id": msg_id, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            views.clear()  # the segments' views go first, so that they can close
            for seg in extra:
                try:
                    seg.close()
                except BufferError:  # a view still alive: the mapping goes with the process
                    pass
        return reply

    for line in stdin:
        if not line.strip():
            continue
        shm = None
        msg: dict = {}
        try:
            msg = json.loads(line)
            shm = _attach(msg["shm"])
            if "batch" in msg:
                reply = {"batch": [one(m, shm) for m in msg["batch"]]}
            else:
                reply = one(msg, shm)
        except Exception as e:  # noqa: BLE001 - the message itself could not be read
            reply = {"id": msg.get("id") if isinstance(msg, dict) else None, "ok": False,
                     "error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            if shm is not None:
                try:
                    shm.close()
                except BufferError:  # a view still alive: the mapping goes with the process
                    pass
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
    if fanout is not None:
        fanout.shutdown()


if __name__ == "__main__":
    os_thread_name("attn-otel-wproc")  # in top and /proc, not one more "python3"
    serve(sys.argv[1], config_json=sys.argv[2] if len(sys.argv) > 2 else None, announce=True)
