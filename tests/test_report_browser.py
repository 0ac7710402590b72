"""The HTML report in a real headless browser (Debian chromium driven by playwright)."""

import shutil

from conftest import TINY_PARAMS, with_variants
from pipeline.stages import report
from pipeline.settings.params import Params
from test_report import XSS, write_results
from report_fixture import demo_like, vlm_like

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


A4_CONTENT_PX = round((210 - 2 * 12) / 25.4 * 96)  # A4 less the print stylesheet's 12 mm margins, in CSS pixels
# every element whose right edge passes the page's width: what a reader would have to scroll to, or a printer clip
OVERFLOWING = """(width) => [...document.querySelectorAll('body *')].filter(e => {
    const box = e.getBoundingClientRect();
    return (box.width || box.height) && getComputedStyle(e).display !== 'none' && box.right > width + 1
        && !(e.closest('.scroll') && getComputedStyle(e.closest('.scroll')).overflowX !== 'visible');
  }).map(e => `${e.tagName}#${e.id}.${e.getAttribute('class')}`).slice(0, 5)"""


def _open(browser, html, width, height, media="screen"):
    page = browser.new_page(viewport={"width": width, "height": height})
    page.emulate_media(media=media)
    errors, requests, dialogs = [], [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(html.as_uri())
    page.wait_for_load_state("networkidle")
    assert errors == [] and dialogs == [] and requests == [html.as_uri()]
    return page


def test_first_screen_reads_on_a_laptop_a_phone_and_a4_paper(tmp_path):
    """At 1280 x 800, without scrolling: per variant its decision, what it rests on (coverage), a cell per counted
    suite (change, interval, recovery; decision in colour, as in verdict.json), size, KL / top-1, served by in its
    three states, speed and capacity or the command that measures them, and the forest plot of every counted suite;
    the method stated once. At 390 x 844 (a phone) and printed on A4 nothing passes the page's width, the narrow
    forest replaces the wide one on the phone; every table has a caption and header cells, the contents link to
    every variant and suite, model-written code keeps its indentation."""
    import json

    from playwright.sync_api import sync_playwright

    results, models, params = demo_like(tmp_path)
    html = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).html
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert [v["decision"] for v in verdict["variants"].values()] == ["NO-GO", "GO", "NO-GO"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = _open(browser, html, 1280, 800)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280  # no sideways scrolling
        assert page.evaluate(OVERFLOWING, 1280) == []
        for selector in ("h1", "#headline", "#toc", "#method", "#summary"):
            assert _inside(page.locator(selector).bounding_box()), selector
        assert page.locator("#headline").inner_text() == verdict["headline"]
        colours = {}
        decisions = {d["variant"]: d for d in verdict["decisions"]}
        for name, v in verdict["variants"].items():
            assert page.locator(f"#decision-{name}").inner_text() == decisions[name]["label"]
            rests = page.locator(f"#coverage-{name}")
            assert _inside(rests.bounding_box()) and rests.inner_text() == decisions[name]["rests_on"], name
            card = page.locator(f"#variant-{name}")
            assert _inside(card.bounding_box()), name
            text = " ".join(card.inner_text().split())
            assert v["why"] in text and "of base" in text and "top-1" in text  # size and KL beside the variant
            for suite, s in v["perplexity"].items():
                cell = page.locator(f"#cell-{name}-{suite}")
                assert _inside(cell.bounding_box()), (name, suite)
                assert cell.get_attribute("data-decision") == s["decision"]
                assert cell.inner_text().split("\n") == [f"{s['change'] * 100:+.1f}%",
                                                         f"[{s['ci_low'] * 100:+.1f}%, {s['ci_high'] * 100:+.1f}%]",
                                                         f"recovery {s['recovery'] * 100:.1f}%", f"{s['n']} docs"]
                colours.setdefault(s["decision"], set()).add(
                    cell.evaluate("c => getComputedStyle(c).backgroundColor"))
        assert all(len(c) == 1 for c in colours.values()) and len({*colours["GO"], *colours["NO-GO"],
                                                                   *colours["INCONCLUSIVE"]}) == 3
        fp8 = verdict["variants"]["fp8-w8a8"]["coverage"]["line"]
        assert fp8.startswith("GO on 4 perplexity suites; math, code not run;") and "vqa not applicable" in fp8
        # math and code sit at the floor: no column, named as not counted
        assert page.locator("#cell-awq-w4a16-math").count() == 0
        assert "math for awq-w4a16 (the base model scores 5.0%, at the floor)" in page.locator("#not-counted").inner_text()
        # speed and capacity where bench.json has them, the command that measures them where not
        assert "244 tok/s at batch 1" in page.locator("#row-fp8-w8a8").inner_text()
        assert "KV cache 900k tokens" in page.locator("#row-fp8-w8a8").inner_text()
        assert page.locator("#row-rtn-w4a16 .speed-command").all_inner_texts() == ["quantize bench models/rtn-w4a16"]
        # served by: shown, refused and not tried, each with its run, its error or the command, in visible text
        served = page.locator("#row-fp8-w8a8 td.served .serve")
        assert served.all_inner_texts() == ["vllm: shown\ngpu_vllm_bench.json", "lmdeploy: refused\nlmdeploy 0.18 cannot serve FP8 W8A8"]
        untried = page.locator("#row-rtn-w4a16 td.served .serve").last
        assert untried.inner_text() == "lmdeploy: not tried\nquantize export models/rtn-w4a16 --engine lmdeploy, then …"
        assert page.evaluate("document.querySelectorAll('body [title], body title').length") == 0  # no tooltip at all
        assert "lmdeploy 0.18 cannot serve FP8 W8A8: <script>" in page.locator("#serving-table").inner_text()
        # the forest: one row per counted suite of every variant, labelled in the suite's own unit
        forest = page.locator("#forest text").all_text_contents()
        assert sum(" · ppl-" in t for t in forest) == 12
        awq_chat = verdict["variants"]["awq-w4a16"]["perplexity"]["ppl-chat"]
        assert f"{awq_chat['change'] * 100:+.1f}% [{awq_chat['ci_low'] * 100:+.1f}%, {awq_chat['ci_high'] * 100:+.1f}%] " \
               f"/ +10.0% · INCONCLUSIVE" in forest
        # what to run next, on the first screen, from verdict.json
        [step] = [s for s in verdict["variants"]["awq-w4a16"]["next_steps"] if s["counted"]]
        assert f"run {step['needed']} documents" in page.locator("#variant-awq-w4a16 .next-step").inner_text()
        # the method once on the first screen; each decision's full sentence further down
        assert "Bell-McCaffrey" in page.locator("#method").inner_text()
        assert "Bell-McCaffrey" not in page.locator("#summary").inner_text()
        sentence = page.locator("#detail-fp8-w8a8 li.sentence").first
        assert sentence.inner_text().startswith("ppl-book: GO: on 8 paired documents")
        assert sentence.bounding_box()["y"] > 800
        # every table captioned and with header cells; every link of the contents lands on something
        tables = page.evaluate("[...document.querySelectorAll('table')].map(t => [t.caption ? t.caption.textContent.trim()"
                               " : '', t.querySelectorAll('th').length])")
        assert len(tables) > 15 and all(caption and headers for caption, headers in tables), tables
        links = page.evaluate("[...document.querySelectorAll('nav a')].map(a => a.getAttribute('href').slice(1))")
        assert {f"detail-{name}" for name in verdict["variants"]} | {f"suite-{s}" for s in ("math", "ppl-chat", "vqa",
                                                                                           "judge")} <= set(links)
        assert "suite-long_context" not in links  # not configured: in the coverage table, not the run's contents
        assert page.evaluate("(ids) => ids.filter(id => !document.getElementById(id))", links) == []
        # model-written code and targets keep their indentation
        page.locator("summary", has_text="code: 10 items").click()
        target = page.locator("table.items pre.target").first
        assert target.inner_text() == "    if x:\n        return 0\n" and target.evaluate(
            "e => getComputedStyle(e).whiteSpace") == "pre-wrap"
        page.screenshot(path=str(tmp_path / "first-screen-1280x800.png"))

        # the demo's case: no bench.json at all, so each row names its bench command and the column the base's
        for bench in results.glob("*/bench.json"):
            bench.unlink()
        bare = report.run(results, tmp_path / "bare", Params.model_validate(params), models_dir=models).html
        laptop = _open(browser, bare, 1280, 800)
        for selector in ("#summary", "#col-speed"):
            assert _inside(laptop.locator(selector).bounding_box()), selector
        assert laptop.locator("#col-speed code").inner_text() == "quantize bench models/base"
        for name in verdict["variants"]:
            command = laptop.locator(f"#row-{name} .speed-command")
            assert command.inner_text() == f"quantize bench models/{name}" and _inside(command.bounding_box())

        phone = _open(browser, html, 390, 844)
        assert phone.evaluate("document.documentElement.scrollWidth") <= 390
        assert phone.evaluate(OVERFLOWING, 390) == []
        assert phone.locator("#forest").is_hidden() and phone.locator("#forest-narrow").is_visible()
        assert phone.locator("#forest-narrow").bounding_box()["width"] <= 390
        for name, v in verdict["variants"].items():  # each variant a card as wide as the screen
            assert phone.locator(f"#decision-{name}").is_visible()
            assert phone.locator(f"#variant-{name}").bounding_box()["width"] <= 390
        phone.screenshot(path=str(tmp_path / "first-screen-390x844.png"))

        paper = _open(browser, html, A4_CONTENT_PX, 1000, media="print")
        assert paper.evaluate("document.documentElement.scrollWidth") <= A4_CONTENT_PX
        assert paper.evaluate(OVERFLOWING, A4_CONTENT_PX) == []  # nothing clipped at the page's edge
        assert paper.evaluate("[...document.querySelectorAll('pre, .scroll')].filter(e => e.scrollHeight > "
                              "e.clientHeight + 1 || e.scrollWidth > e.clientWidth + 1).length") == 0
        assert paper.locator("#forest").is_visible() and paper.locator("#forest").bounding_box()["width"] <= A4_CONTENT_PX
        pdf = paper.pdf(format="A4")
        browser.close()
    assert pdf.startswith(b"%PDF") and pdf.count(b"/Type /Page\n") + pdf.count(b"/Type /Page>") + \
        pdf.count(b"/Type /Page/") >= 3


def test_a_vision_language_models_first_screen_fits_a_laptop_a_phone_and_paper_with_its_loads(tmp_path):
    """Issue 55: a VLM's first screen (VQA's column, the vision tower beside the size, a speed line per load) still
    reads at 1280 x 800 without scrolling, and nothing passes the width of a phone or of A4 paper."""
    from playwright.sync_api import sync_playwright

    results, models, params = vlm_like(tmp_path)
    html = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).html
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = _open(browser, html, 1280, 800)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1280 and page.evaluate(OVERFLOWING, 1280) == []
        for selector in ("#summary", "#variant-fp8-w8a8", "#variant-awq-w4a16", "#cell-fp8-w8a8-vqa", "#vision-awq-w4a16"):
            assert _inside(page.locator(selector).bounding_box()), selector
        speed = " ".join(page.locator("#row-fp8-w8a8 td.speed").inner_text().split())
        assert "(text only, c=1)" in speed and "1 image (1,369 tokens each): TTFT" in speed and "4 images" in speed
        for width, media in ((390, "screen"), (A4_CONTENT_PX, "print")):
            narrow = _open(browser, html, width, 844, media=media)
            assert narrow.evaluate("document.documentElement.scrollWidth") <= width
            assert narrow.evaluate(OVERFLOWING, width) == [], (width, media)
        browser.close()


def test_on_a_phone_the_first_screen_names_what_to_ship_and_every_decision_go_first(tmp_path):
    """Issue 43: at 390 x 844, without scrolling: the headline, then every variant's decision (GO first, then
    INCONCLUSIVE, then NO-GO) with what it rests on in words; the incomplete GO in a colour of its own."""
    import json

    from playwright.sync_api import sync_playwright

    results, models, params = demo_like(tmp_path)
    params["verdict"]["margins"]["perplexity"] = 0.16  # awq-w4a16's rise (~16%) straddles it: INCONCLUSIVE
    html = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).html
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert [(d["variant"], d["label"]) for d in verdict["decisions"]] == [
        ("fp8-w8a8", "GO, incomplete"), ("awq-w4a16", "INCONCLUSIVE"), ("rtn-w4a16", "NO-GO")]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        phone = _open(browser, html, 390, 844)
        assert _inside(phone.locator("#headline").bounding_box(), 390, 844)
        assert phone.locator("#headline").inner_text() == verdict["headline"]
        tops = []
        for d in verdict["decisions"]:
            line = phone.locator(f"#brief-{d['variant']}")
            assert _inside(line.bounding_box(), 390, 844), d["variant"]
            fix = verdict["variants"][d["variant"]].get("fix")  # a NO-GO W4A16 variant: the command that builds its fix
            assert " ".join(line.inner_text().split()) == f"{d['label']} {d['variant']} {d['rests_on'][len(d['label']) + 1:]}" \
                + (f" Fix: not built: {'; '.join(fix['commands'])}" if fix else "")
            tops.append(line.bounding_box()["y"])
        assert tops == sorted(tops)
        tag = phone.locator("#brief-fp8-w8a8 .tag").evaluate("t => getComputedStyle(t).backgroundColor")
        go = phone.locator("td.cell.go").first.evaluate("c => getComputedStyle(c).backgroundColor")
        assert tag != go  # "GO, incomplete" never looks like a plain GO
        laptop = _open(browser, html, 1280, 800)
        assert laptop.locator("#brief").is_hidden()  # on a laptop the table's rows say it, in the same order
        rows = laptop.locator("tbody.variant").evaluate_all("rows => rows.map(r => r.id)")
        assert rows == [f"variant-{d['variant']}" for d in verdict["decisions"]]
        browser.close()


def _pdf_text(pdf: bytes, tmp_path) -> list[str]:
    """The PDF read back as a printer's reader would: pdftotext, one string per page."""
    import subprocess

    assert shutil.which("pdftotext"), "poppler-utils is needed: apt-get install poppler-utils (make system-deps)"
    path = tmp_path / "report.pdf"
    path.write_bytes(pdf)
    return subprocess.run(["pdftotext", str(path), "-"], capture_output=True, text=True, check=True).stdout.split("\f")


# every word of every header cell on one line: a header that breaks, breaks between words (or after a hyphen)
BROKEN_HEADER_WORDS = r"""[...document.querySelectorAll('th')].filter(e => e.getClientRects().length).flatMap(th => {
    const out = [], walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      const node = walker.currentNode, words = /[^\s\-]+/g; let m;
      while ((m = words.exec(node.data))) {
        const r = document.createRange(); r.setStart(node, m.index); r.setEnd(node, m.index + m[0].length);
        if (new Set([...r.getClientRects()].map(x => Math.round(x.top))).size > 1) out.push(m[0]);
      }
    }
    return out; })"""


def test_printed_each_figure_once_collapsed_sections_open_headers_whole_nothing_orphaned(tmp_path, monkeypatch):
    """Issue 43: printed to A4 and read back with pdftotext: the forest once, every chart captioned, collapsed
    sections printed open (those past the row limit named with their file instead), no header broken inside a
    word, no page ending with a table's caption or header."""
    import json
    import re

    from playwright.sync_api import sync_playwright

    from pipeline.report import render

    monkeypatch.setattr(render, "PRINT_MAX_ROWS", 15)  # math's 20 items pass it: not printed; code's 10 print
    results, models, params = demo_like(tmp_path)
    html = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).html
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        paper = _open(browser, html, A4_CONTENT_PX, 1000, media="print")
        assert paper.evaluate(BROKEN_HEADER_WORDS) == []
        charts = paper.evaluate("[...document.querySelectorAll('svg.chart')].filter(s => s.getClientRects().length)"
                                ".map(s => (s.closest('figure')?.querySelector('figcaption')?.textContent || '').trim())")
        assert len(charts) == 4 and all(charts), charts  # the forest and the three speed charts, each captioned
        captions = [" ".join(c.split()) for c in paper.evaluate(
            "[...document.querySelectorAll('caption, figcaption')].filter(c => c.getClientRects().length).map(c => c.textContent)")]
        headers = [" ".join(" ".join(h).split()) for h in paper.evaluate(
            "[...document.querySelectorAll('thead tr')].filter(r => r.getClientRects().length)"
            ".map(r => [...r.children].map(c => c.textContent))")]
        pdf = _open(browser, html, 1280, 800, media="print").pdf(format="A4")  # printed from a laptop's window
        browser.close()
    pages = _pdf_text(pdf, tmp_path)
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    squash = lambda t: re.sub(r"[\s-]", "", t)  # noqa: E731  pdftotext joins a line broken at a hyphen without it
    first = squash(pages[0])
    assert squash(verdict["headline"]) in first  # on paper too, the first page says what to ship and every decision
    for d in verdict["decisions"]:  # (its label's tag, set smaller, comes out of pdftotext apart from its line)
        assert squash(f"{d['variant']} {d['rests_on'][len(d['label']) + 1:]}") in first and squash(d["label"]) in first
    text = " ".join(" ".join(pages).split())
    assert text.count("variant · suite") == 1 and text.count("awq-w4a16 · ppl-chat") == 1  # the wide forest, once
    assert text.count("The forest: every counted suite") == 1
    assert "ppl-book: each document's perplexity under each model." in text and "document 7 <script>" in text
    assert "code: each item's target and every model's answer" in text and "return 9" in text  # collapsed, printed
    assert "math, every item: not printed: 20 rows, see results/*/math.jsonl." in text
    assert "math: each item's target and every model's answer" not in text
    assert "What the charts draw: time to first token" in text  # the charts' figures, in a table that prints
    for number, page in enumerate(pages[:-1]):
        tail = " ".join(" ".join(page.split("\n")[-40:]).split())
        assert not any(tail.endswith(c) for c in captions), f"page {number + 1} ends with a caption"
        assert not any(tail.endswith(h) for h in headers), f"page {number + 1} ends with a table's header"
