"""The HTML report in a real headless browser (Debian chromium driven by playwright)."""

import shutil

from conftest import TINY_PARAMS, with_variants
from pipeline import report
from pipeline.params import Params
from test_report import XSS, write_results
from report_fixture import demo_like

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
        assert page.locator("#decision-same").inner_text() == "GO"
        assert page.locator("#decision-worse").inner_text() == "NO-GO"
        assert page.locator("#suite-table tr").count() == 3
        page.locator("summary", has_text="math: 200 items").click()
        page.locator("label", has_text="flipped").first.click()  # the CSS-only filter
        visible = page.locator("tr.item:visible").count()
        assert visible == 80  # 80 items went right -> wrong for 'worse'
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert shot.stat().st_size > 10_000


def _inside(box, width=1280, height=800) -> bool:
    return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= width + 0.5 \
        and box["y"] + box["height"] <= height + 0.5


def test_first_screen_holds_each_decision_the_matrix_and_the_forest_plot(tmp_path):
    """At 1280 x 800, without scrolling: per variant its decision, why, a cell per counted suite (change and
    decision in colour, as in verdict.json), size, KL / top-1, where it is served, speed and capacity, and
    the forest plot of every counted suite; the method is stated once, the full sentences are further down."""
    import json

    from playwright.sync_api import sync_playwright

    results, models, params = demo_like(tmp_path)
    html = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).html
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert [v["decision"] for v in verdict["variants"].values()] == ["NO-GO", "GO", "NO-GO"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors, requests, dialogs = [], [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(html.as_uri())
        page.wait_for_load_state("networkidle")
        assert errors == [] and dialogs == [] and requests == [html.as_uri()]
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280  # no sideways scrolling
        for selector in ("h1", "#method", "#summary", "#forest", "#not-counted"):
            assert _inside(page.locator(selector).bounding_box()), selector
        colours = {}
        for name, v in verdict["variants"].items():
            assert page.locator(f"#decision-{name}").inner_text() == v["decision"]
            row = page.locator(f"#row-{name}")
            assert _inside(row.bounding_box()), name
            text = row.inner_text()
            assert v["why"] in " ".join(text.split()) and "not measured" not in text.split("\n")[-3]  # KL shown
            for suite, s in v["perplexity"].items():
                cell = page.locator(f"#cell-{name}-{suite}")
                assert _inside(cell.bounding_box()), (name, suite)
                assert cell.get_attribute("data-decision") == s["decision"]
                assert cell.inner_text().split("\n")[0] == f"{s['change'] * 100:+.1f}%"
                colours.setdefault(s["decision"], set()).add(
                    cell.evaluate("c => getComputedStyle(c).backgroundColor"))
            assert "%" in text and ("of base" in text)  # size on disk beside the variant
        assert all(len(c) == 1 for c in colours.values()) and len({*colours["GO"], *colours["NO-GO"],
                                                                   *colours["INCONCLUSIVE"]}) == 3
        # math and code sit at the floor: no column, named as not counted
        assert page.locator("#cell-awq-w4a16-math").count() == 0
        assert "math (base at the floor or ceiling)" in page.locator("#not-counted").inner_text()
        # speed and capacity where bench.json has them, "not measured" where not
        assert "244 tok/s at batch 1" in page.locator("#row-fp8-w8a8").inner_text()
        assert "KV cache 900k tokens" in page.locator("#row-fp8-w8a8").inner_text()
        assert "not measured" in page.locator("#row-rtn-w4a16 td.speed").inner_text()
        assert page.locator("#row-fp8-w8a8 .serve-no").inner_text() == "lmdeploy"
        # the forest: one row per counted suite of every variant, labelled in the suite's own unit
        forest = page.locator("#forest text").all_text_contents()
        assert sum(" · ppl-" in t for t in forest) == 12
        awq_chat = verdict["variants"]["awq-w4a16"]["perplexity"]["ppl-chat"]
        assert f"{awq_chat['change'] * 100:+.1f}% [{awq_chat['ci_low'] * 100:+.1f}, {awq_chat['ci_high'] * 100:+.1f}]% " \
               f"/ +10% · INCONCLUSIVE" in forest
        # what to run next, on the first screen, from verdict.json
        [step] = [s for s in verdict["variants"]["awq-w4a16"]["next_steps"] if s["counted"]]
        assert f"run {step['needed']} documents" in page.locator("#row-awq-w4a16 .next-step").inner_text()
        # the method once on the first screen; each decision's full sentence further down
        first = " ".join(page.locator(sel).inner_text() for sel in ("#summary", "#not-counted"))
        assert "Bell-McCaffrey" in page.locator("#method").inner_text() and "Bell-McCaffrey" not in first
        sentence = page.locator("#detail-fp8-w8a8 li.sentence").first
        assert sentence.inner_text().startswith("ppl-book: GO: on 8 paired documents")
        assert sentence.bounding_box()["y"] > 800
        page.screenshot(path=str(tmp_path / "first-screen.png"))
        browser.close()
