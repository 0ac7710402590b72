"""`quantize calib` with images: OpenAI-format image parts (a data URL or a path) are checked like text and kept as
their pixels alone (EXIF, PNG text chunks and the file's path gone); a bad image names FILE:LINE, the part and the
fix; a vision model's build keeps the images and a sample per conversation with images (its image tokens counted
by the model's own processor); a text-only model drops the images with a line and calibrates on the text."""

import base64
import hashlib
import io
import json

import pytest
from PIL import Image, ImageOps, PngImagePlugin

from conftest import REPO, read_jsonl
from pipeline.errors import UserError
from pipeline.stages import calib
from tiny import save_tiny_glm4v

LOGS = [json.loads(line) for line in (REPO / "calib_data" / "support_logs.jsonl").read_text(encoding="utf-8").splitlines()]
TEXT = [{"messages": [{"role": "user", "content": r["turns"][0]["content"]},
                      {"role": "assistant", "content": r["turns"][1]["content"]}]} for r in LOGS[:12]]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_glm4v(tmp_path_factory.mktemp("vlm") / "glm4v")


def _screenshot(colour: str, size=(40, 24)) -> Image.Image:
    image = Image.new("RGB", size, "white")
    image.paste(Image.new("RGB", (size[0] // 2, size[1] // 3), colour), (3, 4))
    return image


def _jpeg_with_exif() -> bytes:
    """A camera photo: EXIF with the maker, a GPS block and orientation 6 (shown turned 90 degrees)."""
    exif = Image.Exif()
    exif[0x010F] = "SecretCam"  # Make
    exif[0x0112] = 6  # Orientation: rotate 90 CW when shown
    exif[0x8825] = {1: "N", 2: (48.0, 51.0, 29.0)}  # GPSInfo
    buffer = io.BytesIO()
    _screenshot("navy").save(buffer, format="JPEG", exif=exif, quality=95)
    return buffer.getvalue()


def _png_with_text(path):
    info = PngImagePlugin.PngInfo()
    info.add_text("Author", "alice@example.com")
    _screenshot("darkred").save(path, format="PNG", pnginfo=info)
    return path


def _image_turn(part: dict, text="What does this screen say?") -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "It says the payment failed; retry with another card."}]}


def _files(tmp_path):
    (tmp_path / "screens").mkdir()
    png = _png_with_text(tmp_path / "screens" / "order-4411-alice.png")
    url = "data:image/jpeg;base64," + base64.b64encode(_jpeg_with_exif()).decode()
    rows = TEXT + [_image_turn({"type": "image_url", "image_url": {"url": url}}),
                   _image_turn({"type": "image", "path": "screens/order-4411-alice.png"}, "Why is my order stuck?")]
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, png


def test_images_are_kept_as_their_pixels_alone_and_sampled_for_a_vision_model(vlm, tmp_path):
    from pipeline.engines import vision

    source, png = _files(tmp_path)
    result = calib.run(source, tmp_path / "out", vlm, seq_len=32, num_blocks=2, holdout=1)
    out, stats = tmp_path / "out", result.stats
    assert (stats["images"], stats["image_conversations"], stats["images_dropped"], stats["image_samples"]) == (2, 2, 0, 2)
    kept = sorted((out / "images").iterdir())
    assert len(kept) == 2
    for path in kept:
        data = path.read_bytes()
        assert path.name == hashlib.sha256(data).hexdigest() + ".png"
        with Image.open(path) as image:
            assert image.mode == "RGB" and not image.info and not image.getexif()  # no EXIF, no text chunk
    expected = [ImageOps.exif_transpose(Image.open(io.BytesIO(_jpeg_with_exif()))).convert("RGB"),
                Image.open(png).convert("RGB")]
    assert sorted(i.tobytes() for i in expected) == sorted(Image.open(p).tobytes() for p in kept)  # same pixels,
    assert {Image.open(p).size for p in kept} == {(24, 40), (40, 24)}  # the photo upright as it is shown
    written = (out / "calib_conversations.jsonl").read_text() + (out / "stats.json").read_text()
    for secret in ("order-4411-alice", "screens/", "SecretCam", "alice@example.com", "base64"):
        assert secret not in written
    lines = [json.loads(line) for line in (out / "calib_conversations.jsonl").read_text().splitlines()]
    with_images = [m for line in lines for m in line["messages"] if m.get("images")]
    assert len(with_images) == 2 and all(m["content"].startswith("<image>\n") for m in with_images)
    held = read_jsonl(out / "holdout.jsonl")
    assert held and not any("<image>" in json.dumps(h) for h in held)  # held out: text conversations only
    samples = read_jsonl(out / "calib_images.jsonl")
    from transformers import AutoTokenizer

    prompter = vision.ImagePrompter(vlm, AutoTokenizer.from_pretrained(vlm))
    for sample in samples:
        assert sample["input_ids"].count(prompter.image_token_id) == len(sample["images"]) == 1
        image = Image.open(out / sample["images"][0]).convert("RGB")
        assert sample["image_tokens"] == vision.image_tokens(prompter.image_processor, [image])
    assert stats["image_sample_tokens"] == sum(len(s["input_ids"]) - 1 + s["image_tokens"][0] for s in samples)
    assert "2 image samples (2 images" in result.summary()


def test_a_text_only_model_drops_the_images_with_a_line(tiny_llama, tmp_path):
    source, _ = _files(tmp_path)
    result = calib.run(source, tmp_path / "out", tiny_llama, seq_len=32, num_blocks=2, holdout=1)
    stats = result.stats
    assert (stats["images"], stats["images_dropped"], stats["image_samples"]) == (0, 2, 0)
    assert "2 images dropped" in stats["images_note"] and "no vision tower" in stats["images_note"]
    assert not (tmp_path / "out" / "images").exists() and (tmp_path / "out" / "calib_images.jsonl").read_text() == "\n"
    text = (tmp_path / "out" / "calib_conversations.jsonl").read_text()
    assert "Why is my order stuck?" in text and "<image>" not in text  # its text still calibrates
    assert "2 images dropped" in result.summary()


def test_a_text_file_writes_stats_as_before(tiny_llama, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TEXT), encoding="utf-8")
    stats = calib.run(path, tmp_path / "out", tiny_llama, seq_len=32, num_blocks=2, holdout=1).stats
    assert "images" not in stats and "image_samples" not in stats


def _bad(tmp_path, part, **settings) -> str:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_image_turn(part)) + "\n", encoding="utf-8")
    with pytest.raises(UserError) as err:  # strict: the first bad record stops the run
        calib.run(path, tmp_path / "out", settings.pop("model"), strict=True, seq_len=32, num_blocks=2, holdout=0,
                  **settings)
    assert not (tmp_path / "out").exists()
    return str(err.value)


def _data_url(image: Image.Image, fmt="PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("part, settings, expected", [
    ({"type": "image_url", "image_url": {"url": "screens/none.png"}}, {},
     "bad.jsonl:1: messages[0].content[0]: image file 'none.png' not found (paths are relative to the conversation "
     "file's folder); put it there or fix the path"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}, {},
     "bad.jsonl:1: messages[0].content[0]: the image cannot be read (UnidentifiedImageError); export it again as PNG "
     "or JPEG"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, {},
     "messages[0].content[0]: the data URL's base64 is broken; encode the image again"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, {},
     "messages[0].content[0]: an image named by a URL would be fetched, and calibration reads no network"),
    ({"type": "image_url", "image_url": {"url": _data_url(_screenshot("navy", (64, 64)))}}, {"max_image_pixels": 1000},
     "messages[0].content[0]: the image is 64 x 64 = 4,096 pixels, over calib.max_image_pixels 1,000; scale it down "
     "or raise the limit"),
    ({"type": "image_url", "image_url": {"url": _data_url(Image.effect_noise((64, 64), 60).convert("RGB"))}},
     {"max_image_bytes": 1024}, "over calib.max_image_bytes 1,024; scale the image down or raise the limit"),
    ({"type": "image"}, {}, "messages[0].content[0]: an image part names no image; give image_url.url"),
    ({"type": "audio", "audio": "x"}, {}, "messages[0].content[0]: a part of type 'audio' cannot be read"),
])
def test_a_bad_image_names_file_line_part_and_fix(vlm, tmp_path, part, settings, expected):
    assert expected in _bad(tmp_path, part, model=vlm, **settings)


def test_a_file_image_over_the_byte_limit_is_refused_before_it_is_read(vlm, tmp_path):
    (tmp_path / "screens").mkdir()
    Image.effect_noise((128, 128), 60).convert("RGB").save(tmp_path / "screens" / "big.png")
    message = _bad(tmp_path, {"type": "image_url", "image_url": {"url": "screens/big.png"}}, model=vlm,
                   max_image_bytes=2048)
    assert "image file 'big.png' is" in message and "over calib.max_image_bytes 2,048" in message


def test_the_card_says_what_the_calibration_held():
    """stats.json's images in the card's words: conversations, images, tokens, and whether the variant calibrated on
    them; a text-only base's dropped images; nothing more for a text build."""
    from pipeline.report.card_recipe import calibration

    quant = {"method": "awq", "calibration": {"blocks": 2, "seq_len": 32, "sha256": "ab"}}
    text = {"source": "logs.jsonl", "calib_conversations": 14, "holdout": 1, "redaction": True, "redactions": {}}
    held = calibration(quant, {**text, "images": 3, "image_conversations": 2, "image_samples": 2,
                               "image_sample_images": 3, "image_sample_tokens": 1234})
    assert held[1] == ("- calibration images: 2 conversations held 3 images, kept as their pixels alone (no metadata, "
                       "no file names); 2 of them taken as samples (3 images, 1,234 tokens with each image as its "
                       "image tokens), not calibrated on: the quantize stage calibrated on the text blocks only")
    used = {**quant, "calibration": {**quant["calibration"], "image_samples": 2}}
    assert calibration(used, {**text, "images": 3, "image_conversations": 2, "image_samples": 2})[1].endswith(
        "calibrated on with the text blocks")
    dropped = calibration(quant, {**text, "images_dropped": 3})
    assert dropped[1].startswith("- calibration images: 3 dropped, the base has no vision tower")
    assert len(calibration(quant, text)) == 1


def test_conversations_with_images_are_never_held_out(vlm, tmp_path):
    """The judge, kl, bench and ppl-chat read the held-out turns as text: a file whose every user turn carries an
    image has none to hold out, and the message says why."""
    (tmp_path / "screens").mkdir()
    _png_with_text(tmp_path / "screens" / "a.png")
    path = tmp_path / "only_images.jsonl"
    path.write_text(json.dumps(_image_turn({"type": "image", "path": "screens/a.png"})) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no record without images \(those are read as text\) has a user turn, so "
                                        r"none can be held out .*calib.holdout: 1"):
        calib.run(path, tmp_path / "out", vlm, seq_len=16, num_blocks=1, holdout=1)


@pytest.mark.slow
def test_awq_and_fp8_on_a_vlm_calibrate_on_the_images_through_its_processor(vlm, tmp_path):
    """The quantize stage reads calib_images.jsonl beside the blocks: each sample's image tokens expanded by the
    model's own image processor, its pixels through the vision tower, one sample per batch with the text blocks.
    The samples shape AWQ's weights (against the same build without them), the pixels shape FP8's static activation
    scales (against the same build with blank images of the same sizes: the same tokens), quant.json says what the
    calibration held, and the vision tower stays bit-identical to the base's."""
    import shutil

    from conftest import read_tensors
    from pipeline.stages.quantize import run as quantize_run

    source, _ = _files(tmp_path)
    build = tmp_path / "build"
    calib.run(source, build, vlm, seq_len=32, num_blocks=2, holdout=1)
    text_only, blank = tmp_path / "text_build", tmp_path / "blank_build"
    shutil.copytree(build, text_only)
    (text_only / "calib_images.jsonl").unlink()
    shutil.copytree(build, blank)
    for path in (blank / "images").iterdir():
        Image.new("RGB", Image.open(path).size, "gray").save(path)
    quantize_run(vlm, tmp_path / "awq", build / "calib.jsonl", "awq", batch_size=2, n_grid=3)
    quantize_run(vlm, tmp_path / "awq_text", text_only / "calib.jsonl", "awq", batch_size=2, n_grid=3)
    quantize_run(vlm, tmp_path / "fp8", build / "calib.jsonl", "fp8")
    quantize_run(vlm, tmp_path / "fp8_blank", blank / "calib.jsonl", "fp8")
    for variant in ("awq", "fp8", "fp8_blank"):
        info = json.loads((tmp_path / variant / "quant.json").read_text())
        assert info["calibration"]["image_samples"] == 2 and info["calibration"]["image_sample_images"] == 2
        assert info["calibration"]["image_sample_tokens"] > 2 * 32 // 2
        assert info["verify"]["vision"]["mismatched"] == [] and info["verify"]["vision"]["vision_tensors"] > 0
    assert "image_samples" not in json.loads((tmp_path / "awq_text" / "quant.json").read_text())["calibration"]

    def differ(a: str, b: str, suffix: str) -> list[str]:
        first, second = read_tensors(tmp_path / a), read_tensors(tmp_path / b)
        keys = [k for k in first if k.endswith(suffix)]
        assert keys
        return [k for k in keys if not first[k].equal(second[k])]

    assert differ("awq", "awq_text", ".weight_packed")
    assert differ("fp8", "fp8_blank", ".input_scale")
