import gzip
import json

import pytest

from conftest import REPO, read_jsonl
from pipeline import calib
from pipeline.errors import UserError

TURNS = {"turns": [{"role": "User", "content": "Where is my parcel?"}, {"role": "Agent", "content": "Let me check."}]}


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def run(path, out, model, **kw):
    settings = dict(seq_len=32, num_blocks=2, holdout=1)
    settings.update(kw)
    return calib.run(path, out, model, **settings)


@pytest.mark.parametrize("record, shape", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "messages"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, "conversations"),
    (TURNS, "turns"),
    ({"prompt": "hi", "response": "hello"}, "prompt/response"),
    ({"instruction": "hi", "input": "more", "output": "hello"}, "instruction/output"),
    ({"text": "plain text"}, "text"),
])
def test_each_shape_is_detected(record, shape):
    conversation = calib.to_conversation(record, "f.jsonl:1")
    assert conversation.shape == shape
    assert all(m["role"] in ("user", "assistant", "system", "text") for m in conversation.messages)


@pytest.mark.parametrize("line, expected", [
    ('{"turns": [', "f.jsonl:1: invalid JSON"),
    ('{"dialog": []}', "f.jsonl:1: unknown record shape (keys: dialog)"),
    ('{"turns": [{"role": "user", "content": ""}]}', "turns[0].content is empty"),
    ('{"turns": [{"role": "user", "content": 5}]}', "turns[0].content is int, not text"),
    ('{"turns": [{"role": "narrator", "content": "x"}]}', "role 'narrator' cannot be mapped"),
])
def test_bad_records_name_file_line_and_fix(tmp_path, line, expected):
    path = write_lines(tmp_path / "f.jsonl", [line])
    with pytest.raises(UserError) as err:
        calib.load_conversations(path, strict=True, max_bad_fraction=0, do_redact=False, extra_patterns=[])
    assert expected.replace("f.jsonl", str(path)) in str(err.value)


def test_bad_fraction_over_limit_fails_and_lists_records(tmp_path, tiny_llama):
    path = write_lines(tmp_path / "f.jsonl", [TURNS] * 8 + ["not json"] * 2)
    with pytest.raises(UserError) as err:
        run(path, tmp_path / "out", tiny_llama)
    assert "2 of 10 records are bad" in str(err.value) and f"{path}:9: invalid JSON" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_undecodable_bytes_bom_and_crlf(tmp_path):
    path = tmp_path / "f.jsonl"
    good = json.dumps(TURNS).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\r\n" + b'{"text": "\xff\xfe"}\r\n' + good.replace(b"parcel", b"box") + b"\r\n")
    conversations, stats = calib.load_conversations(path, strict=False, max_bad_fraction=0.5, do_redact=False, extra_patterns=[])
    assert len(conversations) == 2
    assert stats.bad_records == [f"{path}:2: bytes at 10 are not UTF-8; re-export the file as UTF-8"]


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing.jsonl", "no such file"),
    (lambda p: p, "is a directory"),
    (lambda p: (p / "empty.jsonl").write_text("") or p / "empty.jsonl", "holds no records"),
])
def test_missing_empty_and_directory(tmp_path, make, expected):
    with pytest.raises(UserError, match=expected):
        calib.load_conversations(make(tmp_path), strict=False, max_bad_fraction=0.05, do_redact=False, extra_patterns=[])


def test_gz_and_json_array(tmp_path):
    gz = tmp_path / "f.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(TURNS) + "\n")
    arr = tmp_path / "f.json"
    arr.write_text(json.dumps([TURNS, {"prompt": "a", "response": "b"}]))
    assert len(calib.load_conversations(gz, strict=True, max_bad_fraction=0, do_redact=False, extra_patterns=[])[0]) == 1
    assert len(calib.load_conversations(arr, strict=True, max_bad_fraction=0, do_redact=False, extra_patterns=[])[0]) == 2


LABELLED = [
    ("write to jane.doe+shop@example.co.uk today", "email"),
    ("call +91 98765 43210 after six", "phone"),
    ("my number is 9876543210.", "phone"),
    ("card 4111 1111 1111 1111 was charged", "card"),
    ("paid with 5500005555555559", "card"),
    ("IBAN DE89 3704 0044 0532 0130 00 please", "iban"),
    ("login from 192.168.10.24 failed", "ip"),
]


@pytest.mark.parametrize("text, kind", LABELLED)
def test_redaction_finds_each_kind(text, kind):
    import collections

    counts = collections.Counter()
    redacted = calib.redact(text, counts, [])
    assert counts[kind] == 1 and f"[{kind.upper()}]" in redacted


def test_redaction_leaves_order_numbers_and_dates():
    import collections

    counts = collections.Counter()
    text = "order #502-2345678-9012345 placed on 12.05.2024 at 10:30, 4111 1111 1111 1112 (bad Luhn)"
    assert calib.redact(text, counts, []) == text and not counts


def test_split_never_shares_a_conversation_and_output_is_deterministic(tmp_path, tiny_llama):
    source = tmp_path.parent / "logs.jsonl"
    rows = [json.loads(line) for line in open(REPO / "calib_data" / "support_logs.jsonl", encoding="utf-8").read().splitlines()[:60]]
    write_lines(source, rows + rows[:5])  # 5 exact duplicates
    first = run(source, tmp_path / "a", tiny_llama, holdout=6, num_blocks=4)
    second = run(source, tmp_path / "b", tiny_llama, holdout=6, num_blocks=4)
    for name in ("calib.jsonl", "holdout.jsonl", "calib_conversations.jsonl", "stats.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first.stats["dropped"]["duplicate"] == 5
    held = {json.dumps(r["messages"][0]) for r in read_jsonl(tmp_path / "a" / "holdout.jsonl")}
    used = {json.dumps(r["messages"][0]) for r in read_jsonl(tmp_path / "a" / "calib_conversations.jsonl")}
    assert len(held) == 6 and not held & used
    blocks = read_jsonl(tmp_path / "a" / "calib.jsonl")
    assert len(blocks) == 4 and {len(b["input_ids"]) for b in blocks} == {32}


def test_too_small_calibration_set_says_so(tmp_path, tiny_llama):
    path = write_lines(tmp_path / "f.jsonl", [TURNS])
    with pytest.raises(UserError, match="calibration set too small"):
        run(path, tmp_path / "out", tiny_llama, holdout=0, num_blocks=50)
    assert not (tmp_path / "out").exists()
