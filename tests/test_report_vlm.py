"""Issue 55 (items 2 and 3): the report of a vision-language model's run. VQA counts like any right/wrong suite, each
variant's vision tower is stated (kept bit-identical in its dtype, or which tensors changed), and every speed figure
names the load it is from (text only, 1 image, 4 images), on the page, in verdict.json and in the model cards; a
text-only model's report says none of it."""

import re
from html import unescape

from pipeline.report.model_card import model_cards, run_settings
from pipeline.settings.params import Params
from pipeline.stages import report
from report_fixture import demo_like, vlm_like


def _report(tmp_path, fixture):
    results, models, params = fixture(tmp_path)
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    out.params = Params.model_validate(params)
    return out.verdict, unescape(out.html.read_text()), out


def _text(html: str) -> str:
    """The page's visible words, tags dropped and spaces collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def test_a_vlm_report_counts_vqa_states_the_vision_tower_and_names_each_speed_figures_load(tmp_path):
    verdict, html, out = _report(tmp_path, vlm_like)
    fp8, awq = verdict["variants"]["fp8-w8a8"], verdict["variants"]["awq-w4a16"]

    # VQA is decided like any right/wrong suite: in the coverage, the matrix, the recovery average and the cards
    for name, v in (("fp8-w8a8", fp8), ("awq-w4a16", awq)):
        assert v["coverage"]["suites"]["vqa"]["state"] == "decided" and "vqa" in v["coverage"]["decided"]
        assert v["suites"]["vqa"]["counted"] and v["recovery"]["suites"] == ["vqa"]
        assert f'id="cell-{name}-vqa"' in html
    assert fp8["decision"] == "GO" and awq["suites"]["vqa"]["delta"] == -0.12  # 12 of 100 right answers lost
    assert 'id="col-vqa"' in html and "GO on 1 accuracy suite and 1 perplexity suite" in fp8["coverage"]["line"]

    # the vision tower, per variant: on the first screen and in the size table
    text = _text(html)
    assert "vision tower kept in bf16: 182 tensors bit-identical to the base's" in text
    raw = out.html.read_text()
    changed = re.search(r'<span class="small vision vision-changed nogo-text" id="vision-awq-w4a16">([^<]+)</span>', raw)
    assert changed and unescape(changed.group(1)) == (
        "vision tower changed: 2 of 182 tensors differ from the base's (model.visual.blocks.0.attn.qkv.weight, "
        "model.visual.merger.proj.weight <script>alert(1)</script><img src=x onerror=alert(2)>)")  # a name, escaped
    size_table = html[html.index('id="size-table"'):html.index("</table>", html.index('id="size-table"'))]
    assert ">vision tower</th>" in size_table and size_table.count("vision tower kept in bf16") == 1

    # speed: each figure names its load, on the first screen ...
    row = verdict["speed"]["fp8-w8a8"]
    assert row["batch1_load"] == "text only, c=1" and [l["label"] for l in row["loads"]] == ["text only", "1 image", "4 images"]
    cell = _text(html[html.index('id="row-fp8-w8a8"'):html.index("</tr>", html.index('id="row-fp8-w8a8"'))])
    assert "vllm: 111 tok/s at batch 1 (text only, c=1) (1.3× base)" in cell  # 1000 / 9 ms against 1000 / 12 ms
    assert "goodput 6.67k tok/s/GPU (text only) (1.3× base)" in cell
    assert "text only: 4.17k in the KV pool (1.8× base)" in cell  # 1.6M // 384 KV tokens a request vs 900k // 384
    one = 170 + 1369 + 256  # text + one image's tokens + output
    assert f"1 image (1,369 tokens each): TTFT 84.0 ms at c=1, {1_600_000 // one} in the KV pool (1.8× base)" in cell
    assert f"4 images (1,369 tokens each): TTFT 273.0 ms at c=1, {1_600_000 // (170 + 4 * 1369 + 256)} in the KV pool" in cell
    assert fp8["capacity_line"] == "GO, 1.3× tokens/s (text only), 1.8× KV capacity"
    # ... in the speed section's table of loads, one row per model and load ...
    loads = html[html.index('id="load-table"'):html.index("</table>", html.index('id="load-table"'))]
    assert loads.count("<tr id=\"load-") == 6 and 'id="load-base-4-images"' in loads
    four = _text(loads[loads.index('id="load-fp8-w8a8-4-images"'):loads.index("</tr>", loads.index('id="load-fp8-w8a8-4-images"'))])
    kv4 = 170 + 4 * 1369 + 256
    assert f"4 images 4 × 1024 × 1024 px, 1369 tokens each {170 + 4 * 1369} {kv4:,} {1_600_000 // kv4:,} 62 273.0 ms" in four
    assert "The charts and the speed table are that text-only load" in text

    # ... and in the model card, with VQA's figure for the Hub and the pipeline tag of an image-text model
    card = model_cards(verdict, tasks={"vqa": "quant_vqa", "ppl-chat": "quant_ppl_chat"},
                       speed_engine=None, run=run_settings(verdict, out.params))["fp8-w8a8"]
    assert "pipeline_tag: image-text-to-text" in card
    assert ("type: visual-question-answering\n      name: vqa\n    dataset:\n      name: easy-VQA test questions (100 items "
            "scored)\n      type: easy-vqa\n      split: test") in card
    score = f"{100 * fp8['suites']['vqa']['base_score']:.1f}%"
    assert f"| vqa | easy-VQA test questions (accuracy) | 100 items | {score} | {score} | +0.00 pts" in card
    assert "- **Vision tower**: vision tower kept in bf16: 182 tensors bit-identical to the base's" in card
    assert "- vllm: 111 tok/s at batch 1 (text only, c=1) (1.3× base) (goodput 6.67k tok/s/GPU (text only)" in card
    assert "AutoModelForImageTextToText" in card and '{"type": "image_url"' in card  # its snippets send an image
    assert "- output tokens/s by requests in flight (1 image): 1: 93," in card
    assert ("; 4 images: the same text with 4 images of 1024 x 1024 pixels (1,369 tokens each, by the model's image "
            f"processor), {kv4:,} KV tokens a request") in card
    assert (tmp_path / "reports" / "cards" / "fp8-w8a8" / "README.md").read_text() == card


def test_a_text_only_models_report_says_nothing_of_loads_images_or_a_vision_tower(tmp_path):
    verdict, html, _ = _report(tmp_path, demo_like)
    assert "loads" not in verdict["speed"]["fp8-w8a8"] and "batch1_load" not in verdict["speed"]["fp8-w8a8"]
    for words in ("text only", "image", 'id="load-table"', "vision tower kept", ">vision tower</th>"):
        assert words not in html, words
    assert verdict["variants"]["fp8-w8a8"]["capacity_line"] == "GO, 1.4× tokens/s, 1.8× KV capacity"
    for card in model_cards(verdict, tasks={}, speed_engine=None).values():
        assert "text only" not in card and "Vision tower" not in card and "AutoModelForCausalLM" in card
