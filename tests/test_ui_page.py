"""GET /ui, the live session page: its files are served (without the API key, as they hold no
data), and, in a real headless Chromium driven by Selenium, it creates a session, shows records
arriving and the version advancing, and updates a flash question's answer per version without a
reload. The browser test is optional: skipped with a reason when selenium or Debian's chromium /
chromium-driver are absent (``make test`` installs them where apt-get is available).

``STREAMKV_UI_SCREENSHOT=docs/ui.png`` keeps the browser test's final screenshot there.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import ServerProcess

KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--api-key", KEY)
    yield proc
    assert proc.stop() == 0


def test_page_files_are_served_without_the_key_and_load_nothing_remote(server):
    page = httpx.get(server.url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(refs) == ["/ui/app.js", "/ui/style.css"]  # no CDN, no build output
    for path, kind in (("/ui/app.js", "javascript"), ("/ui/style.css", "css")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.text) > 500
    assert "http://" not in httpx.get(server.url + "/ui/app.js").text.replace("http://localhost", "")
    # the data stays behind the key; other /ui paths do not exist
    assert httpx.get(server.url + "/v1/sessions").status_code == 401
    assert httpx.get(server.url + "/ui/../v1/sessions").status_code == 401
    assert httpx.get(server.url + "/ui/app.py", headers=AUTH).status_code == 404
    assert "/ui" not in httpx.get(server.url + "/openapi.json", headers=AUTH).json()["paths"]


def test_include_text_gives_each_window_record_its_text(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"system": "Logs.", "retention_tokens": 400}).json()["id"]
        try:
            records = ["door 1 opened at 09:12", "door 2 closed at 09:15"]
            assert c.post(f"/v1/sessions/{sid}/data", json={"records": records}).status_code == 202
            deadline = time.monotonic() + 60
            while c.get(f"/v1/sessions/{sid}").json()["data_version"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            st = c.get(f"/v1/sessions/{sid}", params={"include_text": "true"}).json()
            texts = [r["text"] for r in st["layout"]["records"]]
            assert len(texts) == 2 and all(rec in t for rec, t in zip(records, texts))
            assert "stream_ids" not in st["layout"]
            plain = c.get(f"/v1/sessions/{sid}").json()
            assert "text" not in plain["layout"]["records"][0]
        finally:
            c.delete(f"/v1/sessions/{sid}")


# ------------------------------------------------------------------ the real browser
def _driver():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--window-size=1400,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)


def _until(driver, fn, what: str, timeout: float = 90.0):
    """Poll ``fn(driver)`` until truthy. The page re-renders its tables and lists on every poll, so an
    element found a moment ago can be replaced before it is read: a stale reference retries the poll."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
    return wait.until(lambda d: fn(d), message=what)


def test_the_page_in_a_real_browser(server, tmp_path):
    driver = _driver()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    text = lambda d, id_: d.find_element(By.ID, id_).text  # noqa: E731
    try:
        driver.get(server.url + "/ui")
        _until(driver, lambda d: "401" in text(d, "error"), "the missing key reported on the page")
        key = driver.find_element(By.ID, "api-key")
        key.send_keys(KEY)
        driver.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        _until(driver, lambda d: text(d, "model"), "the model name from /v1/models")
        retention = driver.find_element(By.ID, "new-retention")
        retention.clear()
        retention.send_keys("160")  # small, so the second push evicts
        Select(driver.find_element(By.ID, "new-evict")).select_by_visible_text("snapkv")
        driver.find_element(By.ID, "create").click()
        sid = _until(driver, lambda d: text(d, "session-id"), "a created session")
        assert sid.startswith("sess_")
        _until(driver, lambda d: sid in text(d, "session-list"), "the new session listed")

        driver.find_element(By.ID, "flash-question").send_keys("How many doors were opened?")
        driver.find_element(By.ID, "flash-register").click()
        _until(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#flash-table tbody tr")) == 1, "flash row")

        def push(lines: list[str]) -> None:
            box = driver.find_element(By.ID, "push-text")
            box.send_keys("\n".join(lines))
            driver.find_element(By.ID, "push").click()

        def flash_cells(d) -> list[str]:
            cells = [c.text for c in d.find_elements(By.CSS_SELECTOR, "#flash-table tbody tr td")]
            return cells if len(cells) >= 3 else ["", "", ""]  # a row being redrawn reads as empty

        push([f"door {i} opened at 09:{10 + i}" for i in range(4)])
        _until(driver, lambda d: text(d, "version") == "1", "version 1 shown")
        _until(driver, lambda d: "door 3 opened" in text(d, "window"), "records in the window")
        _until(driver, lambda d: flash_cells(d)[2] == "1" and flash_cells(d)[1], "flash answer at version 1")

        push([f"door {i} closed at 10:{10 + i}" for i in range(12)])
        _until(driver, lambda d: text(d, "version") == "2", "version 2 shown")
        _until(driver, lambda d: flash_cells(d)[2] == "2", "flash answer updated to version 2")
        st = httpx.get(f"{server.url}/v1/sessions/{sid}", headers=AUTH).json()
        evictions = _until(driver, lambda d: d.find_element(By.CSS_SELECTOR, 'td[data-stat="evictions"]').text,
                           "evictions stat")
        assert int(evictions.split()[0]) >= 1  # 16 records of ~12 tokens do not fit 160 tokens
        # snapkv: the evicted records' best tokens stay as memory, drawn between frozen and records
        assert st["memory_tokens"] > 0
        _until(driver, lambda d: f"memory {st['memory_tokens']}" in text(d, "layout-legend"), "memory in the layout")
        assert driver.find_elements(By.CSS_SELECTOR, "#layout .part.memory")
        assert not driver.find_element(By.ID, "error").is_displayed()  # the 401 went away with the key
        kv = _until(driver, lambda d: d.find_element(By.CSS_SELECTOR, 'td[data-stat="KV"]').text, "KV stat")
        assert re.fullmatch(rf"pool · \d+\.\d (KiB|MiB) · {st['kv']['blocks']} blocks", kv), kv
        parts = driver.find_elements(By.CSS_SELECTOR, "#layout .part.record")
        assert len(parts) == len(driver.find_elements(By.CSS_SELECTOR, "#window li")) > 0
        window = _until(driver, lambda d: text(d, "window"), "the window's records")
        assert "door 11 closed" in window and "door 0 opened" not in window
        events = _until(driver, lambda d: text(d, "events"), "the event log")
        assert "evicted" in events and "flash_ready" in events

        driver.find_element(By.ID, "ask-question").send_keys("Which door closed last?")
        driver.find_element(By.ID, "ask").click()
        _until(driver, lambda d: d.find_element(By.ID, "answer-box").is_displayed(), "an answer")
        assert text(driver, "answer-source") in {"session", "flash", "ready"}
        assert re.fullmatch(r"\d+\.\d ms", text(driver, "answer-latency"))
        assert text(driver, "answer-version") == "2" and text(driver, "answer")

        shot = os.environ.get("STREAMKV_UI_SCREENSHOT") or str(tmp_path / "ui.png")
        driver.set_window_size(1400, driver.execute_script("return document.body.scrollHeight") + 120)
        driver.save_screenshot(shot)
        assert Path(shot).stat().st_size > 10_000
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
                  and not (e["source"] == "network" and "401" in e["message"])]  # before the key was typed
        assert not severe, severe
    finally:
        driver.quit()
