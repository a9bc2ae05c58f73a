"""The viewer in a real headless browser: Debian's chromium, driven through chromedriver by selenium.

Both ways to the page: the self-contained file (``attn-otel view``) and the served route, here on a uvicorn
server in this process running the same routes vLLM's API server gets, with an API key.  The page loads, a
layer switch redraws the map, a click on a query row shows that row over the text, and a screenshot is not
blank.  No engine: captures from tests/synthetic.py.
"""

import io
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from synthetic import make_record, write
from test_viewer import CountingStore
from zarr.storage import LocalStore

from attn_otel import cli, viewer, viewer_routes
from attn_otel.reader import open_trace

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
KEY = "browser-key"
T, PROMPT, LAYERS, HEADS = 40, 28, (0, 3, 7), 3

pytestmark = pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                                reason="setup.sh installs Debian's chromium and chromium-driver")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1300,1500", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One capture with token ids and distinct layers (different seeds give different maps per layer)."""
    path = tmp_path_factory.mktemp("viewer-store")
    record, _ = make_record(layers=LAYERS, heads=HEADS, T=T, prompt_len=PROMPT, seed=3)
    write(path, record)
    return path, record


@pytest.fixture(scope="module")
def page_file(store, tmp_path_factory):
    path, record = store
    out = tmp_path_factory.mktemp("viewer-file") / "page.html"
    assert cli.main(["view", record.trace_id, "--store", str(path), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def served(store):
    """The viewer's routes on a uvicorn server on a loopback port, reading through a counting store."""
    import uvicorn
    from fastapi import FastAPI

    path, record = store
    counting = CountingStore(LocalStore(str(path), read_only=True))
    app = FastAPI()
    viewer_routes.install(app, viewer_routes.Viewer(counting, api_keys=[KEY]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", counting
    server.should_exit = True
    thread.join(10)


# --- helpers ------------------------------------------------------------------------------------------------

def _wait(driver, condition: str, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: d.execute_script(f"return {condition}"))


def _draws(driver) -> int:
    return int(driver.execute_script("return document.body.dataset.draws || 0"))


def _open(driver, url: str) -> None:
    driver.get(url)
    _wait(driver, "document.body.dataset.ready === '1' || !!document.body.dataset.error")
    assert driver.execute_script("return document.body.dataset.error") is None
    assert not [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _map_png(driver) -> str:
    return driver.execute_script("return document.getElementById('map').toDataURL()")


def _switch(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    before = _draws(driver)
    Select(driver.find_element(By.ID, element_id)).select_by_value(value)
    _wait(driver, f"+document.body.dataset.draws > {before}")


def _click_row(driver, row: int) -> None:
    """A real mouse click on query row ``row`` of the map (selenium's offsets are from the element's centre)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = driver.find_element(By.ID, "map")
    g = driver.execute_script("return window.attnOtel.geometry")
    width, height = driver.execute_script("const c = document.getElementById('map'); return [c.width, c.height]")
    x, y = g["left"] + g["size"] / 4, g["top"] + (row // g["f"] + 0.5) * g["s"]
    ActionChains(driver).move_to_element_with_offset(canvas, int(x - width / 2), int(y - height / 2)).click().perform()
    _wait(driver, f"document.body.dataset.row === '{row}'")


def _not_blank(png: bytes) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]
    colours = np.unique((pixels * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    assert pixels.std() > 0.05 and len(colours) > 100, (pixels.std(), len(colours))


def _check_row_shown(driver, store, row: int, layer_index: int) -> None:
    """The row panel: its title names the query, the text has every token, those the query sees shaded,
    and the most attended key is the capture's own (the stored maps' head mean, as the page codes it)."""
    from selenium.webdriver.common.by import By

    path, record = store
    (cap,) = open_trace(record.trace_id, path)
    codes = viewer.unpack(viewer.layer_codes(cap, layer_index, [], mean=True)[f"{layer_index}-mean"], T)
    top = int(np.argmax(codes[row, :row + 1]))
    title = driver.find_element(By.ID, "row-title").text
    kind = "generated" if row >= PROMPT else "prompt"
    assert title.startswith(f"Query {row} id {100 + row} ({kind})") and f"most attended {top} id {100 + top} " in title
    spans = driver.find_elements(By.CSS_SELECTOR, "#row-text span")
    assert [s.text.strip() for s in spans[:3]] == ["100", "101", "102"] and len(spans) == T
    assert "query" in spans[row].get_attribute("class")
    assert all("future" in s.get_attribute("class") for s in spans[row + 1:])
    assert "rgb(255, 127, 14)" in spans[top].get_attribute("style")  # the most attended key: full shade
    if row + 1 < T:
        assert not spans[row + 1].get_attribute("style")  # a key it cannot see: no shade


# --- the file -----------------------------------------------------------------------------------------------

def test_the_file_loads_offline(browser, page_file, store):
    from selenium.webdriver.common.by import By

    _open(browser, page_file.as_uri())
    assert store[1].trace_id in browser.title
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#layer option")] == ["0", "3", "7"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "#overview .cell")) == 5 * len(LAYERS)  # no vision share
    assert browser.execute_script("return document.body.dataset.view") == "0-mean-0"


def test_a_layer_switch_redraws_the_map(browser, page_file):
    _open(browser, page_file.as_uri())
    shown = {_map_png(browser)}
    for element, value in (("layer", "1"), ("layer", "2"), ("head", "1"), ("log", None)):
        if value is None:
            before = _draws(browser)
            browser.find_element("id", "log").click()
            _wait(browser, f"+document.body.dataset.draws > {before}")
        else:
            _switch(browser, element, value)
        png = _map_png(browser)
        assert png not in shown, f"{element}={value} did not change the map"
        shown.add(png)
    assert browser.execute_script("return document.body.dataset.view") == "2-1-1"


def test_a_click_on_a_query_row_shows_its_attention_over_the_text(browser, page_file, store):
    _open(browser, page_file.as_uri())
    _switch(browser, "layer", "1")
    _click_row(browser, 33)
    _check_row_shown(browser, store, 33, 1)
    assert "q=33" in browser.current_url  # the view is in the URL: a link to it opens it


def test_the_screenshot_is_not_blank(browser, page_file, tmp_path):
    _open(browser, page_file.as_uri() + "#layer=3&head=mean&log=1&q=30")
    png = browser.get_screenshot_as_png()
    (tmp_path / "viewer.png").write_bytes(png)
    _not_blank(png)


# --- served, with an API key ----------------------------------------------------------------------------------

def test_the_served_page_needs_the_api_key(served, store):
    base, _ = served
    url = f"{base}/attn-otel/view/{store[1].trace_id}"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url, timeout=10)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Basic")
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"}),
                                timeout=10) as r:
        assert r.status == 200


def test_the_served_page_with_the_key_reads_only_what_it_shows(browser, served, store):
    base, counting = served
    url = f"{base}/attn-otel/view/{store[1].trace_id}"
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {KEY}"}})
    try:
        counting.reads.clear()
        _open(browser, url)

        def attn_chunks():
            return sorted({k.split("/attn/")[1] for k in counting.reads if "/attn/c/" in k})

        assert attn_chunks() == [f"c/0/{h}/0/0" for h in range(HEADS)]  # layer 0's mean: its heads' chunks
        before = _map_png(browser)
        _switch(browser, "layer", "2")
        assert _map_png(browser) != before
        assert attn_chunks() == sorted([f"c/0/{h}/0/0" for h in range(HEADS)] + [f"c/2/{h}/0/0" for h in range(HEADS)])
        _click_row(browser, 35)
        _check_row_shown(browser, store, 35, 2)
        _not_blank(browser.get_screenshot_as_png())
    finally:
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {}})


def test_a_browser_given_the_key_as_basic_credentials_gets_the_page_and_its_maps(browser, served, store):
    """What a person does: the browser asks for credentials on the 401 (any user, the key as password) and
    sends them with the page's map requests too.  Here the credentials ride in the URL."""
    base, _ = served
    _open(browser, base.replace("http://", f"http://viewer:{KEY}@") + f"/attn-otel/view/{store[1].trace_id}")
    _switch(browser, "head", "2")
    assert browser.execute_script("return document.body.dataset.view") == "0-2-0"


def test_a_metrics_only_capture_shows_its_per_layer_metrics_and_no_map(browser, tmp_path):
    from selenium.webdriver.common.by import By

    record, _ = make_record(layers=LAYERS, heads=HEADS, T=T, prompt_len=PROMPT, maps=False)
    write(tmp_path / "store", record)
    out = tmp_path / "metrics.html"
    assert cli.main(["view", record.trace_id, "--store", str(tmp_path / "store"), "-o", str(out)]) == 0
    _open(browser, out.as_uri())
    assert not browser.find_element(By.ID, "figure").is_displayed()
    assert "metrics only" in browser.find_element(By.ID, "note").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#overview .cell")) == 5 * len(LAYERS)
    assert browser.find_element(By.CSS_SELECTOR, "#footer code").text.startswith("attn-otel metrics ")
