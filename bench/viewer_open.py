"""How long the viewer takes to open a 4k-token capture, as a file and served; and the README's screenshot.

    python bench/viewer_open.py [--tokens 4096] [--store DIR] [--runs 3] [-o docs/benchmarks/viewer-open.json]
    python bench/viewer_open.py --screenshot docs/img/viewer.png --store STORE --trace TRACE_ID \\
        [--tokenizer DIR] [--view 'layer=19&head=mean&log=1&q=50']

The capture: SmolLM2-135M's shape (4 map layers of 30, 9 heads, head_dim 64) at ``--tokens`` tokens, 128 of
them generated, written by attn-otel's own store (float16 maps, chunks of 256 query rows).  Its maps come
from attn-otel's own math (attn_otel.attention) on synthetic queries and keys built to look like a
trained model's: a random walk of token states (neighbours attend to each other) and a sink direction on
token 0.  Token ids are stored, so the axes and the text carry labels (ids: no tokenizer here).

Opening means: from the browser's navigation start to the first map drawn (the page's own
``performance.now()`` when its first render ends), in Debian's headless chromium driven by selenium on this
machine.  File: ``attn-otel view`` with its default cap (the head means of the 4 layers embedded; per-head
maps left out), opened from disk.  Served: the viewer's routes (the same ones vLLM's API server gets) on a
uvicorn server in this process; each run with empty server caches and the browser's cache off, so the page
and the first map are read from the store every time (the store's files sit in the OS page cache after the
first run).  Also timed: a switch to another layer and to one head, served (a map read from the store).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attn_otel import viewer, viewer_routes  # noqa: E402
from attn_otel.reader import open_trace  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, GENERATED = (0, 10, 19, 29), 9, 3, 64, 128


def make_capture(store: Path, T: int) -> str:
    """A capture of SmolLM2's shape at T tokens; returns its trace id (the one already there, if any)."""
    import torch

    from attn_otel.attention import METRICS, attention_metrics
    from attn_otel.ids import new_span_id, new_trace_id
    from attn_otel.reader import list_captures
    from attn_otel.store import CaptureRecord, open_zarr_store, write_capture

    if store.is_dir():
        found = [c for c in list_captures(store) if c.num_tokens == T and c.has_maps]
        if found:
            return found[0].trace_id
    gen = torch.Generator().manual_seed(0)
    states = torch.zeros(T, 256)
    noise = torch.randn(T, 256, generator=gen)
    for t in range(1, T):  # token states drift: nearby tokens are alike, so they attend to each other
        states[t] = 0.97 * states[t - 1] + 0.25 * noise[t]
    sink = torch.randn(HEAD_DIM, generator=gen)
    sink /= sink.norm()
    maps = np.empty((len(LAYERS), HEADS, T, T), dtype=np.float16)
    metrics = {name: np.empty((len(LAYERS), HEADS, T), dtype=np.float32) for name in METRICS}
    # Scales picked so that, at 1k tokens, the layers' means resemble SmolLM2's (normalised entropy from
    # about 0.8 in layer 0 to 0.4-0.5 in the last, token-0 sink mass from about 0.05 to 0.5).
    for li in range(len(LAYERS)):
        wq = torch.randn(256, HEADS * HEAD_DIM, generator=gen) * 0.7 / 16
        wk = wq.view(256, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)[:, :, 0] \
            + 0.5 * torch.randn(256, KV_HEADS, HEAD_DIM, generator=gen) * 0.7 / 16
        q = (states @ wq).view(T, HEADS, HEAD_DIM) + (4.0 + 2.5 * li) * sink  # later layers: stronger sinks
        k = torch.einsum("td,dhe->the", states, wk)  # [T, KV_HEADS, D]: GQA, as the model has it
        k[0] += 6.0 * sink
        out = torch.empty((HEADS, T, T), dtype=torch.float32)
        rows = attention_metrics(q, k, HEAD_DIM ** -0.5, T - GENERATED, maps_out=out, rows=256)
        maps[li] = out.numpy().astype(np.float16)
        for m, name in enumerate(METRICS):
            metrics[name][li] = rows[m].numpy()
        del out
    del metrics["vision_share"], metrics["vision_share_norm"]  # a text-only request
    trace = new_trace_id()
    record = CaptureRecord(trace_id=trace, request_id="bench-4k", span_id=new_span_id(), parent_span_id=None,
                           prompt_len=T - GENERATED, num_tokens=T, layers=LAYERS, num_heads=HEADS,
                           model="SmolLM2-135M-Instruct (synthetic queries and keys)", mode="maps",
                           token_ids=np.arange(1000, 1000 + T, dtype=np.int32), maps=maps, metrics=metrics,
                           attrs={"vision": False, "sink_tokens": 4, "finish_reason": "length"})
    write_capture(open_zarr_store(store), record)
    return trace


def browser(width: int = 1300, height: int = 1500):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.set_page_load_timeout(120)
    return driver


def wait(driver, condition: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not driver.execute_script(f"return {condition}"):
        if time.monotonic() > deadline:
            raise TimeoutError(condition)
        time.sleep(0.02)
    error = driver.execute_script("return document.body.dataset.error")
    if error:
        raise RuntimeError(f"the page failed: {error}")


def open_page(driver, url: str) -> float:
    """Seconds from navigation start to the first map drawn."""
    driver.get("about:blank")
    driver.get(url)
    wait(driver, "document.body && document.body.dataset.ready === '1'")
    return driver.execute_script("return window.attnOtel.timings[0][2]") / 1000


def switch(driver, element: str, value: str) -> float:
    """Seconds from choosing ``value`` in the ``element`` picker to its map drawn."""
    before = driver.execute_script("return window.attnOtel.timings.length")
    driver.execute_script(f"const e = document.getElementById('{element}'); e.value = '{value}';"
                          "e.dispatchEvent(new Event('change'));")
    wait(driver, f"window.attnOtel.timings.length > {before}")
    return driver.execute_script("return window.attnOtel.timings.at(-1)[1]") / 1000


def serve(store: Path):
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()
    routes = viewer_routes.install(app, viewer_routes.Viewer(str(store)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not (server.started and server.servers):
        time.sleep(0.05)
    return server, routes, server.servers[0].sockets[0].getsockname()[1]


def bench(args) -> dict:
    store = Path(args.store or Path(tempfile.gettempdir()) / f"attn-otel-viewer-bench-{args.tokens}")
    t0 = time.perf_counter()
    trace = make_capture(store, args.tokens)
    made_s = time.perf_counter() - t0
    (cap,) = open_trace(trace, store)
    out = Path(tempfile.mkdtemp()) / "view.html"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attn_otel.cli", "view", trace, "--store", str(store), "-o", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    build_s = time.perf_counter() - t0
    driver = browser()
    try:
        file_runs = [open_page(driver, out.as_uri()) for _ in range(args.runs)]
        server, routes, port = serve(store)
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
        url = f"http://127.0.0.1:{port}/attn-otel/view/{trace}"
        served, layer, head = [], [], []
        for _ in range(args.runs):
            routes.clear_cache()
            served.append(open_page(driver, url))
            layer.append(switch(driver, "layer", "2"))
            head.append(switch(driver, "head", "4"))
        server.should_exit = True
    finally:
        driver.quit()
    chromium = subprocess.run(["/usr/bin/chromium", "--version"], capture_output=True, text=True).stdout.strip()
    median = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    return {
        "what": "seconds from navigation start to the first map drawn (the page's performance.now())",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "browser": chromium,
                    "python": platform.python_version()},
        "capture": {"tokens": cap.num_tokens, "prompt": cap.prompt_len, "layers": cap.layers, "heads": cap.num_heads,
                    "map_bytes_float16": 2 * len(cap.layers) * cap.num_heads * cap.num_tokens ** 2,
                    "written_s": round(made_s, 1)},
        "file": {"build_s": round(build_s, 2), "bytes": out.stat().st_size,
                 "embedded": sorted(json.loads(_data(out.read_text()))["maps"]["embedded"]),
                 "open_s": [round(x, 3) for x in file_runs], "open_s_median": median(file_runs)},
        "served": {"open_s": [round(x, 3) for x in served], "open_s_median": median(served),
                   "layer_switch_s": [round(x, 3) for x in layer], "layer_switch_s_median": median(layer),
                   "head_switch_s": [round(x, 3) for x in head], "head_switch_s_median": median(head)},
    }


def _data(page: str) -> str:
    start = page.index('id="attn-otel-data">') + len('id="attn-otel-data">')
    return page[start:page.index("</script>", start)]


def screenshot(args) -> None:
    (cap,) = [c for c in open_trace(args.trace, args.store)][:1]
    tokenizer = viewer.load_tokenizer(args.tokenizer) if args.tokenizer and cap.meta.get("token_ids") else None
    page, _ = viewer.build_file(cap, tokenizer=tokenizer)
    out = Path(tempfile.mkdtemp()) / "view.html"
    out.write_text(page, encoding="utf-8")
    driver = browser(1240, 1000)
    try:
        open_page(driver, out.as_uri() + "#" + args.view)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1240, height + 120)
        time.sleep(0.3)
        Path(args.screenshot).write_bytes(driver.get_screenshot_as_png())
    finally:
        driver.quit()
    print(f"wrote {args.screenshot} (trace {cap.trace_id}, request {cap.request_id}, #{args.view})", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--store", help="where the capture is (made there when missing)")
    p.add_argument("-o", "--output", default=str(ROOT / "docs" / "benchmarks" / "viewer-open.json"))
    p.add_argument("--screenshot", metavar="PNG", help="instead: a screenshot of --trace's capture in the viewer")
    p.add_argument("--trace")
    p.add_argument("--tokenizer")
    p.add_argument("--view", default="layer=19&head=mean&log=1&q=50", help="the page's hash: layer, head, log, q")
    args = p.parse_args()
    if args.screenshot:
        screenshot(args)
        return
    result = bench(args)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
