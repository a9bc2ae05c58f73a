"""bench/overhead.py --env: one attn-otel switch on top of each capturing phase, so that an A/B of a switch
(bench/online_ab.sh's ``new@ATTN_OTEL_X=V``) reaches the engine; the phases clear every other ATTN_OTEL variable,
which is how session 40 found the first such A/B had measured the default twice."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import overhead  # noqa: E402


@pytest.fixture(autouse=True)
def _clean():
    overhead.EXTRA_ENV.clear()
    yield
    overhead.EXTRA_ENV.clear()


def test_a_switch_reaches_every_capturing_phase_but_not_the_reference(tmp_path):
    assert overhead.main(["--env", "ATTN_OTEL_AFTER_LAUNCH=0", "--out", str(tmp_path)]) == 0
    assert overhead._phase_env("default") == {"ATTN_OTEL": "1", "ATTN_OTEL_AFTER_LAUNCH": "0"}
    assert overhead._phase_env("all")["ATTN_OTEL_AFTER_LAUNCH"] == "0"
    assert overhead._phase_env("all")["ATTN_OTEL_LAYERS"] == "all"
    assert overhead._phase_env("off") == {}  # the ratios' reference stays capture off


def test_a_phase_keeps_its_own_variables_without_a_switch(tmp_path):
    assert overhead.main(["--out", str(tmp_path)]) == 0
    assert overhead._phase_env("default-nomaps") == {"ATTN_OTEL": "1", "ATTN_OTEL_MAPS_SAMPLE": "0"}


@pytest.mark.parametrize("bad", ["AFTER_LAUNCH=0", "ATTN_OTEL_AFTER_LAUNCH", "VLLM_X=1"])
def test_a_switch_that_is_not_an_attn_otel_assignment_is_refused(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as e:
        overhead.main(["--env", bad, "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "ATTN_OTEL_NAME=VALUE" in capsys.readouterr().err
    assert overhead.EXTRA_ENV == {}


def test_the_report_median_of_an_even_count_is_the_mean_of_the_middle_two():
    runs = [{"x": v} for v in (4.0, 1.0, 3.0, 2.0)] + [{"x": None}, {}]
    assert overhead._median(runs, "x") == 2.5
    assert overhead._median(runs[:3], "x") == 3.0
    assert overhead._median([{}], "x") is None


def test_online_ab_profile_refuses_a_bad_phase_or_a_missing_py_spy(tmp_path):
    """bench/online_ab.sh profile: a phase other than off, default or old (the old checkout's default; with or
    without a variable for it; off takes none), or no py-spy wheel to unpack, is a clear message and a failing exit before anything is staged
    or served."""
    import os
    import subprocess

    script = str(Path(__file__).resolve().parent.parent / "bench" / "online_ab.sh")
    for args, says in ((["profile"], "give the phase, off, default or old"),
                       (["profile", "all"], "not 'all'"),
                       (["profile", "all@ATTN_OTEL_LAUNCH=jit"], "not 'all'"),
                       (["profile", "off@ATTN_OTEL_LAUNCH=jit"], "a variable is for the default"),
                       (["profile", "default@ATTN_OTEL_LAUNCH=jit"], "no py-spy wheel in .gpu/scripts"),
                       (["profile", "off"], "no py-spy wheel in .gpu/scripts"),
                       (["profile", "old"], "no py-spy wheel in .gpu/scripts")):
        r = subprocess.run(["bash", script, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYSPY_DIR": str(tmp_path / "pyspy")})
        assert r.returncode != 0 and says in r.stdout, (args, r.stdout, r.stderr)


def test_online_ab_needs_a_capacity_before_a_capturing_server(tmp_path):
    """bench/online_ab.sh ab: the load is 80% of the capacity the "off" step measured on this machine; with none
    measured (and no CAPACITY), a clear message and a failing exit before any server starts."""
    import os
    import subprocess

    script = str(Path(__file__).resolve().parent.parent / "bench" / "online_ab.sh")
    env = {**{k: v for k, v in os.environ.items() if k != "CAPACITY"}, "AB_OFF_JSON": str(tmp_path / "none.json")}
    r = subprocess.run(["bash", script, "ab", "1", "new"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode != 0 and "no capacity measured on this machine yet" in r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("cached", [False, True])
def test_online_ab_gives_a_fresh_machines_first_server_the_compile_time(tmp_path, cached):
    """bench/online_ab.sh ab on a machine with no vLLM compile cache (a fresh one, after the last was given back):
    its first server's time limit has the ~220 s compile on top, the servers after it the usual limit (225 s +
    20 s a run); with a cache, every server the usual one.  The limit is read off the ``timeout`` the script calls
    (a stand-in on PATH that notes its first argument), so no server starts."""
    import shutil
    import os
    import subprocess

    script = str(Path(__file__).resolve().parent.parent / "bench" / "online_ab.sh")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    limits_file = tmp_path / "limits"
    (bin_ / "timeout").write_text(f'#!/bin/sh\necho "$1" >> {limits_file}\n')
    (bin_ / "timeout").chmod(0o755)
    home = tmp_path / "home"
    if cached:
        (home / ".cache" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    env = {**{k: v for k, v in os.environ.items() if k not in ("VLLM_CACHE_ROOT", "SERVER_TIMEOUT_S")},
           "PATH": f"{bin_}:{os.environ['PATH']}", "HOME": str(home), "CAPACITY": "40", "REPEATS": "3",
           "OUT": str(tmp_path / "out")}
    run = "9917"  # the script's scratch is /tmp/ab/NAME-RUN: a call number no real call uses, removed after
    try:
        r = subprocess.run(["bash", script, "ab", run, "new", "new@ATTN_OTEL_LAUNCH=jit"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, env=env)
    finally:
        for name in ("new", "new-ATTN_OTEL_LAUNCH_jit"):
            shutil.rmtree(f"/tmp/ab/{name}-{run}", ignore_errors=True)
            Path(f"/tmp/ab/{name}-{run}.log").unlink(missing_ok=True)
        try:
            Path("/tmp/ab").rmdir()  # if this test made it
        except OSError:
            pass
    limits = [int(x) for x in limits_file.read_text().split()]
    assert limits == ([285, 285] if cached else [525, 285]), (r.stdout, r.stderr)
    assert ("no vLLM compile cache" in r.stdout) is not cached
