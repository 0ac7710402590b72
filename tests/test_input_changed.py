"""A calibration file changed while `quantize calib` reads it is refused, never read as a mix of two files (issue
70.2): overwritten in place (same size or not), appended to, or replaced by a rename, part-way through the read. The
fingerprint recorded is that of the bytes read, not of whatever is at the path after the stage."""

import gzip
import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.calib.load import read_conversations
from pipeline.calib.store import ConversationStore
from pipeline.errors import UserError
from pipeline.formats.read_watch import ReadWatch

SOURCE = REPO / "calib_data" / "support_logs.jsonl"


def _other_conversations(size: int) -> bytes:
    """Other valid conversations, `size` bytes in all (padded with blank lines)."""
    lines, text = [], b""
    while len(text) < size - 200:
        record = {"messages": [{"role": "user", "content": f"another question {len(lines)}"},
                               {"role": "assistant", "content": f"another answer {len(lines)}"}]}
        lines.append(json.dumps(record).encode() + b"\n")
        text = b"".join(lines)
    return text + b"\n" * (size - len(text))


def overwrite_same_size(path):
    data = path.read_bytes()
    with open(path, "r+b") as handle:  # in place: same inode, same size
        handle.write(_other_conversations(len(data)))


def append(path):
    with open(path, "ab") as handle:
        handle.write(_other_conversations(4096))


def replace_by_rename(path):
    new = path.with_name("new.tmp")
    new.write_bytes(_other_conversations(path.stat().st_size))
    os.replace(new, path)


CHANGES = {"overwritten in place, same size": (overwrite_same_size, "it was written to"),
           "appended to": (append, "its size went from"),
           "replaced by a rename": (replace_by_rename, "another file was put in its place")}


def _source(tmp_path, kind: str):
    data = SOURCE.read_bytes()
    if kind == "jsonl":
        path = tmp_path / "logs.jsonl"
        path.write_bytes(data)
    elif kind == "jsonl.gz":
        path = tmp_path / "logs.jsonl.gz"
        path.write_bytes(gzip.compress(data))
    else:
        records = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        path = tmp_path / "logs.json"
        path.write_text(json.dumps(records, indent=1))
    return path


def _read(path, advance=None, watch=None):
    with ConversationStore() as store:
        return read_conversations(path, store, strict=False, max_bad_fraction=0.5, do_redact=False,
                                  extra_patterns=[], advance=advance, watch=watch)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_calibration_file_changed_while_read_is_refused(tmp_path, kind, change):
    path = _source(tmp_path, kind)
    edit, said = CHANGES[change]
    watch = ReadWatch(path, "calibration file")
    if kind == "jsonl":  # part-way through: once a tenth of the bytes are read
        read, size, changed = [0], path.stat().st_size, []

        def advance(n):
            read[0] += n
            if read[0] >= size // 10 and not changed:
                changed.append(edit(path))
        with pytest.raises(UserError) as refused:
            _read(path, advance, watch)
    else:  # a .gz and a .json array are read in chunks: changed after the first chunk was read
        opened = watch.open

        def open_then_change():
            handle = opened()
            handle.peek(1)
            edit(path)
            return handle
        watch.open = open_then_change
        with pytest.raises(UserError) as refused:
            _read(path, watch=watch)
    message = str(refused.value)
    assert message.startswith(f"{path}: the calibration file changed while it was read (") and said in message
    assert "nothing was written" in message


def test_the_fingerprint_is_of_the_bytes_read(tmp_path):
    path = _source(tmp_path, "jsonl.gz")
    watch = ReadWatch(path)
    stats = _read(path, watch=watch)
    assert stats.records_in > 0
    assert watch.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()  # the gzip trailer included


def test_calib_records_the_source_it_read(tmp_path, tiny_llama):
    from pipeline.outputs import read_stage_record
    from pipeline.stages import calib

    path = _source(tmp_path, "jsonl")
    out = tmp_path / "build"
    result = calib.run(path, out, tiny_llama, seq_len=64, num_blocks=4, holdout=2)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert result.stats["source_sha256"] == digest
    assert read_stage_record(out)["inputs"]["source"]["fingerprint"] == f"sha256:{digest}"


@pytest.mark.parametrize("change", ["a file rewritten", "a file replaced", "a folder's file changed"])
def test_any_stage_refuses_an_input_changed_while_it_ran(tmp_path, change):
    """Every stage writing through outputs.atomic_dir (resave, calib, quantize, export, card ...) fingerprints its
    inputs as it starts and refuses one changed by its end: nothing kept, nothing left, the record never names the
    new file (a calib.jsonl replaced during a quantize stage)."""
    from pipeline.outputs import atomic_dir

    source, folder = tmp_path / "calib.jsonl", tmp_path / "base"
    source.write_text("[1, 2, 3]\n")
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    dest = tmp_path / "out" / "variant"
    with pytest.raises(UserError) as refused:
        with atomic_dir(dest, "quantize", {"calibration file": source, "base checkpoint": folder}) as tmp:
            (tmp / "model.safetensors").write_bytes(b"weights")
            if change == "a file rewritten":
                source.write_text("[4, 5, 6]\n")
            elif change == "a file replaced":
                (tmp_path / "new").write_text("[7]\n")
                os.replace(tmp_path / "new", source)
            else:
                (folder / "config.json").write_text('{"changed": true}')
    label = "base checkpoint" if "folder" in change else "calibration file"
    assert f"the {label} " in str(refused.value) and "changed while the quantize stage ran" in str(refused.value)
    assert not dest.exists() and not (tmp_path / "out").exists()  # nor its temp folder, nor the folder made for it


# ---------------------------------------------------------------- image files a calibration file names (issue 70.2)

@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from tiny import save_tiny_glm4v

    return save_tiny_glm4v(tmp_path_factory.mktemp("vlm") / "glm4v")


def _image_logs(tmp_path, parts: int = 1):
    """A calibration file whose last `parts` conversations name the same image file by path; the file."""
    from test_calib_images import TEXT, _image_turn, _screenshot

    (tmp_path / "screens").mkdir(parents=True)
    image = tmp_path / "screens" / "a.png"
    _screenshot("navy").save(image)
    questions = ["Why does checkout fail on this screen?", "Which setting here turns the dark theme off?"]
    rows = TEXT + [_image_turn({"type": "image", "path": "screens/a.png"}, questions[i]) for i in range(parts)]
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path, image


def _other_image(path):
    from test_calib_images import _screenshot

    new = path.with_name("new.png")
    _screenshot("darkred").save(new)
    return new


def _edit(image, how: str) -> None:
    new = _other_image(image)
    if how == "replaced by a rename":
        os.replace(new, image)
    else:  # overwritten in place: the same inode
        data = new.read_bytes()
        new.unlink()
        with open(image, "r+b") as handle:
            handle.write(data)
            handle.truncate()


def _refused_calib(path, out, model) -> str:
    from pipeline.stages import calib

    with pytest.raises(UserError) as refused:
        calib.run(path, out, model, seq_len=32, num_blocks=2, holdout=1)
    assert not out.exists()  # nothing kept, not half of it
    return str(refused.value)


@pytest.mark.parametrize("how", ["overwritten in place", "replaced by a rename"])
def test_an_image_file_changed_while_read_is_refused(tmp_path, vlm, monkeypatch, how):
    """The image's bytes change under the reader (after its first bytes were read): refused, never kept as a mix."""
    from pipeline.formats import image_parts

    path, image = _image_logs(tmp_path)

    class ChangedMidRead(io.BufferedReader):
        def read(self, size=-1):
            head = super().read(16)
            _edit(image, how)  # the rest is read from what is there now
            return head + super().read(size - 16 if size and size > 0 else -1)

    opened = image_parts.__dict__.get("open", open)
    monkeypatch.setattr(image_parts, "open", lambda file, mode="r", *a, **k: ChangedMidRead(
        io.FileIO(file, "r")) if Path(file) == image else opened(file, mode, *a, **k), raising=False)
    message = _refused_calib(path, tmp_path / "out", vlm)
    said = ("another file was put in its place",) if "rename" in how else ("it was written to", "its size went from")
    assert message.startswith(f"{image}: the image file changed while the calibration read it (")
    assert message.split("read it (")[1].startswith(said), message
    assert "nothing was written from it" in message


@pytest.mark.parametrize("how", ["overwritten in place", "replaced by a rename"])
def test_an_image_file_changed_between_two_reads_or_before_the_end_is_refused(tmp_path, vlm, monkeypatch, how):
    """Two conversations name one image file: it changed between their reads (each read whole, but of two files);
    or it changed after it was read, while the stage worked on: refused, the record would name neither."""
    from pipeline.formats import image_parts
    from pipeline.stages import calib

    path, image = _image_logs(tmp_path, parts=2)
    keep, reads = image_parts.keep_image, []

    def keep_then_change(source, *args):
        kept = keep(source, *args)
        reads.append(source)
        if len(reads) == 1:
            _edit(image, how)
        return kept
    monkeypatch.setattr(image_parts, "keep_image", keep_then_change)
    message = _refused_calib(path, tmp_path / "out", vlm)
    assert message.startswith(f"{image}: the image file changed while the calibration read it (") and len(reads) == 1
    monkeypatch.undo()

    path, image = _image_logs(tmp_path / "later", parts=1)
    samples = calib._image_samples

    def change_then_sample(*args):
        _edit(image, how)
        return samples(*args)
    monkeypatch.setattr(calib, "_image_samples", change_then_sample)
    message = _refused_calib(path, tmp_path / "later" / "out", vlm)
    assert message.startswith(f"{image}: the image file changed while the calibration read it (")


def test_an_image_file_read_twice_unchanged_is_kept_once(tmp_path, vlm):
    from pipeline.stages import calib

    path, _ = _image_logs(tmp_path, parts=2)
    stats = calib.run(path, tmp_path / "out", vlm, seq_len=32, num_blocks=2, holdout=1).stats
    assert stats["images"] == 2 and len(list((tmp_path / "out" / "images").iterdir())) == 1


# ---------------------------------------------------------------- what an eval reads (issue 70.2, 70.4)

def _changed_during(monkeypatch, edit) -> None:
    """`edit()` runs once the suite's items are answered, before its results are written."""
    from pipeline.stages import evaluate

    lines_and_summary = evaluate._lines_and_summary

    def edit_then(*args, **kwargs):
        edit()
        return lines_and_summary(*args, **kwargs)
    monkeypatch.setattr(evaluate, "_lines_and_summary", edit_then)


@pytest.mark.parametrize("change", ["the conversations an option names", "the checkpoint's weights"])
def test_an_eval_refuses_what_it_read_changed_while_it_ran(tmp_path, tiny_llama, tiny_calib, monkeypatch, change):
    """ppl-chat reads its option's file and the checkpoint: either rewritten while it runs, no result is kept (the
    summary would name the new weights beside scores of the old, or mix two holdouts)."""
    import shutil

    from pipeline.stages import evaluate

    model, data = tmp_path / "m", tmp_path / "holdout.jsonl"
    shutil.copytree(tiny_llama, model)
    shutil.copy(tiny_calib / "holdout.jsonl", data)
    if change.startswith("the conversations"):
        _changed_during(monkeypatch, lambda: data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n"))
        said = f"{data} (suites.ppl-chat.options.data) changed while the eval of ppl-chat ran"
    else:
        weights = model / "model.safetensors"
        _changed_during(monkeypatch, lambda: (weights.with_name("new").write_bytes(weights.read_bytes()),
                                              os.replace(weights.with_name("new"), weights)))
        said = f"the checkpoint {model} changed while the eval of ppl-chat ran"
    with pytest.raises(UserError) as refused:
        evaluate.run(model, suite="ppl-chat", task="quant_ppl_chat", variant="m", out_dir=tmp_path / "r", limit=2,
                     options={"data": str(data)})
    assert said in str(refused.value) and "none were kept" in str(refused.value)
    assert not (tmp_path / "r" / "ppl-chat.json").exists() and not (tmp_path / "r" / "ppl-chat.jsonl").exists()
    monkeypatch.undo()  # unchanged: written, and the weights recorded are those it was scored on
    result = evaluate.run(model, suite="ppl-chat", task="quant_ppl_chat", variant="m", out_dir=tmp_path / "r",
                          limit=2, options={"data": str(data)})
    from pipeline.checkpoints.fingerprint import weights_fingerprint

    assert result.figures["checkpoint"] == weights_fingerprint(model)


def test_an_eval_refuses_a_dataset_copy_changed_while_it_ran(tmp_path, monkeypatch):
    """suites.<name>.dataset_path: a local copy of an lm-eval task's data, changed while the suite runs."""
    from test_lm_eval_image_task import _eval, save_tiny_glm4v, write_chartqa

    model, data = save_tiny_glm4v(tmp_path / "glm4v"), write_chartqa(tmp_path / "chartqa")
    parquet = next((data / "data").iterdir())
    _changed_during(monkeypatch, lambda: parquet.write_bytes(parquet.read_bytes() + b"\0"))
    with pytest.raises(UserError) as refused:
        _eval(model, tmp_path / "r", "hf", "charts", "chartqa", data)
    assert f"{data} (suites.charts.dataset_path) changed while the eval of charts ran" in str(refused.value)
    assert not (tmp_path / "r" / "charts.json").exists()


@pytest.mark.parametrize("change", ["the calibration file", "the base checkpoint"])
def test_a_quantize_stage_refuses_an_input_changed_while_it_calibrated(tmp_path, tiny_llama, tiny_calib, monkeypatch,
                                                                       change):
    """The quantize stage reads its inputs long before it writes (hours of calibration): they are fingerprinted
    before it reads them, so one changed while it calibrated is refused; before, the fingerprint was taken as the
    output folder opened, after calibration, and the record named the new file beside a build from the old."""
    import shutil

    from pipeline.outputs import read_stage_record
    from pipeline.stages import quantize

    model, calib = shutil.copytree(tiny_llama, tmp_path / "base"), shutil.copytree(tiny_calib, tmp_path / "calib")
    calibrate = quantize.calibrate_loaded

    def change_then_calibrate(*args, **kwargs):
        if change == "the calibration file":
            (calib / "calib.jsonl").write_text((calib / "calib.jsonl").read_text() + "\n")
        else:
            (model / "generation_config.json").write_text('{"changed": true}\n')
        return calibrate(*args, **kwargs)
    monkeypatch.setattr(quantize, "calibrate_loaded", change_then_calibrate)
    with pytest.raises(UserError) as refused:
        quantize.run(model, tmp_path / "out", calib / "calib.jsonl", "rtn", group_size=32)
    label = "calibration file" if "calibration" in change else "base checkpoint"
    assert f"the {label} " in str(refused.value) and "changed while the quantize stage ran" in str(refused.value)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    quantize.run(model, tmp_path / "out", calib / "calib.jsonl", "rtn", group_size=32)
    record = read_stage_record(tmp_path / "out")["inputs"]
    assert set(record) == {"base checkpoint", "calibration file", "calibration image samples"}  # a text build's too
