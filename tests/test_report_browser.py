"""The HTML report in a real headless browser (Debian chromium driven by playwright)."""

import shutil

from conftest import TINY_PARAMS, with_variants
from pipeline import report
from pipeline.params import Params
from test_report import XSS, write_results

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def test_report_loads_offline_without_errors_and_shows_the_verdict(tmp_path):
    from playwright.sync_api import sync_playwright

    assert shutil.which("chromium"), "Debian chromium is needed: apt-get install chromium (make test does it)"
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)  # 200 items: fewer cannot show a GO at margin 0.03
    write_results(results, "same", [1] * 120 + [0] * 80)
    write_results(results, "worse", [1] * 40 + [0] * 160, outputs={0: XSS[0], 1: XSS[1]})
    html = report.run(results, tmp_path / "reports", Params.model_validate(with_variants(TINY_PARAMS, "same", "worse"))).html

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 1600})
        console_errors, requests, dialogs = [], [], []
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console_errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(html.as_uri())
        page.wait_for_load_state("networkidle")
        assert console_errors == [] and dialogs == []  # no injected script ran
        assert requests == [html.as_uri()]  # nothing fetched: no CSS, fonts, scripts or images from anywhere
        assert page.locator("#banner-same .decision").inner_text() == "GO"
        assert page.locator("#banner-worse .decision").inner_text() == "NO-GO"
        assert page.locator("#suite-table tr").count() == 3
        page.locator("summary", has_text="math: 200 items").click()
        page.locator("label", has_text="flipped").first.click()  # the CSS-only filter
        visible = page.locator("tr.item:visible").count()
        assert visible == 80  # 80 items went right -> wrong for 'worse'
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000
