import collections
import gzip
import json
import os
import re
import subprocess
import sys
import tracemalloc

import pytest

from conftest import REPO, read_jsonl, write_params
from pipeline.stages import calib
from pipeline.errors import UserError

TURNS = {"turns": [{"role": "User", "content": "Where is my parcel?"}, {"role": "Agent", "content": "Let me check."}]}
LOGS = [json.loads(line) for line in (REPO / "calib_data" / "support_logs.jsonl").read_text(encoding="utf-8").splitlines()]


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def run(path, out, model, **kw):
    settings = dict(seq_len=32, num_blocks=2, holdout=1)
    settings.update(kw)
    return calib.run(path, out, model, **settings)


def load(path, strict=False, max_bad_fraction=0.5, do_redact=False, extra_patterns=()):
    return calib.load_conversations(path, strict=strict, max_bad_fraction=max_bad_fraction, do_redact=do_redact,
                                    extra_patterns=list(extra_patterns))


def strict_error(path) -> str:
    with pytest.raises(UserError) as err:
        load(path, strict=True)
    return str(err.value)


def make_file(directory, name, data):
    path = directory / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def redactions_in(rows) -> dict:
    counts = collections.Counter()
    for row in rows:
        for turn in row["turns"]:
            calib.redact(turn["content"], counts, [])
    return counts


def cli(args):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------- shapes

HI_HELLO = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize("record, shape, messages", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "messages", HI_HELLO),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, "conversations", HI_HELLO),
    ({"turns": [{"role": "Customer", "content": " hi "}, {"role": "BOT", "content": "hello"}]}, "turns", HI_HELLO),
    ({"prompt": "hi", "response": "hello"}, "prompt/response", HI_HELLO),
    ({"instruction": "hi", "output": "hello"}, "instruction/output", HI_HELLO),
    ({"instruction": "hi", "input": "more", "output": "hello"}, "instruction/output",
     [{"role": "user", "content": "hi\n\nmore"}, {"role": "assistant", "content": "hello"}]),
    ({"text": "plain text"}, "text", [{"role": "text", "content": "plain text"}]),
])
def test_each_shape_is_detected(record, shape, messages):
    conversation = calib.to_conversation(record, "f.jsonl:1")
    assert conversation.shape == shape and conversation.messages == messages


def test_role_aliases_map_in_any_case():
    turns = [{"role": role, "content": f"turn {i}"} for i, role in
             enumerate(["SYSTEM", "customer", "Agent", "User", "bot", "Assistant", "agent", "HUMAN", "gpt"])]
    roles = [m["role"] for m in calib.to_conversation({"turns": turns}, "f.jsonl:1").messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "assistant", "assistant", "user", "assistant"]


def test_summary_counts_records_per_shape(tmp_path, tiny_llama):
    rows = [{"messages": [{"role": "user", "content": r["turns"][0]["content"]},
                          {"role": "assistant", "content": r["turns"][1]["content"]}]} for r in LOGS[:3]]
    rows += [{"conversations": [{"from": "human", "value": r["turns"][0]["content"]},
                                {"from": "gpt", "value": r["turns"][1]["content"]}]} for r in LOGS[3:5]]
    rows += LOGS[5:9] + [{"prompt": LOGS[9]["turns"][0]["content"], "response": LOGS[9]["turns"][1]["content"]},
                         {"instruction": LOGS[10]["turns"][0]["content"], "output": LOGS[10]["turns"][1]["content"]},
                         {"text": LOGS[11]["turns"][1]["content"]}]
    result = run(write_lines(tmp_path / "mixed.jsonl", rows), tmp_path / "out", tiny_llama)
    assert result.stats["shapes"] == {"conversations": 2, "instruction/output": 1, "messages": 3,
                                      "prompt/response": 1, "text": 1, "turns": 4}


# ---------------------------------------------------------------- malformed input: FILE:LINE, problem, fix

@pytest.mark.parametrize("line, expected", [
    ('{"turns": [', "f.jsonl:1: invalid JSON (Expecting value at column 12); make the line one JSON object or remove it"),
    ('{"dialog": []}', "f.jsonl:1: unknown record shape (keys: dialog); use one of: messages, conversations, turns"),
    ('{"turns": [{"role": "user", "content": ""}]}', "f.jsonl:1: turns[0].content is empty; drop the turn or fill it"),
    ('{"turns": [{"role": "user", "content": "  \\n "}]}', "f.jsonl:1: turns[0].content is empty; drop the turn or fill it"),
    ('{"turns": [{"role": "user", "content": 5}]}', "f.jsonl:1: turns[0].content is a number, not text; make it a string"),
    ('{"messages": [{"role": "user", "content": null}]}', "f.jsonl:1: messages[0].content is null, not text; make it a string"),
    ('{"prompt": ["a"], "response": "b"}', "f.jsonl:1: prompt is an array, not text; make it a string"),
    ('{"turns": [{"role": "narrator", "content": "x"}]}', "f.jsonl:1: turns[0].role 'narrator' cannot be mapped; use one of"),
    ('{"conversations": [{"from": 3, "value": "x"}]}', "f.jsonl:1: conversations[0].from 3 cannot be mapped; use one of"),
    ('{"turns": []}', "f.jsonl:1: 'turns' must be a non-empty list of turns; give it"),
    ('{"turns": [{"content": "x"}]}', "f.jsonl:1: turns[0] needs 'role' and 'content' keys; add them or drop the turn"),
    ('[{"text": "a"}]', "f.jsonl:1: a record must be a JSON object, not an array; put one conversation object per line"),
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "f.jsonl:1: JSON that cannot be loaded (maximum recursion depth"),
    ('{"text": ' + "9" * 5000 + "}", "f.jsonl:1: JSON that cannot be loaded (Exceeds the limit (4300 digits)"),
])
def test_bad_records_name_file_line_and_fix(tmp_path, line, expected):
    path = write_lines(tmp_path / "f.jsonl", [line])
    assert expected.replace("f.jsonl", str(path)) in strict_error(path)


def test_a_library_message_quoted_in_ours_is_never_cut_mid_word(tmp_path):
    from pipeline.errors import cut

    path = write_lines(tmp_path / "f.jsonl", ['{"text": ' + "9" * 5000 + "}"])
    message = strict_error(path)
    assert "sys.set_in" not in message.replace("sys.set_int_max_str_digits()", "")  # "use sys.set_in" was shown
    assert "for integer string conversion: value has 5000 digits; use ...)" in message
    assert cut("one two three", 9) == "one two ..." and cut("one two", 9) == "one two"


def test_bad_fraction_over_limit_fails_and_lists_first_ten_and_a_count(tmp_path, tiny_llama):
    path = write_lines(tmp_path / "f.jsonl", LOGS[:8] + ["not json"] * 12)
    with pytest.raises(UserError) as err:
        run(path, tmp_path / "out", tiny_llama)
    message = str(err.value)
    assert "12 of 20 records are bad (60% > calib.max_bad_fraction 5%)" in message
    assert f"{path}:9: invalid JSON" in message and f"{path}:18: invalid JSON" in message
    assert f"{path}:19:" not in message and message.endswith("... and 2 more")
    assert not (tmp_path / "out").exists()


def test_undecodable_bytes_bom_and_crlf(tmp_path):
    path = tmp_path / "f.jsonl"
    good = json.dumps(TURNS).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\r\n" + b'{"text": "\xff\xfe"}\r\n' + good.replace(b"parcel", b"box") + b"\r\n")
    conversations, stats = load(path)
    assert [c.where for c in conversations] == [f"{path}:1", f"{path}:3"]
    assert stats.bad_records == [f"{path}:2: bytes at 10 are not UTF-8; re-export the file as UTF-8"]


def test_crlf_inside_content_is_normalised(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [{"turns": [{"role": "user", "content": "line one\r\nline two\r\n"},
                                                         {"role": "agent", "content": "ok"}]}])
    (conversation,), _ = load(path)
    assert conversation.messages[0]["content"] == "line one\nline two"


def test_a_50_mb_line_is_named_without_being_read_whole(tmp_path):
    path = tmp_path / "f.jsonl"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(TURNS) + "\n")
        handle.write('{"text": "' + "x" * (50 << 20) + '"}\n')
        handle.write(json.dumps({"text": "after the long line"}) + "\n")
    tracemalloc.start()
    try:
        conversations, stats = load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert stats.bad_records == [f"{path}:2: line is 50 MB, over the 8 MB limit for one record; "
                                 "split the conversation or drop the line"]
    assert [c.where for c in conversations] == [f"{path}:1", f"{path}:3"]
    assert peak < 3 * calib.MAX_LINE_BYTES  # the 50 MB line was skipped in steps, never held whole


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing.jsonl", "{p}/missing.jsonl: no such file; pass a .jsonl, .jsonl.gz or .json file"),
    (lambda p: p, "{p}: is a directory; pass a .jsonl, .jsonl.gz or .json file of conversations inside it"),
    (lambda p: make_file(p, "empty.jsonl", ""), "{p}/empty.jsonl:1: the file is empty; put one JSON conversation per line"),
    (lambda p: make_file(p, "blank.jsonl", "\n  \r\n\n"),
     "{p}/blank.jsonl:1: no records (the file holds only blank lines or an empty array)"),
    (lambda p: make_file(p, "empty.json", "[]"), "{p}/empty.json:1: no records"),
    (lambda p: make_file(p, "u16.jsonl", json.dumps(TURNS).encode("utf-16")),
     "{p}/u16.jsonl:1: the file is UTF-16 encoded; re-export it as UTF-8"),
    (lambda p: make_file(p, "cut.jsonl.gz", gzip.compress(b'{"text": "a"}\n' * 500)[:60]),
     "{p}/cut.jsonl.gz:501: reading failed (Compressed file ended before the end-of-stream marker was reached); "
     "a gzip file here is corrupt or truncated"),
])
def test_missing_empty_directory_encoding_and_gzip(tmp_path, make, expected):
    with pytest.raises(UserError) as err:
        load(make(tmp_path))
    assert expected.format(p=tmp_path) in str(err.value)


def test_gz_and_json_array(tmp_path):
    gz = tmp_path / "f.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(TURNS) + "\n")
    disguised = tmp_path / "g.jsonl"  # gzip data under a plain name: read by content
    disguised.write_bytes(gz.read_bytes())
    arr = tmp_path / "f.json"
    arr.write_text("\ufeff[\r\n  " + json.dumps(TURNS) + ",\r\n  " + json.dumps({"prompt": "a", "response": "b"}) + "\r\n]\r\n",
                   encoding="utf-8")
    assert len(load(gz, strict=True)[0]) == 1 and len(load(disguised, strict=True)[0]) == 1
    assert [c.where for c in load(arr, strict=True)[0]] == [f"{arr}:2:3", f"{arr}:3:3"]


@pytest.mark.parametrize("text, expected", [
    ('[{"text": "a"}, {"dialog": 1}]', "f.json:1:17: unknown record shape (keys: dialog)"),
    ('[{"text": "a"},\n {"text": }]', "f.json:2: invalid JSON (Expecting value at column 11); a .json file must be one valid array"),
    ('{"text": "a"}', "f.json:1:1: the top level is not an array; a .json file must hold an array of records"),
    ('[{"text": "a"} {"text": "b"}]', "f.json:1:16: expected ',' or ']' after a record; fix the array there"),
    ('[{"text": "a"}]\n[]', "f.json:2:1: text after the closing ']'; a .json file must hold exactly one array"),
    ('[{"text": "a"},\n {"text": "b"},\n]', "f.json:2:15: a comma after the last record, before ']'; JSON allows none "
                                            "there: delete it"),
])
def test_json_array_errors_name_line_and_column(tmp_path, text, expected):
    path = tmp_path / "f.json"
    path.write_text(text, encoding="utf-8")
    assert expected.replace("f.json", str(path)) in strict_error(path)


def test_strict_stops_at_the_first_bad_record(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [TURNS, '{"turns": 1}', "not json"] + LOGS[:50])
    message = strict_error(path)
    assert message.startswith(f"{path}:2: 'turns' must be a non-empty list of turns")
    assert "--strict stops at the first bad record" in message and f"{path}:3" not in message


def test_missing_model_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such model directory; pass --model"):
        run(write_lines(tmp_path / "f.jsonl", LOGS[:20]), tmp_path / "out", tmp_path / "no-model")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the real CLI

@pytest.fixture()
def cli_args(tmp_path, tiny_llama):
    params = write_params(tmp_path)
    return lambda source, *extra: ["calib", source, "--out", tmp_path / "out", "--model", tiny_llama,
                                   "--params", params, *extra]


@pytest.mark.parametrize("make, strict, expected", [
    (lambda p: write_lines(p / "f.jsonl", LOGS[:40] + ['{"turns": ['] + LOGS[40:80]), True,
     "{p}/f.jsonl:41: invalid JSON (Expecting value at column 12); make the line one JSON object or remove it"),
    (lambda p: write_lines(p / "f.jsonl", LOGS[:40] + ['{"turns": [{"role": "user", "content": 7}]}']), True,
     "{p}/f.jsonl:41: turns[0].content is a number, not text; make it a string"),
    (lambda p: write_lines(p / "f.jsonl", LOGS[:3] + ['{"text": "' + "y" * (9 << 20) + '"}']), False,
     "{p}/f.jsonl:4: line is 9 MB, over the 8 MB limit for one record; split the conversation or drop the line"),
    (lambda p: make_file(p, "empty.jsonl", ""), False,
     "{p}/empty.jsonl:1: the file is empty; put one JSON conversation per line"),
    (lambda p: p / "missing.jsonl", False, "{p}/missing.jsonl: no such file"),
    (lambda p: (p / "d").mkdir() or p / "d", False, "{p}/d: is a directory"),
])
def test_cli_exits_2_with_file_line_message_and_writes_nothing(tmp_path, cli_args, make, strict, expected):
    result = cli(cli_args(make(tmp_path), *(["--strict"] if strict else [])))
    assert result.exit_code == 2, result.output
    assert expected.format(p=tmp_path) in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_cli_default_mode_skips_and_lists_bad_records(tmp_path, cli_args):
    bad = ['{"turns": [{"role": "narrator", "content": "x"}]}'] * 12
    source = write_lines(tmp_path / "f.jsonl", LOGS[:150] + bad + LOGS[150:300])  # 12 of 312: under 5 %
    result = cli(cli_args(source))
    assert result.exit_code == 0, result.output
    assert "skipped 12 bad records" in result.output and f"{source}:151: turns[0].role 'narrator'" in result.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["bad_records"] == 12 and stats["dropped"]["bad record"] == 12
    assert stats["bad_records_first_10"] == [f"{source}:{151 + i}: turns[0].role 'narrator' cannot be mapped; use one of "
                                             "agent, assistant, bot, client, customer, gpt, human, model, system, user "
                                             "(any case)" for i in range(10)]


def test_one_bad_record_is_counted_in_the_singular(tmp_path, cli_args, tiny_llama):
    source = write_lines(tmp_path / "f.jsonl", LOGS[:100] + ['{"text": 1}'] + LOGS[100:200])
    result = cli(cli_args(source))
    assert result.exit_code == 0 and "skipped 1 bad record:\n" in result.output, result.output
    assert "kept 200 of 201 records (dropped 1 bad record)" in result.output
    with pytest.raises(UserError, match=r"f.jsonl: 1 of 2 records is bad \(50% > calib.max_bad_fraction 5%\)"):
        run(write_lines(tmp_path / "f.jsonl", LOGS[:1] + ["{"]), tmp_path / "out2", tiny_llama)


def test_cli_strict_fails_where_default_mode_succeeds(tmp_path, cli_args):
    source = write_lines(tmp_path / "f.jsonl", LOGS[:100] + ['{"text": 1}'] + LOGS[100:200])
    result = cli(cli_args(source, "--strict"))
    assert result.exit_code == 2 and f"{source}:101: text is a number, not text" in result.output
    assert not (tmp_path / "out").exists()
    assert cli(cli_args(source)).exit_code == 0 and (tmp_path / "out" / "calib.jsonl").exists()


# ---------------------------------------------------------------- redaction

LABELLED = {
    "email": ["jane.doe+shop@example.co.uk", "First.Last@Company.IO", "rahul_k-99@mail.example.in", "x@y.de",
              # internationalised (RFC 6531): any script in the name and the domain, IDN and punycode domains
              "josé.garcía@correo.es", "Dörte.Müller@beispiel.de", "用户@例子.广告", "пользователь@пример.рф",
              "राम@उदाहरण.भारत", "info@xn--80ak6aa92e.com",
              # spelled out to dodge filters
              "john dot smith at example dot com", "john.smith at example.com", "jane [at] example [dot] com",
              "priya(at)mail(dot)co(dot)in", "Rahul DOT Kumar AT gmail DOT com", "rahul at gmail dot com",
              "anna.k {at} web.de", "priya.sharma at gmail dot co dot in"],
    "phone": ["+91 98765 43210", "9876543210", "+44 20 7946 0958", "+1 (415) 555-2671", "(415) 555-2671", "415-555-2671",
              "415.555.2671", "+33 1 23 45 67 89", "0044 20 7946 0958", "+49 (0)30 1234567", "+81 3-1234-5678",
              "+86 138 0013 8000", "+7 495 123-45-67", "+919876543210", "020 7946 0958", "98765-43210", "+65 6123 4567",
              "1-800-555-0199", "+91-98765-43210"],
    "card": ["4111 1111 1111 1111", "4111-1111-1111-1111", "4111111111111111", "5500005555555559", "3782 822463 10005",
             "378282246310005", "3056 9309 0259 04", "6011 0009 9013 9424", "2223 0031 2200 3222", "5555-5555-5555-4444",
             "4111 1111 1111 1112", "4111111111111112", "5500-0055-5555-5550"],  # failing the Luhn check: still a card
    "iban": ["DE89 3704 0044 0532 0130 00", "DE89370400440532013000", "GB82 WEST 1234 5698 7654 32",
             "FR14 2004 1010 0505 0001 3M02 606", "NL91 ABNA 0417 1643 00", "ES91 2100 0418 4502 0005 1332",
             "IT60 X054 2811 1010 0000 0123 456", "CH93 0076 2011 6238 5295 7", "BE68 5390 0754 7034", "NO93 8601 1117 947",
             "SA03 8000 0000 6080 1016 7519", "gb82 west 1234 5698 7654 32",
             "DE89-3704-0044-0532-0130-00", "GB82-WEST-1234-5698-7654-32", "FR14-2004-1010-0505-0001-3M02-606"],
    "ip": ["192.168.10.24", "8.8.8.8", "10.0.0.255", "2001:db8::1", "fe80::1ff:fe23:4567:890a",
           "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "::ffff:192.0.2.1"],
}
CONTEXTS = ["{}", "my details: {}.", "its {}, thanks", "({})", "call/see {} now", "x: {}\nnext line", "{} ABOUT IT"]


@pytest.mark.parametrize("kind, value", [(kind, value) for kind, values in LABELLED.items() for value in values])
def test_redaction_finds_every_labelled_value_in_every_context(kind, value):
    for context in CONTEXTS:
        counts = collections.Counter()
        redacted = calib.redact(context.format(value), counts, [])
        assert redacted == context.format(f"[{kind.upper()}]"), (context, value)
        assert counts == {kind: 1}


@pytest.mark.parametrize("text", [
    "order #502-2345678-9012345 placed", "order 502-2345678-9012345 placed", "My order number is 456-789012-345678.",
    "Order ID 654-321-0987 arrived", "order #9012345678901234 was delivered", "Transaction ID is 000000000000000",
    "order OD4567891234567890 is late", "tracking no. 9876543210 shows nothing", "ISBN 978-3-16-148410-0",
    "on 12.05.2024 at 10:30", "2024-05-12", "12/05/2024", "at 10:30:45 sharp", "between 9:00-17:30", "ratio 16:9",
    "$1,299.99", "Rs. 1,49,999", "₹12,999.00", "EUR 1.299.999,00", "version 2.14.3",
    # " at " and " dot " in ordinary sentences are not addresses
    "look at example.com", "check the status at amazon.in please", "look at it dot by dot", "meet at 5 dot 30",
    "see you at the office. Bye", "Look at this dot in the middle", "@everyone see you at 5.30", "price@5.99",
    "DE89-3704-0044-0532-0130-01 (bad checksum)",
])
def test_redaction_leaves_order_numbers_dates_times_and_prices(text):
    counts = collections.Counter()
    assert calib.redact(text, counts, []) == text and not counts


def test_user_patterns_are_redacted_and_counted():
    counts = collections.Counter()
    redacted = calib.redact("ticket ORD-123456 and ORD-654321, mail a@b.io", counts, [re.compile(r"ORD-\d{6}")])
    assert redacted == "ticket [REDACTED] and [REDACTED], mail [EMAIL]" and counts == {"custom": 2, "email": 1}


def test_redaction_happens_before_dedup_and_before_anything_is_written(tmp_path, tiny_llama):
    base = LOGS[0]["turns"]
    rows = [{"turns": [{"role": "user", "content": base[0]["content"] + f" Mail {name}@example.com"}] + base[1:]}
            for name in ("anna", "bert", "carl")]  # identical once redacted, near-duplicates if not
    rows += [{"turns": [{"role": "user", "content": "I am jane.doe@example.com, IBAN DE89 3704 0044 0532 0130 00"}]
              + r["turns"][1:]} for r in LOGS[1:2]] + LOGS[2:40]
    rows += ['{"turns": [{"role": "john.smith@example.com", "content": "x"}]}']
    source = write_lines(tmp_path / "f.jsonl", rows)
    result = run(source, tmp_path / "out", tiny_llama, holdout=5, max_bad_fraction=0.1)
    assert result.stats["dropped"]["duplicate"] == 2
    unchanged = [{"turns": r["turns"][1:]} for r in (LOGS[0],) * 3 + (LOGS[1],)] + [{"turns": base[:1]}] * 3 + LOGS[2:40]
    expected = redactions_in(unchanged) + collections.Counter(email=4, iban=1)
    assert result.stats["redactions"] == dict(sorted(expected.items()))
    written = b"".join(p.read_bytes() for p in (tmp_path / "out").iterdir())
    for secret in (b"anna@", b"bert@", b"jane.doe@", b"DE89 3704", b"john.smith@"):
        assert secret not in written
    assert "[EMAIL]" in result.stats["bad_records_first_10"][0]

    plain = run(source, tmp_path / "plain", tiny_llama, holdout=5, max_bad_fraction=0.1, redact=False)
    assert plain.stats["redactions"] == {} and plain.stats["dropped"] == {"bad record": 1, "near-duplicate": 2}
    assert b"jane.doe@example.com" in (tmp_path / "plain" / "calib_conversations.jsonl").read_bytes() + \
        (tmp_path / "plain" / "holdout.jsonl").read_bytes()


@pytest.mark.parametrize("record, hidden, shown", [
    ({"turns": [{"role": "jane.doe@example.com", "content": "x"}]}, ["jane.doe"], "turns[0].role '[EMAIL]' cannot be mapped"),
    # a long value is never cut (a cut address escapes the pattern): it is described instead
    ({"turns": [{"role": "write to me, jane.doe@example.com, or call +91 98765 43210 any day after five please",
                 "content": "x"}]}, ["jane.doe", "+91 98765", "write to me"],
     "turns[0].role (text of 84 characters, not shown) cannot be mapped"),
    ({"jane.doe@example.com": "x", "phone": 1}, ["jane.doe"], "unknown record shape (keys: [EMAIL], phone)"),
    ({"turns": [{"role": "ORD-123456", "content": "x"}]}, ["ORD-123456"], "turns[0].role '[REDACTED]' cannot be mapped"),
    ({"turns": [{"role": "john dot smith at example dot com", "content": "x"}]}, ["john dot smith"],
     "turns[0].role '[EMAIL]' cannot be mapped"),
])
def test_nothing_from_a_bad_record_is_printed_or_written_before_redaction(tmp_path, tiny_llama, record, hidden, shown):
    source = write_lines(tmp_path / "f.jsonl", LOGS[:60] + [record])
    result = cli(["calib", source, "--out", tmp_path / "out", "--model", tiny_llama,
                  "--params", write_params(tmp_path, {"calib": {"redact_patterns": [r"ORD-\d{6}"]}})])
    assert result.exit_code == 0, result.output
    stats = (tmp_path / "out" / "stats.json").read_text(encoding="utf-8")
    assert f"{source}:61: {shown}" in result.output and shown in json.loads(stats)["bad_records_first_10"][0]
    written = result.output + "".join(p.read_text(encoding="utf-8") for p in (tmp_path / "out").iterdir())
    for secret in hidden:
        assert secret not in written
    strict = cli(["calib", source, "--out", tmp_path / "strict", "--model", tiny_llama, "--strict",
                  "--params", tmp_path / "params.yaml"])
    assert strict.exit_code == 2 and shown in strict.output
    assert not any(secret in strict.output for secret in hidden)


def test_a_json_null_line_is_a_bad_record_not_a_blank_line(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [TURNS, "null", "", TURNS])
    _, stats = load(path)
    assert stats.records_in == 3 and stats.bad_records == [
        f"{path}:2: a record must be a JSON object, not null; put one conversation object per line "
        "(a JSON array belongs in a .json file)"]


def test_an_unpaired_surrogate_is_a_bad_record(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [TURNS, '{"text": "emoji half \\ud83d here"}'])
    conversations, stats = load(path)
    assert len(conversations) == 1 and stats.bad_records == [
        f"{path}:2: text holds an unpaired UTF-16 surrogate at character 12 (half of an emoji or other character, "
        "e.g. a lone \\ud83d escape), which is not text; re-export the file whole or drop the record"]


# ---------------------------------------------------------------- control characters and empty conversations

def test_nul_and_other_control_characters_are_removed_counted_and_located(tmp_path, tiny_llama):
    dirty = {"turns": [{"role": "user", "content": "Where\x00 is my\x1b[0m parcel?\rIt is late.\x0c"},
                       {"role": "agent", "content": "Mail jane\x00.doe@example.com\x7f, tab\tkept\r\nok\x85"}]}
    source = write_lines(tmp_path / "f.jsonl", LOGS[:30] + [dirty, {"text": "plain\x00\x00 text"}])
    result = run(source, tmp_path / "out", tiny_llama, holdout=3, seq_len=16, num_blocks=5)
    written = "".join((tmp_path / "out" / name).read_text(encoding="utf-8")
                      for name in ("calib_conversations.jsonl", "holdout.jsonl"))
    texts = [m["content"] for r in read_jsonl(tmp_path / "out" / "calib_conversations.jsonl") for m in r["messages"]]
    texts += [m["content"] for r in read_jsonl(tmp_path / "out" / "holdout.jsonl") for m in r["messages"]]
    assert not any(re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", t) for t in texts)
    assert "\\u0000" not in written  # no escaped NUL either
    assert "Where is my[0m parcel?\nIt is late." in texts and "Mail [EMAIL], tab\tkept\nok" in texts
    stats = result.stats  # the NUL inside the address did not hide it from redaction
    assert stats["control_characters_removed"] == 8 and stats["records_kept"] == 32
    assert stats["control_characters"] == {"U+0000": 4, "U+000C": 1, "U+001B": 1, "U+007F": 1, "U+0085": 1}
    assert stats["control_characters_first_10"] == [
        f"{source}:31: turns[0].content: U+0000, U+000C, U+001B", f"{source}:31: turns[1].content: U+0000, U+007F, U+0085",
        f"{source}:32: text: U+0000 x2"]
    assert f"8 control characters removed (the first at {source}:31: turns[0].content)" in result.summary()


def test_a_turn_of_nothing_but_control_characters_is_a_bad_record(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", [TURNS, {"turns": [{"role": "user", "content": "\x00\x01 \x02"}]}])
    conversations, stats = load(path)
    assert len(conversations) == 1 and stats.bad_records == [
        f"{path}:2: turns[0].content is nothing but control characters; drop the turn or fill it"]


def test_a_system_prompt_alone_is_a_bad_record_and_a_file_of_them_is_refused(tmp_path, tiny_llama):
    system = {"messages": [{"role": "system", "content": "You are a support agent."}]}
    path = write_lines(tmp_path / "f.jsonl", LOGS[:40] + [system])
    conversations, stats = load(path, max_bad_fraction=0.05)
    assert len(conversations) == 40 and stats.bad_records == [
        f"{path}:41: 'messages' holds only system turns (1), no user or assistant turn: nothing to calibrate on or "
        "hold out; export the conversation's turns with it, or drop the record"]
    with pytest.raises(UserError, match=r"f.jsonl: 2 of 21 records are bad \(10% > calib.max_bad_fraction 5%\)"):
        load(write_lines(tmp_path / "f.jsonl", LOGS[:19] + [system, system]), max_bad_fraction=0.05)
    only = write_lines(tmp_path / "only.jsonl", [system] * 3 + [
        {"turns": [{"role": "system", "content": "Be brief."}, {"role": "SYSTEM", "content": "Be kind."}]}])
    with pytest.raises(UserError) as info:  # even when every bad record is tolerated
        run(only, tmp_path / "out", tiny_llama, max_bad_fraction=1.0)
    assert str(info.value) == (
        f"{only}: no record has a user or assistant turn: all 4 hold only system messages (from {only}:1 on), "
        "nothing to calibrate on or hold out; export the conversations' user and assistant turns with their "
        "system prompt")
    assert not (tmp_path / "out").exists()


def test_every_record_bad_but_tolerated_still_needs_one_usable(tmp_path):
    path = write_lines(tmp_path / "f.jsonl", ["{", '{"dialog": 1}'])
    with pytest.raises(UserError, match=r"f.jsonl: none of its 2 records can be used; fix them:\n.*f.jsonl:1: invalid"):
        load(path, max_bad_fraction=1.0)


def test_text_without_a_user_turn_calibrates_only_when_nothing_is_to_be_held_out(tmp_path, tiny_llama):
    texts = write_lines(tmp_path / "f.jsonl", [{"text": t["content"]} for r in LOGS[:20] for t in r["turns"][:1]])
    with pytest.raises(UserError) as info:
        run(texts, tmp_path / "out", tiny_llama, holdout=2)
    assert str(info.value).startswith(f"{texts}: no record has a user turn, so none can be held out for the judge, kl, "
                                      "bench and ppl-chat (calib.holdout: 2); add conversations with user turns, or "
                                      "set calib.holdout: 0")
    result = run(texts, tmp_path / "out", tiny_llama, holdout=0)
    assert result.stats["holdout"] == 0 and (tmp_path / "out" / "holdout.jsonl").read_text() == ""
    from pipeline.formats.holdout import read_holdout

    assert read_holdout(tmp_path / "out" / "holdout.jsonl", missing_ok=True) == []  # the quantize stages read it


def test_records_the_chat_template_rejects_count_against_max_bad_fraction(tmp_path):
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if 'REJECT' in m['content'] %}{{ raise_exception('no') }}"
                               "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tokenizer.save_pretrained(tmp_path / "strict")
    rejected = {"turns": [{"role": "user", "content": "REJECT me"}, {"role": "agent", "content": "no"}]}
    rejected_too = {"turns": [{"role": "user", "content": "REJECT this too"}, {"role": "agent", "content": "no"}]}
    source = write_lines(tmp_path / "f.jsonl", LOGS[:19] + ["{", rejected, rejected_too])
    with pytest.raises(UserError) as info:
        run(source, tmp_path / "out", tmp_path / "strict", holdout=0, num_blocks=4)
    assert str(info.value).startswith(
        f"{source}: 3 of 22 records were skipped (1 bad, 2 rejected by the chat template of {tmp_path / 'strict'}) "
        "(14% > calib.max_bad_fraction 5%); fix them, or raise calib.max_bad_fraction in params.yaml:\n"
        f"{source}:20: invalid JSON")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- de-duplication

def _changed(text: str, every: int, tag: str) -> str:
    words = text.split()
    return " ".join(f"{tag}{i}" if i % every == 0 else w for i, w in enumerate(words))


def test_near_duplicates_are_dropped_above_the_threshold_only():
    word_ids = calib.WordIds()
    base = [calib.normalised(" ".join(t["content"] for t in r["turns"])) for r in LOGS[:40]]
    variants, expected = [], []
    for i, text in enumerate(base):
        variant = _changed(text, every=[40, 12, 6, 3][i % 4], tag=f"zz{i}x")
        variants.append(variant)
        similarity = calib.jaccard(calib.shingles(text.split(), word_ids), calib.shingles(variant.split(), word_ids))
        expected.append(similarity >= calib.NEAR_DUPLICATE_JACCARD)
    flags = calib.near_duplicates(base + variants)
    assert flags[:40] == [False] * 40 and flags[40:] == expected
    assert 5 < sum(expected) < 35  # both sides of the threshold are exercised


def test_duplicates_and_near_duplicates_are_counted_apart(tmp_path):
    near = [{"turns": [dict(t, content=t["content"].replace("the", "THE_X", 1)) for t in r["turns"]]} for r in LOGS[:5]]
    exact = [{"turns": [dict(t, content=t["content"].upper() + "!!") for t in r["turns"]]} for r in LOGS[5:8]]
    far = [{"turns": [dict(t, content=_changed(t["content"], 2, "q")) for t in LOGS[9]["turns"]]}]  # Jaccard < 0.2
    conversations, stats = load(write_lines(tmp_path / "f.jsonl", LOGS[:10] + near + exact + far))
    assert stats.dropped == {"near-duplicate": 5, "duplicate": 3}
    assert stats.records_in == 19 and stats.kept == len(conversations) == 11


def test_a_shared_system_prompt_does_not_make_conversations_near_duplicates(tmp_path):
    system = {"role": "system", "content": " ".join(f"rule{i} applies here" for i in range(500))}
    rows = [{"messages": [system] + [{"role": t["role"].lower().replace("agent", "assistant"), "content": t["content"]}
                                     for t in r["turns"]]} for r in LOGS[:20]]
    conversations, stats = load(write_lines(tmp_path / "f.jsonl", rows))
    assert len(conversations) == 20 and not stats.dropped["near-duplicate"]


def test_dedup_does_not_depend_on_python_hash_seed(tmp_path):
    rows = LOGS[:30] + [{"turns": [dict(t, content=t["content"] + " ok") for t in r["turns"]]} for r in LOGS[:10]]
    source = write_lines(tmp_path / "f.jsonl", rows)
    script = ("import sys; from pipeline.calib.load import load_conversations; c, s = load_conversations(sys.argv[1], strict=False, "
              "max_bad_fraction=0, do_redact=True, extra_patterns=[]); print([x.key for x in c], dict(s.dropped))")
    outputs = {subprocess.run([sys.executable, "-c", script, str(source)], capture_output=True, text=True, check=True,
                              cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outputs) == 1 and "'near-duplicate': 10" in outputs.pop()


# ---------------------------------------------------------------- split, render, pack, stats

def test_split_never_shares_a_conversation_and_output_is_deterministic(tmp_path, tiny_llama):
    source = tmp_path / "logs.jsonl"
    near = [{"turns": [dict(t, content=t["content"] + " thanks") for t in r["turns"]]} for r in LOGS[10:13]]
    write_lines(source, LOGS[:60] + LOGS[:5] + near + ["broken"])  # 5 exact and 3 near duplicates, 1 bad
    first = run(source, tmp_path / "a", tiny_llama, holdout=6, num_blocks=4)
    run(source, tmp_path / "b", tiny_llama, holdout=6, num_blocks=4)
    for name in ("calib.jsonl", "holdout.jsonl", "calib_conversations.jsonl", "stats.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first.stats["dropped"] == {"bad record": 1, "duplicate": 5, "near-duplicate": 3}
    assert "kept 60 of 69 records (dropped 1 bad record, 5 duplicates, 3 near-duplicates)" in first.summary()
    held = {json.dumps(r["messages"][0]) for r in read_jsonl(tmp_path / "a" / "holdout.jsonl")}
    used = {json.dumps(r["messages"][0]) for r in read_jsonl(tmp_path / "a" / "calib_conversations.jsonl")}
    assert len(held) == 6 and len(used) == 54 and not held & used
    blocks = read_jsonl(tmp_path / "a" / "calib.jsonl")
    assert len(blocks) == 4 and {len(b["input_ids"]) for b in blocks} == {32}
    assert calib.is_blocks_file(tmp_path / "a" / "calib.jsonl") and calib.read_blocks(tmp_path / "a" / "calib.jsonl") == \
        [b["input_ids"] for b in blocks]


def test_stats_json_has_every_number(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    cyrillic = {"turns": [{"role": "customer", "content": "Привет мир"}, {"role": "bot", "content": "hello"}]}
    source = write_lines(tmp_path / "f.jsonl", LOGS[:30] + [cyrillic, LOGS[0], "{", {"text": "write to a@b.io"}])
    result = run(source, tmp_path / "out", tiny_llama, holdout=3, seq_len=16, num_blocks=5)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats == result.stats
    assert stats["records_in"] == 34 and stats["records_kept"] == 32
    assert stats["dropped"] == {"bad record": 1, "duplicate": 1}
    assert stats["bad_records"] == 1 and stats["bad_records_first_10"] == [
        f"{source}:33: invalid JSON (Expecting property name enclosed in double quotes at column 2); "
        "make the line one JSON object or remove it"]
    expected_redactions = redactions_in(LOGS[:30]) + collections.Counter(email=1)
    assert stats["shapes"] == {"text": 1, "turns": 32} and stats["redactions"] == dict(sorted(expected_redactions.items()))
    conversations = read_jsonl(tmp_path / "out" / "calib_conversations.jsonl")
    holdout = read_jsonl(tmp_path / "out" / "holdout.jsonl")
    assert stats["calib_conversations"] == len(conversations) == 29 and stats["holdout"] == len(holdout) == 3
    turns = sum(len(r["turns"]) for r in LOGS[:30]) + 2 + 1
    assert stats["turns"] == turns and stats["turns_per_conversation"] == round(turns / 32, 2)
    assert sum(stats["roles"].values()) == turns and stats["roles"]["text"] == 1
    redacted = [calib.redact(t["content"], collections.Counter(), []) for r in LOGS[:30] for t in r["turns"]]
    letters = sum(ch.isalpha() for text in redacted for ch in text) + 9 + 5 + len("writetoEMAIL")
    assert stats["non_latin_share"] == round(9 / letters, 4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rendered = [tokenizer.apply_chat_template(r["messages"], tokenize=False) if r["messages"][0]["role"] != "text"
                else r["messages"][0]["content"] for r in conversations]
    assert stats["calib_conversation_tokens"] == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in rendered)
    assert stats["tokens"] == 80 and stats["blocks"] == 5 and stats["seq_len"] == 16 and stats["chat_template"] is True
    first_tokens = tokenizer(rendered[0], add_special_tokens=False)["input_ids"]
    assert read_jsonl(tmp_path / "out" / "calib.jsonl")[0]["input_ids"] == first_tokens[:16]


def test_strict_chat_templates_get_alternating_turns_and_rejections_are_counted(tmp_path):
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if 'REJECT' in m['content'] %}{{ raise_exception('no') }}{% endif %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tokenizer.save_pretrained(tmp_path / "strict")
    greeting = {"turns": [{"role": "system", "content": "Be kind."}, {"role": "agent", "content": "Hello!"},
                          {"role": "user", "content": "hi"}, {"role": "user", "content": "my parcel?"},
                          {"role": "agent", "content": "On its way."}]}
    rejected = {"turns": [{"role": "user", "content": "REJECT me"}, {"role": "agent", "content": "no"}]}
    source = write_lines(tmp_path / "f.jsonl", LOGS[:20] + [greeting, rejected])
    result = run(source, tmp_path / "out", tmp_path / "strict", holdout=0, num_blocks=4)
    assert result.stats["dropped"] == {"rejected by chat template": 1} and result.stats["records_kept"] == 21
    conversation = calib.Conversation(calib.to_conversation(greeting, "x").messages, "turns", "x")
    assert calib.render(tokenizer, conversation) == "[user] Be kind.\n\nhi\nmy parcel?\n[assistant] On its way.\n"


@pytest.mark.parametrize("text, letters, non_latin", [
    ("Hello, Wörld! 123", 10, 0), ("Ça coûte 5€, señor", 12, 0), ("Привет, мир", 9, 9), ("नमस्ते", 4, 4),
    ("日本語 text", 7, 3), ("ΑΒΓ abc", 6, 3),
])
def test_letters_and_non_latin_letters_are_counted(text, letters, non_latin):
    assert calib._letters(text) == (letters, non_latin)


def test_too_small_calibration_set_says_so(tmp_path, tiny_llama):
    path = write_lines(tmp_path / "f.jsonl", [TURNS])
    with pytest.raises(UserError, match="calibration set too small"):
        run(path, tmp_path / "out", tiny_llama, holdout=0, num_blocks=50)
    assert not (tmp_path / "out").exists()


def test_a_json_array_with_a_trailing_comma_is_refused_by_the_stage(tmp_path, tiny_llama):
    """Issue 26: `[..., {...},]` was read without a word; JSON allows no comma there (a record lost?)."""
    source = tmp_path / "logs.json"
    source.write_text("[\n" + ",\n".join(json.dumps({"text": f"conversation {i}"}) for i in range(20)) + ",\n]\n")
    result = cli(["calib", source, "--model", tiny_llama, "--out", tmp_path / "out"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{source}:21:" in result.output and "a comma after the last record" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, encoding, expected", [
    ('{"text": "¿Dónde está mi pedido?"}\n', "utf-16-le", "UTF-16-LE"),
    ('{"turns": [{"role": "user", "content": "我的包裹在哪里？请帮我查一下订单"}]}\n', "utf-16-le", "UTF-16-LE"),
    ('{"turns": [{"role": "user", "content": "我的包裹在哪里？请帮我查一下订单"}]}\n', "utf-16-be", "UTF-16-BE"),
    ('{"text": "hi"}\n', "utf-16", "UTF-16"),
    ('{"text": "我的包裹在哪里？"}\n', "utf-8", None),
])
def test_utf16_is_named_with_or_without_a_byte_order_mark(text, encoding, expected):
    from pipeline.errors import not_utf8

    assert not_utf8((text * 50).encode(encoding)) == expected
    assert not_utf8(b"\x00" * 4096) is None and not_utf8(bytes(range(256)) * 16) is None  # not text at all


# ---------------------------------------------------------------- streaming (issue 46 item 5)

def _synthetic(path, count: int, seed: int = 0):
    """`count` distinct conversations of ~2 KB (random words), each 7th one followed later by a near-duplicate
    (one word changed) 1,500 records on, across the loader's batches."""
    import random

    rng = random.Random(seed)
    words = ["".join(rng.choices("bcdfghklmnprstvz", k=3)) + rng.choice("aeiou") for _ in range(3000)]
    rows, near = [], {}
    for i in range(count):
        turns = [{"role": "user" if t % 2 == 0 else "agent", "content": " ".join(rng.choices(words, k=55))}
                 for t in range(6)]
        rows.append({"turns": turns})
        if i % 7 == 0:
            near[i + 1500] = {"turns": [dict(t) for t in turns]}
            near[i + 1500]["turns"][2]["content"] += " extra"
        if i in near:
            rows.append(near.pop(i))
    return write_lines(path, rows)


def test_near_duplicates_are_found_across_batches_and_far_apart(tmp_path):
    from pipeline.calib.load import DEDUP_BATCH

    source = _synthetic(tmp_path / "f.jsonl", 2 * DEDUP_BATCH + 100)
    planted = sum(1 for i in range(2 * DEDUP_BATCH + 100) if i % 7 == 0 and i + 1500 < 2 * DEDUP_BATCH + 100)
    conversations, stats = load(source)
    assert stats.dropped == {"near-duplicate": planted} and planted > 50
    assert len(conversations) == 2 * DEDUP_BATCH + 100


def test_calib_memory_does_not_grow_with_the_input(tmp_path, tiny_llama):
    """What the stage holds while it reads, de-duplicates, splits, renders and writes: a scratch store on disk
    (pipeline/calib/store.py), not the conversations. Python's allocations (numpy's included: the MinHash matrix
    of one chunk is most of them) for a 6x larger file stay about the same (they were ~7x the input before: 50 MB
    of logs took 0.9 GB). benchmarks/calib_memory.py measures the whole process at 50 MB, 200 MB and 1 GB."""
    peaks = {}
    for count in (500, 3000):
        source = _synthetic(tmp_path / f"{count}.jsonl", count, seed=count)
        tracemalloc.start()
        try:
            run(source, tmp_path / f"out{count}", tiny_llama, seq_len=64, num_blocks=8, holdout=4)
            peaks[count] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    grown = peaks[3000] - peaks[500]  # for 5 MB more of input: ~35 MB before, when it held the conversations
    assert (tmp_path / "3000.jsonl").stat().st_size > 5 << 20 and grown < 0.2 * peaks[500], peaks
    assert not list(tmp_path.glob("**/quantize-calib-*"))


def test_the_scratch_store_is_removed_when_the_stage_fails(tmp_path, tiny_llama, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    with pytest.raises(UserError, match="calibration set too small"):
        run(write_lines(tmp_path / "f.jsonl", LOGS[:20]), tmp_path / "out", tiny_llama, num_blocks=10_000)
    assert not list((tmp_path / "scratch").iterdir()) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", [
    "\ufeff[\r\n  " + json.dumps(TURNS) + ",\r\n  " + json.dumps({"prompt": "a ü 😀", "response": "b"}) + "\r\n]\r\n",
    '[1, 22, 333, {"text": "x"}, 4444]',
    "[" + ", ".join(json.dumps({"text": f"record {i} " + "é" * i}) for i in range(40)) + "]",
    '[{"text": "a"},\n {"text": }]', '[{"text": "a"} {"text": "b"}]', '[{"text": "a"}]\n[]', '[{"text": "a"},\n  ]',
    '  {"text": "a"}', '[{"text": "unterminated]', '[{"text": "a"},\n' + "[" * 3000 + "]" * 3000 + "]",
])
def test_a_json_array_reads_the_same_a_few_bytes_at_a_time(tmp_path, monkeypatch, text):
    """.json arrays are read a chunk at a time (a window over the file, not the whole file): the records, their
    FILE:LINE:COLUMN and every error are those of one read."""
    from pipeline.formats import conversations

    path = make_file(tmp_path, "f.json", text.encode("utf-8"))

    def read():
        try:
            return list(conversations.iter_records(path))
        except UserError as exc:
            return str(exc)

    whole = read()
    monkeypatch.setattr(conversations, "JSON_CHUNK", 3)
    assert read() == whole


# ---------------------------------------------------------------- the holdout of a small input (issue 69.4)

def test_a_small_input_keeps_half_to_calibrate_on_and_says_so(tmp_path, tiny_llama):
    """Issue 69: 30 conversations under calib.holdout 32 were all held out ("0 tokens after de-duplication and
    holdout"); now the holdout takes at most half, the summary says so and how to choose it."""
    source = write_lines(tmp_path / "f.jsonl", LOGS[:30])
    params = write_params(tmp_path, {"calib": {"holdout": 32, "seq_len": 32, "num_blocks": 4}})
    result = cli(["calib", source, "--out", tmp_path / "out", "--model", tiny_llama, "--params", params])
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "out" / "stats.json").read_text(encoding="utf-8"))
    assert stats["holdout"] == 15 and stats["calib_conversations"] == 15 and stats["blocks"] == 4
    assert len(read_jsonl(tmp_path / "out" / "holdout.jsonl")) == 15
    said = " ".join(result.output.split())
    assert "calib.holdout 32 would leave none of the 30 conversations to calibrate on: held out 15" in said
    assert "--holdout N on `quantize calib`, or calib.holdout in params.yaml" in said


def test_the_holdout_flag_sets_it_and_a_fitting_holdout_is_not_changed(tmp_path, tiny_llama):
    source = write_lines(tmp_path / "f.jsonl", LOGS[:30])
    params = write_params(tmp_path, {"calib": {"holdout": 32, "seq_len": 32, "num_blocks": 4}})
    result = cli(["calib", source, "--out", tmp_path / "out", "--model", tiny_llama, "--params", params,
                  "--holdout", 4])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "stats.json").read_text(encoding="utf-8"))["holdout"] == 4
    assert "would leave" not in result.output
    bad = cli(["calib", source, "--out", tmp_path / "bad", "--model", tiny_llama, "--params", params, "--holdout", -1])
    assert bad.exit_code == 2 and "--holdout -1" in bad.output and not (tmp_path / "bad").exists()


def test_too_small_a_set_names_what_the_holdout_took_and_how_to_change_it(tmp_path, tiny_llama):
    source = write_lines(tmp_path / "f.jsonl", LOGS[:6])
    params = write_params(tmp_path, {"calib": {"holdout": 32, "seq_len": 256, "num_blocks": 64}})
    result = cli(["calib", source, "--out", tmp_path / "out", "--model", tiny_llama, "--params", params])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in said, said
    assert "calibration set too small" in said and "the holdout took 3 of the 6 conversations, calib.holdout 32" in said
    assert "hold out fewer (--holdout N on `quantize calib`, or calib.holdout in params.yaml)" in said
    assert not (tmp_path / "out").exists()
