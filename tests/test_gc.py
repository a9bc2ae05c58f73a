"""Partial captures (a writer killed with ``kill -9`` mid-capture) stay invisible to readers, and
``attn-otel gc`` removes them and, on request, old complete captures: the same tests on every store."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import synthetic
from synthetic import make_record, write

from attn_otel import cli
from attn_otel.ids import new_trace_id
from attn_otel.reader import TraceNotFound, list_captures, open_trace
from attn_otel.store import (MARKER, capture_prefix, collect_garbage, list_partial, list_trace_ids,
                             open_zarr_store)

DAY = 86400.0


def kill_writer_mid_capture(backend, trace_id: str, request_id: str = "killed") -> dict[str, int]:
    """Start a writer of a large capture in a process of its own, ``kill -9`` it as soon as some of its
    chunks are in the store, and return ``{key: size}`` of what it left."""
    prefix = capture_prefix(trace_id, request_id)
    # 4 layers x 9 heads x T=1024: 144 chunk objects of 512 KiB, far more than one poll interval to write.
    proc = subprocess.Popen([sys.executable, synthetic.__file__, backend.url, trace_id, request_id, "4", "9", "1024"],
                            env={**os.environ, **backend.env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not backend.keys(f"{prefix}/attn/c/"):
            assert proc.poll() is None, f"writer exited ({proc.returncode}) first: {proc.stderr.read()[-2000:]!r}"
            assert time.monotonic() < deadline, "the writer wrote no chunk within 120 s"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    # An upload the server had already received can still land after the kill (S3: moto finishing a PUT):
    # what the writer left is the listing once it stops changing.
    left = backend.keys(f"{prefix}/")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = backend.keys(f"{prefix}/")
        if again == left:
            break
        left = again
    assert f"{prefix}/{MARKER}" not in left, "the writer finished before the kill: make the capture bigger"
    assert 0 < sum(k.startswith(f"{prefix}/attn/c/") for k in left) < 144
    return left


def gc(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["gc", *args])
    out, err = capsys.readouterr()
    return rc, out + err


class GcContract:
    """Subclasses provide a ``backend`` fixture (see tests/test_store.py)."""

    def test_a_writer_killed_mid_capture_leaves_nothing_readers_see(self, backend, capsys):
        done, _ = make_record()
        write(backend.url, done)
        killed = new_trace_id()
        kill_writer_mid_capture(backend, killed)

        assert [c.trace_id for c in list_captures(backend.url)] == [done.trace_id]
        with pytest.raises(TraceNotFound):
            open_trace(killed, backend.url)
        capsys.readouterr()
        assert cli.main(["ls", "--json", "--store", backend.url]) == 0
        assert [row["trace_id"] for row in json.loads(capsys.readouterr().out)] == [done.trace_id]
        assert [(c.trace_id, c.key) for c in list_partial(open_zarr_store(backend.url))] == [(killed, "killed")]

    def test_gc_removes_what_a_killed_writer_left_after_the_grace_period(self, backend, capsys):
        done, _ = make_record()
        write(backend.url, done)
        killed = new_trace_id()
        left = kill_writer_mid_capture(backend, killed)

        rc, out = gc(capsys, "--store", backend.url)  # default grace: a fresh partial may still be in flight
        assert rc == 0 and "removed 0 captures" in out
        rc, out = gc(capsys, "--store", backend.url, "--grace", "0", "--dry-run")
        assert rc == 0 and f"would remove partial  traces/{killed}/killed" in out
        assert f"would free {sum(left.values())} bytes" in out
        assert backend.keys(f"traces/{killed}/killed/") == left

        rc, out = gc(capsys, "--store", backend.url, "--grace", "0")
        assert rc == 0 and "removed 1 captures (1 partial, 0 complete)" in out
        assert f"freed {sum(left.values())} bytes" in out
        assert backend.keys(f"traces/{killed}/") == {}  # the trace's group metadata went with its last capture
        assert list_trace_ids(open_zarr_store(backend.url)) == [done.trace_id]
        assert open_trace(done.trace_id, backend.url)[0].request_id == done.request_id

    def test_a_partial_capture_is_kept_within_the_grace_period(self, backend):
        record, _ = make_record()
        write(backend.url, record)
        backend.delete(f"{capture_prefix(record.trace_id, record.request_id)}/{MARKER}")
        store = open_zarr_store(backend.url)
        assert collect_garbage(store, grace_s=600) == []
        assert backend.keys(f"traces/{record.trace_id}/{record.request_id}/")
        (gone,) = collect_garbage(store, grace_s=600, now=time.time() + 601)
        assert (gone.trace_id, gone.key, gone.complete) == (record.trace_id, record.request_id, False)
        assert backend.keys(f"traces/{record.trace_id}/") == {}

    def test_complete_captures_are_kept_without_older_than(self, backend, capsys):
        record, _ = make_record(created=time.time() - 365 * DAY)
        write(backend.url, record)
        rc, out = gc(capsys, "--store", backend.url, "--grace", "0")
        assert rc == 0 and "removed 0 captures" in out
        assert open_trace(record.trace_id, backend.url)

    def test_older_than_removes_only_complete_captures_made_before_then(self, backend, capsys):
        old, _ = make_record(request_id="old", created=time.time() - 8 * DAY)
        new, _ = make_record(request_id="new", created=time.time() - 6 * DAY)
        write(backend.url, old)
        write(backend.url, new)
        stored = backend.keys(f"traces/{old.trace_id}/old/")
        rc, out = gc(capsys, "--store", backend.url, "--older-than", "7d")
        assert rc == 0 and "removed 1 captures (0 partial, 1 complete)" in out
        assert f"removed complete traces/{old.trace_id}/old" in out and f"freed {sum(stored.values())} bytes" in out
        with pytest.raises(TraceNotFound):
            open_trace(old.trace_id, backend.url)
        assert [c.request_id for c in list_captures(backend.url)] == ["new"]

    def test_dry_run_deletes_nothing(self, backend, capsys):
        old, _ = make_record(request_id="old", created=time.time() - 2 * DAY)
        half, _ = make_record(request_id="half")
        write(backend.url, old)
        write(backend.url, half)
        backend.delete(f"{capture_prefix(half.trace_id, 'half')}/{MARKER}")
        before = backend.keys()
        rc, out = gc(capsys, "--store", backend.url, "--grace", "0", "--older-than", "1d", "--dry-run")
        assert rc == 0 and "would remove 2 captures (1 partial, 1 complete)" in out
        assert backend.keys() == before

    def test_other_captures_of_the_trace_are_kept(self, backend):
        trace_id = new_trace_id()
        write(backend.url, make_record(trace_id, "kept")[0])
        write(backend.url, make_record(trace_id, "half")[0])
        backend.delete(f"traces/{trace_id}/half/{MARKER}")
        (gone,) = collect_garbage(open_zarr_store(backend.url), grace_s=0)
        assert gone.key == "half"
        assert [c.request_id for c in open_trace(trace_id, backend.url)] == ["kept"]
        assert not backend.keys(f"traces/{trace_id}/half/")

    def test_foreign_objects_are_never_deleted(self, backend):
        write(backend.url, make_record(created=time.time() - 30 * DAY)[0])
        foreign = {"traces/not-a-trace/req/data": b"x", f"traces/{new_trace_id()}.bak": b"y", "notes.txt": b"z"}
        for key, data in foreign.items():
            backend.put(key, data)
        assert len(collect_garbage(open_zarr_store(backend.url), grace_s=0, older_than_s=0)) == 1
        assert set(foreign) <= set(backend.keys())

    def test_gc_on_a_missing_store_is_one_line_and_creates_nothing(self, backend, capsys):
        rc, out = gc(capsys, "--store", backend.missing_url, "--grace", "0")
        assert rc == 1 and out.count("\n") == 1 and "does not exist" in out
        assert not os.path.exists(backend.missing_url)


class TestLocalGc(GcContract):
    @pytest.fixture
    def backend(self, local_backend):
        return local_backend


class TestS3Gc(GcContract):
    @pytest.fixture
    def backend(self, s3_backend):
        return s3_backend


@pytest.mark.parametrize("text, seconds", [("0", 0), ("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 7 * DAY),
                                           ("2w", 14 * DAY), ("1h30m", 5400), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert cli._duration_arg(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "7x", "d", "-1d", "1d junk"])
def test_a_bad_duration_is_a_usage_error(text, tmp_path, capsys):
    assert cli.main(["gc", "--store", str(tmp_path), f"--older-than={text}"]) == 2
    assert "expected a duration" in capsys.readouterr().err
