"""Issue 43: the reviewer knows what to ship from the first lines. The headline (verdict.json, the page,
show-verdict), the order and labels of the decisions, the verdict's own reasons, every state in visible text,
each model's own memory, the recovery average or why none, a synthetic base said, no control character on the
page, and a report re-rendered from a stored copy (benchmarks/report_bundle.py). The browser and print checks
are in tests/test_report_browser.py."""

import json
import re
import subprocess
import sys
from html import unescape

import pytest

from conftest import REPO, TINY_PARAMS, with_variants
from pipeline.stages import report
from pipeline.checkpoints.config_json import base_facts
from pipeline.errors import UserError
from pipeline.outputs import human_size
from pipeline.settings.params import Params
from pipeline.report.render import render_html
from pipeline.verdict.headline import GO_INCOMPLETE, headline, label, ordered
from pipeline.verdict.synthetic import synthetic
from report_fixture import demo_like
from test_report import write_results

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _entry(decision, complete=True, **parts):
    return {"decision": decision, "coverage": {"complete": complete, "base_ran": ["math", "ppl-chat"], "suites": {
        "math": {"state": "decided" if complete else "not run", "label": "decided" if complete else "not run",
                 "kind": "accuracy"},
        "ppl-chat": {"state": "decided", "label": "decided", "kind": "perplexity"}}}, **parts}


def _counted(suite, decision):
    return {suite: {"counted": True, "decision": decision}}


def test_go_first_then_incomplete_inconclusive_no_go_and_anything_else_last():
    variants = {"nogo": _entry("NO-GO", perplexity=_counted("ppl-chat", "NO-GO")), "built-not": {"decision": "NOT BUILT"},
                "open": _entry("INCONCLUSIVE", perplexity=_counted("ppl-chat", "INCONCLUSIVE")),
                "partial": _entry("GO", complete=False), "whole": _entry("GO")}
    assert ordered(variants) == ["whole", "partial", "open", "nogo", "built-not"]
    assert label(variants["partial"]) == GO_INCOMPLETE and label(variants["whole"]) == "GO"
    assert label({"state": "not evaluated"}) == "not evaluated"  # whatever a later verdict.json names, shown as given
    text = headline({"variants": variants})
    assert text.startswith("Ship whole: GO on 1 accuracy suite and 1 perplexity suite; partial GO, incomplete, on "
                           "1 perplexity suite (math not run); open INCONCLUSIVE, not settled on ppl-chat; nogo NO-GO "
                           "on ppl-chat; built-not NOT BUILT.")
    only_partial = {k: v for k, v in variants.items() if k != "whole"}
    # issue 69 item 5: a GO on fewer suites than the base ran is never said to ship (its card says so too)
    assert headline({"variants": only_partial}).startswith(
        "Ship none yet: partial GO, incomplete, on 1 perplexity suite (math not run);")
    assert headline({"variants": {"nogo": variants["nogo"]}}) == "Ship none: nogo NO-GO on ppl-chat."
    assert headline({"variants": variants, "synthetic": {"short": "the base scores at chance everywhere"}}).startswith(
        "Ship none on this evidence: the base scores at chance everywhere (timing only: these accuracy figures mean "
        "nothing); as computed: whole GO on")


def test_the_headline_opens_verdict_json_and_the_page_and_the_incomplete_go_is_labelled_everywhere(tmp_path):
    results, models, params = demo_like(tmp_path)
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    verdict = json.loads(out.verdict_json.read_text())
    assert list(verdict)[:2] == ["headline", "decisions"] and "synthetic" not in verdict
    assert verdict["headline"] == ("Ship none yet: fp8-w8a8 GO, incomplete, on 4 perplexity suites (math, code not run); "
                                   "awq-w4a16 NO-GO on ppl-book, ppl-code, ppl-math; rtn-w4a16 NO-GO on ppl-book, ppl-chat, "
                                   "ppl-code, ppl-math.")
    assert [(d["variant"], d["label"]) for d in verdict["decisions"]] == [
        ("fp8-w8a8", "GO, incomplete"), ("awq-w4a16", "NO-GO"), ("rtn-w4a16", "NO-GO")]
    assert verdict["decisions"][0]["rests_on"].startswith("GO, incomplete on 4 perplexity suites; math, code not run")
    assert out.summary().endswith("(fp8-w8a8: GO, incomplete, awq-w4a16: NO-GO, rtn-w4a16: NO-GO)")  # `quantize report`
    page = unescape(out.html.read_text())
    assert page.index(verdict["headline"]) < page.index('id="toc"')  # the first line under the title
    assert 'class="tag go-incomplete" id="decision-fp8-w8a8">GO, incomplete<' in page  # the matrix
    assert '<h3>fp8-w8a8: <span class="tag go-incomplete">GO, incomplete</span></h3>' in page  # its decision in full
    assert page.index('id="row-fp8-w8a8"') < page.index('id="row-awq-w4a16"') < page.index('id="row-rtn-w4a16"')


def test_a_not_counted_suite_gives_the_verdicts_own_reason_in_its_cell_and_below(tmp_path):
    """ppl-book scored on another engine for awq-w4a16 (NOT PAIRED), counted for the others: the cell and the
    not-counted line say so, in the verdict's words; no fixed 'too few documents' anywhere."""
    results, models, params = demo_like(tmp_path)
    for model, engine in (("base", "hf"), ("awq-w4a16", "vllm"), ("fp8-w8a8", "hf"), ("rtn-w4a16", "hf")):
        summary = results / model / "ppl-book.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "engine": engine}))
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    why = out.verdict["variants"]["awq-w4a16"]["coverage"]["suites"]["ppl-book"]["why"]
    assert why.startswith("NOT PAIRED: the base was scored on hf, awq-w4a16 on vllm")
    page = unescape(out.html.read_text())
    cell = re.search(r'id="cell-awq-w4a16-ppl-book" data-decision="" data-label="ppl-book">([^<]*)<', page).group(1)
    assert cell == "shown, not counted: " + why.split("; ")[0]
    assert f"ppl-book for awq-w4a16 ({why})" in page and "too few documents" not in page
    assert "math for awq-w4a16 (the base model scores 5.0%, at the floor)" in page


def test_served_refused_not_tried_and_speed_in_words_and_memory_the_models_own(tmp_path):
    results, models, params = demo_like(tmp_path)
    bench = json.loads((results / "fp8-w8a8" / "bench.json").read_text())
    bench["capacity"]["kv_cache_bytes"] = 25 << 30  # the pool its server reserved; memory_bytes (30 GiB) is the device's
    (results / "fp8-w8a8" / "bench.json").write_text(json.dumps(bench))
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    page = unescape(out.html.read_text())
    assert "<title" not in page.split("</head>")[1] and " title=" not in page  # nothing only in a tooltip
    fp8 = page[page.index('id="row-fp8-w8a8"'):page.index('class="rests-row"', page.index('id="row-fp8-w8a8"'))]
    assert "vllm: shown</span> <span class=\"small serve-detail\">gpu_vllm_bench.json" in fp8
    assert "lmdeploy: refused</span> <span class=\"small serve-detail\">lmdeploy 0.18 cannot serve FP8 W8A8<" in fp8
    assert "vllm: 244 tok/s at batch 1 (1.5× base)" in fp8 and "goodput 7k tok/s/GPU (1.4× base)" in fp8
    assert "KV cache 900k tokens (1.8× base)" in fp8 and "memory 42.0 GiB: weights 17.0 GiB + KV pool 25.0 GiB" in fp8
    assert "30.0 GiB" not in page  # the device's total with every server up is no model's memory
    assert "weights 17.0 GiB; KV pool not recorded" in page  # the base's bench.json has no pool: said
    awq = page[page.index('id="row-awq-w4a16"'):page.index('class="rests-row"', page.index('id="row-awq-w4a16"'))]
    assert "lmdeploy: not tried</span> <span class=\"small serve-detail\"><code>quantize export models/awq-w4a16 " \
           "--engine lmdeploy, then …</code>" in awq
    assert "not tried: run</span>" in awq and "quantize bench models/awq-w4a16" in awq
    # the deployment engine refusing the variant: its speed is refused, with the engine's error
    (results / "fp8-w8a8" / "bench.json").unlink()
    params["verdict"]["speed_engine"] = "lmdeploy"
    again = unescape(report.run(results, tmp_path / "r2", Params.model_validate(params), models_dir=models).html.read_text())
    assert re.search(r'class="speed speed-refused" data-label="speed"><span class="speed-state">lmdeploy: refused</span>'
                     r'<span class="small">lmdeploy 0.18 cannot serve FP8 W8A8: <script>', again)


def test_recovery_average_as_model_cards_give_it_or_why_none(tmp_path):
    results = tmp_path / "results"
    base = [1] * 120 + [0] * 80
    write_results(results, "base", base)
    write_results(results, "copy", base)
    write_results(results, "worse", [1] * 108 + [0] * 92)
    out = report.run(results, tmp_path / "reports", Params.model_validate(with_variants(TINY_PARAMS, "copy", "worse")),
                     models_dir=tmp_path / "models")
    page = unescape(out.html.read_text())
    assert "recovery 100.0%" in page and "average over 1 accuracy suite (math)" in page
    assert 'id="average-worse">54.0% (90.0%)<' in page and '<th scope="row">Average</th><td class="num">60.0%<' in page
    results, models, params = demo_like(tmp_path / "demo")
    demo = unescape(report.run(results, tmp_path / "r2", Params.model_validate(params), models_dir=models).html.read_text())
    assert '>no recovery average<span class="recovery-note">no accuracy suite counted: math, code not run<' in demo
    assert "awq-w4a16: no recovery average: no accuracy suite counted: math, code shown, not counted" in demo


def test_a_synthetic_base_is_said_first_and_ships_nothing(tmp_path):
    results, models, params = demo_like(tmp_path)
    (models / "base").mkdir(parents=True)
    (models / "base" / "config.json").write_text(json.dumps({"vocab_size": 16}))  # ~12 per token: a guess over 16
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    assert out.verdict["synthetic"]["at_chance"] and not out.verdict["synthetic"]["made_up"]
    assert out.verdict["headline"].startswith("Ship none on this evidence: the base scores at chance everywhere "
                                              "(timing only: these accuracy figures mean nothing)")
    page = unescape(out.html.read_text())
    assert page.index("Timing only: these accuracy figures mean nothing.") < page.index('id="headline"')
    assert "with a 16-token vocabulary" in page and "math 5.0%" in page
    # a real vocabulary: the same scores are a language model's, not a guess; a made-up base says so whatever it scores
    base_suites = out.verdict["base"]["suites"]
    assert synthetic(base_suites, base_facts({"vocab_size": 151552}), 0.05) is None
    made_up = synthetic(base_suites, base_facts({"vocab_size": 151552, "synthetic_weights": "random bf16 weights"}), 0.05)
    assert made_up["made_up"] and made_up["why"] == "the base's weights were made up by the run (random bf16 weights)"
    assert synthetic({"math": {"n": 20, "score": 0.3}, "ppl": {"n": 8, "perplexity": 9e5}}, {"vocab_size": 1000}, 0.05) is None
    vlm = base_facts({"text_config": {"vocab_size": 151552}, "vision_config": {}})  # a VLM's vocabulary is its text tower's
    assert vlm == {"vocab_size": 151552, "synthetic_weights": None}


def test_no_control_character_reaches_the_page_whatever_the_results_hold(tmp_path):
    hostile = "nul\x00 esc\x1b[31m nel\x85 cr\r del\x7f tab\tnewline\n"
    results, models, params = demo_like(tmp_path)
    math = results / "awq-w4a16" / "math.jsonl"
    lines = [json.loads(line) for line in math.read_text().splitlines()]
    lines[0]["output"] = hostile
    math.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    page = out.html.read_bytes().decode("utf-8")
    assert not CONTROL.search(page) and "\r" not in page
    assert "nul␀ esc␛[31m nel\ufffd cr␍ del␡ tab\tnewline\n" in page
    # a folder name that is not UTF-8 (Python reads its bytes as lone surrogates) and holds ESC: named, made visible
    import os

    os.makedirs(os.fsencode(results) + b"/copy\xff\x1b")
    again = report.run(results, tmp_path / "again", Params.model_validate(params), models_dir=models).html.read_text()
    assert not CONTROL.search(again) and "copy\ufffd␛" in again
    # a lone surrogate in a result line: the reader refuses it, naming the line (never a page it cannot write)
    lines[0]["output"] = "lone\ud800"
    math.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UserError, match="math.jsonl:1: output: holds an unpaired UTF-16 surrogate"):
        report.run(results, tmp_path / "refused", Params.model_validate(params), models_dir=models)
    # model names from a verdict of any origin: the page holds no control character whatever it is handed
    verdict = out.verdict
    verdict["variants"] = {f"awq{ch}": v for ch, v in zip(("\x00", "\x1b", "\x85", "\ud800"), verdict["variants"].values())}
    verdict.pop("headline")
    html = render_html(verdict=verdict, results={}, params=Params.model_validate(params), calib=None, base={},
                       human_size=human_size)
    assert not CONTROL.search(html) and "awq␀" in html and "awq␛" in html and html.count("awq\ufffd") > 2
    html.encode("utf-8")  # a lone surrogate could not have been written


def test_a_variant_verdict_json_names_but_did_not_decide_is_shown_with_its_label(tmp_path):
    results, models, params = demo_like(tmp_path)
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).verdict
    verdict["variants"]["gptq-w4a16"] = {"decision": "NOT BUILT", "why": "no models/gptq-w4a16: run `dvc repro`"}
    verdict.pop("headline")
    html = unescape(render_html(verdict=verdict, results=report.collect(results, list(params["suites"])),
                                params=Params.model_validate(params), calib=None, base={}, human_size=human_size))
    assert 'id="brief-gptq-w4a16"><span class="tag uninformative">NOT BUILT</span> <b>gptq-w4a16</b> <span ' \
           'class="brief-rests">no models/gptq-w4a16: run `dvc repro`</span>' in html
    assert "; gptq-w4a16 NOT BUILT: no models/gptq-w4a16: run `dvc repro`." in html  # the headline, last
    assert 'id="detail-gptq-w4a16"' not in html  # nothing decided to show in full


def _bundle(*args, cwd):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "report_bundle.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_a_report_re_renders_from_a_stored_copy_of_what_it_reads(tmp_path):
    """pack on the machine that ran the pipeline, render on any other: the same verdict, the run's environment."""
    import yaml

    project = tmp_path / "project"
    results, models, params = demo_like(project)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    direct = report.run(results, project / "reports", Params.model_validate(params), models_dir=models,
                        environment={"machine": "the GPU machine", "generated": "then", "packages": {}})
    packed = _bundle("pack", str(project), str(tmp_path / "copy.tar.gz"), cwd=project)
    assert packed.returncode == 0, packed.stderr
    lines = sorted(results.glob("*/*.jsonl"))  # every result line (kl.jsonl included), summary, quant.json; no weights
    assert f"({len(lines)} result files)" in packed.stdout and len(lines) >= 20
    rendered = _bundle("render", str(tmp_path / "copy.tar.gz"), str(tmp_path / "again"), cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    again = json.loads((tmp_path / "again" / "verdict.json").read_text())
    assert again["headline"] == direct.verdict["headline"] and again["environment"]["machine"] == "the GPU machine"
    assert again["decisions"] == direct.verdict["decisions"]
    assert sorted(p.parent.name for p in (tmp_path / "again" / "cards").glob("*/README.md")) == sorted(
        d["variant"] for d in direct.verdict["decisions"])  # and a card per decided variant beside them
    page = (tmp_path / "again" / "index.html").read_text()
    assert "on the GPU machine" in page and "ppl-book: perplexity per document (8)" in page
    # from the verdict alone: the first screen again, the result lines said to be absent
    alone = _bundle("render", str(project / "reports" / "verdict.json"), str(tmp_path / "alone"), "--params",
                    str(project / "params.yaml"), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert 'id="no-items"' in (tmp_path / "alone" / "index.html").read_text()


@pytest.mark.parametrize("member, expected", [("../escape.json", "is not a plain file inside the bundle"),
                                              (None, "not a readable .tar.gz")])
def test_a_bad_bundle_is_one_line_and_exit_2(tmp_path, member, expected):
    import io
    import tarfile

    bundle = tmp_path / "bad.tar.gz"
    if member:
        with tarfile.open(bundle, "w:gz") as out:
            out.addfile(tarfile.TarInfo(member), io.BytesIO(b""))
    else:
        bundle.write_bytes(b"not a tarball")
    done = _bundle("render", str(bundle), str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "escape.json").exists() and not (tmp_path / "out").exists()
