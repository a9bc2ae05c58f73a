"""The writer pool: each writer thread of the hand-off runs the exporters for its jobs, in a writer process
of its own (``ATTN_OTEL_WRITER=process``, the default: storage never holds the engine process's GIL) or in
the thread (``thread``).

The protocol with a writer process (:mod:`attn_otel.writer_proc`) is JSON lines plus raw arrays in shared
memory: no pickle crosses.  A writer process that does not answer within ``ATTN_OTEL_WRITER_TIMEOUT_S`` is
killed, its capture counted as ``store_error``, and a new one takes the next capture.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from .attention import KERNEL_METRICS, LEARNED_SINK_ROW, METRICS
from .config import Config, writer_timeout_s
from .handoff import Job
from .metrics import summary_only
from .stats import Stats, WarnOnce
from .store import CaptureRecord, redact_url

START_TIMEOUT_S = 120.0  # a writer process's start (imports, exporters) before it says it is ready


class WriterPool:
    """Writes jobs (from any number of threads, one writer each) and counts what was stored or dropped."""

    def __init__(self, config: Config, stats: Stats, warn: WarnOnce):
        self.config = config
        self.stats = stats
        self._warn = warn
        self.closing = False  # exit is near: a writer process that died is not restarted (the hand-off sets it)
        self._local = threading.local()  # per writer thread: its exporters or its writer process
        self._fanouts: list = []
        self.procs: list[subprocess.Popen] = []

    def write(self, job: Job) -> None:
        """Wait for the job's device work, then store and export it.  Never raises: a failure is counted
        (``store_error``) and logged once per error type."""
        self.write_many([job])

    def write_many(self, jobs: list[Job]) -> None:
        """:meth:`write` for each of ``jobs``; with writer processes, jobs without maps go to this thread's
        writer in one message (one shared-memory segment, one JSON line, one answer with a reply per job), so
        that a finish batch's captures cost the engine's process a few system calls and GIL hand-overs, not a
        round trip each (``bench/writer_contention.py``).  Each job is counted on its own, as with :meth:`write`."""
        ready = []
        for job in jobs:
            try:
                ready.append((job, *self._prepare(job)))
            except Exception as e:  # noqa: BLE001
                self._failed(job, e)
        if self.config.writer != "process":
            for job, rec, names, latency in ready:
                try:
                    reply = self._write_in_thread(rec, job, names, latency)
                except Exception as e:  # noqa: BLE001
                    reply = e
                self._settle(job, reply)
            return
        together = [r for r in ready if r[0].maps is None]  # in one message; each with maps in one of its own
        for items in ([together] if together else []) + [[r] for r in ready if r[0].maps is not None]:
            try:
                replies = self._send(items)
            except Exception as e:  # noqa: BLE001 - the writer died or hung: every job of the message
                replies = [e] * len(items)
            for (job, *_), reply in zip(items, replies):
                self._settle(job, reply)

    def _prepare(self, job: Job) -> tuple[CaptureRecord, list[str], float]:
        """The job's record once its device work is done, the metric names it has, and its latency so far."""
        if job.event is not None:
            job.event.synchronize()
        if job.keep is not None:
            if job.per_row is not None:
                job.per_row = job.per_row[:, job.keep]
            if job.summary is not None:
                job.summary = job.summary[:, :, :, job.keep]
        latency = time.perf_counter() - job.t_finish
        self.stats.latencies.append(latency)
        rec = job.record
        if job.token_ids is not None:
            rec.token_ids = job.token_ids.numpy().astype(np.int32)
        # the rows a capture has: KERNEL_METRICS, and the learned sink mass where a layer has learned sinks
        # (attn_otel.compute keeps that row only then; a summary has it defined only then)
        if job.per_row is not None:
            width = job.per_row.shape[0]
        else:
            sink_row = job.summary[:, LEARNED_SINK_ROW] if job.summary is not None else None
            width = (len(METRICS) if sink_row is not None and bool(torch.isfinite(sink_row).any())
                     else len(KERNEL_METRICS))
        names = [name for name in METRICS[:width]
                 if name not in ("vision_share", "vision_share_norm") or rec.attrs.get("vision")]
        return rec, names, latency

    def _settle(self, job: Job, reply: dict | Exception) -> None:
        """Count what the writer answered for ``job`` (or the exception that took it)."""
        try:
            if isinstance(reply, Exception):
                raise reply
            if not reply.get("ok", True):
                raise RuntimeError(f"writer process: {reply.get('error')}")
            errors = dict(reply.get("errors") or {})
            store_error = errors.pop("zarr", None)
            for name in errors:
                self.stats.add("export_errors", reason=name)
            if store_error is not None:
                raise RuntimeError(store_error)
            if reply.get("complete", True):  # a parallel capture counts once, on the part that completed it
                self.stats.add("stored")
                if reply.get("maps_stored", job.maps is not None):
                    self.stats.add("maps_stored")
            self.stats.add("bytes_written", int(reply.get("bytes", 0)))
            self.stats.write_latencies.append(time.perf_counter() - job.t_finish)
        except Exception as e:  # noqa: BLE001
            self._failed(job, e)

    def _failed(self, job: Job, e: Exception) -> None:
        self.stats.add("dropped", reason="store_error")
        self._warn(f"store:{type(e).__name__}", "writing capture of request %s to %s failed: %s "
                   "(dropped and counted; logged once per error type)", job.record.request_id,
                   redact_url(self.config.store), e)

    def _write_in_thread(self, rec: CaptureRecord, job: Job, names: list[str], latency: float) -> dict:
        from .exporters import ExportItem, build_exporters

        summary = None
        if job.per_row is not None:
            per_row = job.per_row.numpy()
            rec.metrics = {name: per_row[METRICS.index(name)] for name in names}
        else:
            rec.metrics, summary = summary_only(job.summary.numpy(), names)
        rec.maps = job.maps.numpy() if job.maps is not None else None
        fanout = getattr(self._local, "fanout", None)
        if fanout is None:
            fanout = self._local.fanout = build_exporters(self.config)
            self._fanouts.append(fanout)
        item = ExportItem(rec, latency_s=latency, _summary=summary)
        errors = fanout.export(item)
        return {"ok": True, "bytes": item.bytes_written, "errors": errors, "complete": item.complete,
                "maps_stored": bool(item.maps_stored)}

    def _send(self, items: list[tuple[Job, CaptureRecord, list[str], float]]) -> list[dict]:
        """Hand the captures to this thread's writer process, blocking this (writer-feeding) thread, not the
        engine, until it answers: their arrays through one shared-memory segment, the rest as one JSON line (a
        capture's message, or several in ``{"shm", "batch"}``); returns the writer's reply for each capture."""
        from multiprocessing import shared_memory

        packed, offset = [], 0
        for job, rec, names, latency in items:
            arrays: dict[str, tuple[torch.Tensor | np.ndarray, str]] = (
                {"per_row": (job.per_row, "float32")} if job.per_row is not None
                else {"summary": (job.summary, "float32")})
            if job.maps is not None and job.maps_seg is None:
                arrays["maps"] = (job.maps, "float16")
            if rec.token_ids is not None:
                arrays["token_ids"] = (np.asarray(rec.token_ids, dtype=np.int32), "int32")
            if rec.vision_mask is not None:
                arrays["vision_mask"] = (np.asarray(rec.vision_mask, dtype=bool), "bool")
            layout = {}
            for name, (a, dtype) in arrays.items():
                nbytes = int(np.prod(a.shape)) * np.dtype(dtype).itemsize
                layout[name] = [offset, list(a.shape), dtype]
                offset += (nbytes + 63) // 64 * 64
            packed.append((job, rec, names, latency, arrays, layout))
        shm = shared_memory.SharedMemory(create=True, size=max(offset, 64))
        try:
            msgs = []
            for job, rec, names, latency, arrays, layout in packed:
                for name, (a, dtype) in arrays.items():
                    off, shape, _ = layout[name]
                    view = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=shm.buf, offset=off)
                    if isinstance(a, torch.Tensor):
                        torch.from_numpy(view).copy_(a)  # torch releases the GIL for the copy
                    else:
                        view[...] = a
                    del view
                meta = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)
                        if f.name not in ("token_ids", "maps", "metrics", "vision_mask")}
                meta["layers"] = [int(x) for x in meta["layers"]]
                if rec.part is not None:
                    meta["part"] = rec.part.to_json()
                if job.maps_seg is not None:  # read in place, from its own segment
                    layout["maps"] = [0, list(job.maps.shape), "float16", job.maps_seg.name]
                msgs.append({"id": id(job), "shm": shm.name, "record": meta, "arrays": layout,
                             "metrics": {name: METRICS.index(name) for name in names}, "latency_s": latency})
            if len(msgs) == 1:
                return [self._call(json.dumps(msgs[0]))]
            reply = self._call(json.dumps({"shm": shm.name, "batch": msgs}), len(msgs))
            replies = reply.get("batch")
            if not isinstance(replies, list) or len(replies) != len(msgs):
                raise RuntimeError(f"writer process: {reply.get('error') or 'no reply per capture'}")
            return replies
        finally:
            shm.close()
            shm.unlink()

    def _call(self, line: str, captures: int = 1) -> dict:
        """One request/answer with this thread's writer process, started (or restarted once) as needed; the
        answer may take ``ATTN_OTEL_WRITER_TIMEOUT_S`` for each of the message's ``captures``."""
        timeout = writer_timeout_s(self.config) * max(1, int(captures))
        for _ in range(2):  # a writer that died is restarted once per capture
            proc = getattr(self._local, "proc", None)
            if proc is None or proc.poll() is not None:
                if proc is not None and self.closing:
                    raise RuntimeError("the writer process is gone at shutdown")  # killed by close(): no restart
                if proc is not None:
                    self._warn("writer-died", "the writer process exited (%s); restarting it", proc.returncode)
                proc = self._local.proc = self._start()
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                # A writer that hangs (a stuck store client, a stopped process) must not hold this writer
                # thread for ever: past the deadline it is killed, this capture is counted, the next one
                # gets a fresh writer.
                if not select.select([proc.stdout], [], [], timeout)[0]:
                    proc.kill()
                    self._warn("writer-hung", "a writer process did not answer within %.0f s "
                               "(ATTN_OTEL_WRITER_TIMEOUT_S); killed, a new one takes the next capture", timeout)
                    raise RuntimeError(f"the writer process did not answer within {timeout:.0f} s; killed")
                answer = proc.stdout.readline()
                if answer:
                    return json.loads(answer)
            except (BrokenPipeError, OSError, ValueError):
                pass
            proc.kill()
        raise RuntimeError("the writer process does not answer")

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        if self.config.stats_dir:
            env["ATTN_OTEL_STATS_DIR"] = self.config.stats_dir  # an explicit Config wins
        config = json.dumps(dataclasses.asdict(self.config))  # the writer uses this very Config
        # -P: attn-otel as installed, never a folder of that name in the current directory (a source checkout's
        # attn_otel/ lacks the exporters subpackage, which lives in its top-level exporters/).
        proc = subprocess.Popen([sys.executable, "-P", "-m", "attn_otel.writer_proc", self.config.store, config],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.procs.append(proc)
        # The per-capture timeout counts from its "ready": a start slowed by a loaded machine is not a hang.
        ready = select.select([proc.stdout], [], [], START_TIMEOUT_S)[0] and proc.stdout.readline()
        try:
            if not (ready and json.loads(ready).get("ready")):
                raise ValueError(ready)
        except ValueError:
            proc.kill()
            raise RuntimeError(f"the writer process did not start within {START_TIMEOUT_S:.0f} s "
                               f"(exit status {proc.poll()})") from None
        return proc

    def close(self, deadline: float) -> None:
        """Let the exporters flush and stop by ``deadline`` (``time.monotonic()``): in-thread exporters shut
        down, writer processes get EOF (they shut their exporters down and exit) and are killed past it."""
        fanouts, self._fanouts = self._fanouts, []
        for fanout in fanouts:
            fanout.shutdown()
        procs, self.procs = self.procs, []
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.stdin.close()  # EOF: the writer shuts its exporters down (spans are flushed), exits
                except OSError:
                    pass
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
