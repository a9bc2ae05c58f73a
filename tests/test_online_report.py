"""bench/online_report.py: the online A/B's tables from its raw files, checked against NumPy on runs made up
here, and against the figures the current report (docs/benchmarks/overhead.json) took from the same raw
call; bad input is refused by name."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "online_report.py"
sys.path.insert(0, str(ROOT / "bench"))
import online_report  # noqa: E402

KEYS = online_report.KEYS


def _server(rng, n, scale=1.0, **extra):
    runs = [{k: float(rng.uniform(0.5, 1.5) * scale) for k in KEYS} | {"slo_met": 1.0} for _ in range(n)]
    return {"runs": runs, "device": "test device", **extra}


def _write_ab(d: Path, rng, n=6):
    d.mkdir()
    servers = {"off": _server(rng, n)}
    for name in ("new-ATTN_OTEL_AFTER_LAUNCH_0-1", "new-1", "new-2", "new-ATTN_OTEL_AFTER_LAUNCH_0-2"):
        servers[name] = _server(rng, n, 1.1, capture={"step_times": {"p50": 0.001, "p90": 0.002, "p99": 0.004},
                                                      "step_host_s": {"schedule": 1.0, "after_launch": 0.5},
                                                      "captured": 10, "dropped": {"x": 1}})
    (d / "online-off.json").write_text(json.dumps(servers["off"]))
    for name, s in servers.items():
        if name != "off":
            (d / f"online-default-{name}.json").write_text(json.dumps(s))
    return servers


def test_ratios_pooled_and_paired_by_seed_are_numpys(tmp_path):
    rng = np.random.default_rng(7)
    servers = _write_ab(tmp_path / "ab", rng)
    a = online_report.analyse(*online_report.from_dir(tmp_path / "ab"))
    off = {k: np.array([r[k] for r in servers["off"]["runs"]]) for k in KEYS}
    # servers in the order they ran: by the run number, then by name
    assert [r["server"] for r in a["servers"]] == ["new-1", "new-ATTN_OTEL_AFTER_LAUNCH_0-1", "new-2",
                                                   "new-ATTN_OTEL_AFTER_LAUNCH_0-2"]
    assert set(a["configs"]) == {"new", "new-ATTN_OTEL_AFTER_LAUNCH_0"}
    for cfg in a["configs"]:
        mine = [servers[f"{cfg}-{i}"]["runs"] for i in (1, 2)]
        for k in online_report.RATIO_KEYS:
            pooled = np.array([r[k] for g in mine for r in g])
            assert a["configs"][cfg]["ratio"][k] == pytest.approx(np.median(pooled) / np.median(off[k]), rel=1e-12)
            paired = np.concatenate([np.array([r[k] for r in g]) / off[k] for g in mine])
            assert a["configs"][cfg]["paired_ratio"][k] == pytest.approx(np.median(paired), rel=1e-12)
    row = a["servers"][0]
    assert row["ratio"]["itl_p99_s"] == pytest.approx(
        np.median([r["itl_p99_s"] for r in servers["new-1"]["runs"]]) / np.median(off["itl_p99_s"]), rel=1e-12)
    assert (row["host_before_s"], row["host_after_s"], row["dropped"]) == (1.0, 0.5, 1)


def test_several_off_servers_pool_into_the_reference_and_each_meets_the_others(tmp_path):
    """Three capture-off servers (setup's and two from ``ab N off``): the reference pools their runs (paired by
    seed: the median of the off runs of that seed), and each off server is a row against the other two."""
    rng = np.random.default_rng(11)
    servers = _write_ab(tmp_path / "ab", rng, n=5)
    offs = {"off": servers["off"]}
    for run in (1, 3):
        offs[f"off-{run}"] = _server(rng, 5)
        (tmp_path / "ab" / f"online-off-{run}.json").write_text(json.dumps(offs[f"off-{run}"]))
    got_offs, got_servers = online_report.from_dir(tmp_path / "ab")
    assert [n for n, _ in got_offs] == ["off", "off-1", "off-3"] and len(got_servers) == 4
    a = online_report.analyse(got_offs, got_servers)
    runs = {n: {k: np.array([r[k] for r in s["runs"]]) for k in KEYS} for n, s in offs.items()}
    assert a["off"]["servers"] == 3 and a["off"]["runs"] == 15
    for k in online_report.RATIO_KEYS:
        pooled = np.concatenate([runs[n][k] for n in offs])
        by_seed = np.median(np.stack([runs[n][k] for n in offs]), axis=0)
        mine = np.array([r[k] for r in servers["new-2"]["runs"]])
        new = [servers[f"new-{i}"]["runs"] for i in (1, 2)]
        assert a["off"]["median"][k] == pytest.approx(np.median(pooled), rel=1e-12)
        assert a["configs"]["new"]["paired_ratio"][k] == pytest.approx(
            np.median(np.concatenate([np.array([r[k] for r in g]) / by_seed for g in new])), rel=1e-12)
        row = next(r for r in a["servers"] if r["server"] == "new-2")
        assert row["ratio"][k] == pytest.approx(np.median(mine) / np.median(pooled), rel=1e-12)
        # off-1 against off and off-3 only
        others = np.concatenate([runs["off"][k], runs["off-3"][k]])
        row = next(r for r in a["servers"] if r["server"] == "off-1")
        assert row["config"] == online_report.OFF_VS_OFF
        assert row["ratio"][k] == pytest.approx(np.median(runs["off-1"][k]) / np.median(others), rel=1e-12)
        each = np.array([np.median(runs[n][k]) / np.median(np.concatenate([runs[m][k] for m in offs if m != n]))
                         for n in offs])
        farthest = each[np.argmax(np.abs(np.log(each)))]
        assert a["configs"][online_report.OFF_VS_OFF]["ratio"][k] == pytest.approx(farthest, rel=1e-12)
        seedwise = np.array([np.median(runs[n][k] / np.median(np.stack([runs[m][k] for m in offs if m != n]), axis=0))
                             for n in offs])
        assert a["configs"][online_report.OFF_VS_OFF]["paired_ratio"][k] == pytest.approx(
            seedwise[np.argmax(np.abs(np.log(seedwise)))], rel=1e-12)
    text = online_report.markdown(a)
    assert "| off, 3 servers pooled | 15 |" in text and "| off vs off | 3, 15 |" in text
    assert re.search(r"\| off-3 \| 5 \| .* \| \| \| \| \| \|$", text, re.M)


def test_the_current_reports_online_figures_come_back_from_its_raw_call(tmp_path):
    """overhead.json's online row is run 48's call (off, then the default, on one machine), whose two servers are
    docs/benchmarks/online-off.json and online-default.json."""
    bench = ROOT / "docs" / "benchmarks"
    servers = [(name, json.loads((bench / f"online-{name}.json").read_text())) for name in ("off", "default")]
    a = online_report.analyse(*online_report._split(servers, None, str(bench)))
    online = json.loads((bench / "overhead.json").read_text())["workloads"]["online"]
    got = a["configs"]["default"]["ratio"]
    assert got["itl_p99_s"] == pytest.approx(online["itl_p99_ratio"], rel=1e-9)
    assert got["ttft_p99_s"] == pytest.approx(online["ttft_p99_ratio"], rel=1e-9)
    assert got["goodput_req_s"] == pytest.approx(online["goodput_req_ratio"]["default"], rel=1e-9)
    assert online["ratios"]["all_layers"] is None  # run 48 ran no all-layers server
    assert a["configs"]["default"]["runs"] == 3 and a["configs"]["default"]["servers"] == 1
    assert all(r["dropped"] == 0 and r["slo_met"] == 1.0 for r in a["servers"])


def test_the_command_writes_tables_and_a_plot(tmp_path):
    _write_ab(tmp_path / "ab", np.random.default_rng(1))
    md, png = tmp_path / "t.md", tmp_path / "p.png"
    subprocess.run([sys.executable, str(BENCH), "--dir", str(tmp_path / "ab"), "--md", str(md), "--png", str(png)],
                   check=True, capture_output=True, text=True, timeout=300)
    text = md.read_text()
    servers = [ln.split(" | ")[0][2:] for ln in text.splitlines() if re.match(r"\| new\S*-\d \| 6 \|", ln)]
    assert servers == ["new-1", "new-ATTN_OTEL_AFTER_LAUNCH_0-1", "new-2", "new-ATTN_OTEL_AFTER_LAUNCH_0-2"]
    assert "| off | 6 |" in text  # a row a server, then the pooled rows
    assert "| new | 2, 12 |" in text and "| new-ATTN_OTEL_AFTER_LAUNCH_0 | 2, 12 |" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.parametrize("case, message", [
    ("no-off", "no online-off.json"),
    ("bad-name", "not online-default-NAME-RUN.json"),
    ("bad-off", "not online-off.json or online-off-RUN.json"),
    ("more-runs", "cannot be paired by seed"),
    ("no-key", "no call '99'"),
])
def test_bad_input_is_refused_by_name(tmp_path, case, message):
    rng = np.random.default_rng(3)
    d = tmp_path / "ab"
    args = ["--dir", str(d)]
    if case == "no-key":
        args = ["--collection", str(ROOT / "tests" / "data" / "bench" / "online-ab-2026-11-26.json"), "--key", "99"]
    else:
        _write_ab(d, rng)
        if case == "no-off":
            (d / "online-off.json").unlink()
        elif case == "bad-name":
            (d / "online-default-x.json").write_text("{}")
        elif case == "bad-off":
            (d / "online-off-x.json").write_text("{}")
        else:
            (d / "online-default-new-3.json").write_text(json.dumps(_server(rng, 7)))
    p = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_several_calls_make_one_table_each_and_one_plot(tmp_path):
    """``--key 32a,32b,32c``: run 32's three machines, each call's tables under its key, one plot of a column a
    call; each call's pooled default is the one its own report gives."""
    col = ROOT / "tests" / "data" / "bench" / "online-ab-2026-11-27.json"
    md, png = tmp_path / "t.md", tmp_path / "p.png"
    subprocess.run([sys.executable, str(BENCH), "--collection", str(col), "--key", "32a,32b,32c", "--md", str(md),
                    "--png", str(png)], check=True, capture_output=True, text=True, timeout=300)
    text = md.read_text()
    assert [ln for ln in text.splitlines() if ln.startswith("## ")] == ["## 32a", "## 32b", "## 32c"]
    for key in ("32a", "32b", "32c"):
        a = online_report.analyse(*online_report.from_collection(col, key))
        x = a["configs"]["new"]["ratio"]
        section = text.split(f"## {key}\n")[1].split("## ")[0]
        assert f"| new | 1, {a['configs']['new']['runs']} | x{x['itl_p50_s']:.3f} / x{x['itl_p99_s']:.3f} |" in section
    assert "| off vs off | 2, 8 |" in text.split("## 32b")[0]  # 32a: two capture-off servers
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_configuration_can_be_the_reference_instead_of_capture_off(tmp_path):
    """``--reference old``: run 37b (no capture-off server) and 37a (one) against the old code's server, every
    ratio paired by seed as against off (checked with NumPy on the raw runs); capture off is then a row like any
    other; a configuration the call does not have is refused by name."""
    col = ROOT / "tests" / "data" / "bench" / "online-ab-2026-11-28.json"
    doc = json.loads(col.read_text())
    for key, new in (("37b", "new-2"), ("37a", "new-1")):
        a = online_report.analyse(*online_report.from_collection(col, key, "old"), "old")
        old = [n for n in doc[key]["order"] if n.startswith("old")][0]
        o, n = doc[key]["phases"][old]["runs"], doc[key]["phases"][new]["runs"]
        for k in ("itl_p99_s", "ttft_p99_s"):
            want = float(np.median([x[k] / y[k] for x, y in zip(n, o)]))
            assert a["configs"]["new"]["paired_ratio"][k] == pytest.approx(want, rel=1e-12)
        assert a["off"]["label"] == "old" and ("off" in a["configs"]) == (key == "37a")
    md = tmp_path / "t.md"
    subprocess.run([sys.executable, str(BENCH), "--collection", str(col), "--key", "37b", "--reference", "old", "--md",
                    str(md)], check=True, capture_output=True, text=True, timeout=300)
    assert md.read_text().startswith("old: 4 runs (1 server)") and "| new | 1, 4 |" in md.read_text()
    p = subprocess.run([sys.executable, str(BENCH), "--collection", str(col), "--key", "37b", "--reference", "gone"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "no server of configuration 'gone' (it has old, new)" in p.stderr, p.stderr
