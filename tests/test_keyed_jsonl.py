"""Both resume caches (eval generations, judge judgments) are one keyed JSONL with one rule: a torn last
line (a kill mid-append) is dropped and cut off at the next open; any other broken line stops with
one message naming the file and the line, exit 2 through the CLI, and leaves the file as it was."""

import json

import pytest

from conftest import write_params
from pipeline.engines import Completion, GenRequest
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import GenerationCache
from pipeline.judge.client import JudgmentCache


def _generation_cache(path):
    return GenerationCache(path, "fp")


def _put_generation(cache, i: int) -> None:
    cache.put(GenRequest(f"prompt {i}", max_new_tokens=8), Completion(f"answer {i} é€😀", 3, 0.25))


def _put_judgment(cache, i: int) -> None:
    cache.put_many([{"key": f"j{i}", "raw": f"[[A]] é€😀 {i}", "parsed": "A", "attempts": 1, "error": None}])


USERS = {"eval": (_generation_cache, _put_generation), "judge": (JudgmentCache, _put_judgment)}


@pytest.mark.parametrize("user", USERS)
def test_a_kill_at_any_byte_of_an_append_loses_only_that_entry(tmp_path, user):
    """Three whole entries, then the fourth cut at every byte (inside multi-byte characters too, and
    just before its newline): the open keeps the three, counts one dropped line, cuts the torn bytes
    off, and the next append is read back as a line of its own."""
    open_cache, put = USERS[user]
    path = tmp_path / "cache.jsonl"
    cache = open_cache(path)
    for i in range(4):
        put(cache, i)
    whole = path.read_bytes()
    lines = whole.splitlines(keepends=True)
    assert len(lines) == 4
    head, last = b"".join(lines[:3]), lines[3]
    keys = set(open_cache(path).entries)
    assert len(keys) == 4 and any(0x80 <= b < 0xC0 for b in last)
    for cut in range(len(last)):  # 0: the kill came before the append began
        path.write_bytes(head + last[:cut])
        cache = open_cache(path)
        assert cache.dropped == (1 if cut else 0), cut
        assert path.read_bytes() == head, cut
        assert len(cache.entries) == 3 and set(cache.entries) < keys, cut
        put(cache, 3)  # the rerun computes the lost entry again
        assert path.read_bytes() == whole, cut
        reopened = open_cache(path)
        assert reopened.dropped == 0 and set(reopened.entries) == keys, cut


BROKEN = {
    "not JSON": b'{"model": "fp", "key": "x", "text": \n',
    "not UTF-8": b'{"model": "fp", "key": "\xff\xfe"}\n',
    "not an object": b"[1, 2]\n",
    "no key": b'{"model": "fp", "text": "a"}\n',
    "key not text": b'{"model": "fp", "key": 7}\n',
    "two entries glued (an old torn line appended to)": b'{"model": "fp", "key": "a"{"model": "fp", "key": "b"}\n',
}


@pytest.mark.parametrize("user", USERS)
@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_line_that_is_not_the_last_is_refused_naming_file_and_line(tmp_path, user, broken):
    open_cache, put = USERS[user]
    path = tmp_path / "cache.jsonl"
    put(open_cache(path), 0)
    good = path.read_bytes()
    content = good + BROKEN[broken] + good + b'{"key": "torn'  # a torn tail too: still nothing is repaired
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        open_cache(path)
    assert f"{path}, line 2:" in str(refused.value) and "Delete that line" in str(refused.value)
    assert path.read_bytes() == content  # refused before anything was cut


def test_blank_lines_and_entries_of_another_model_are_no_error(tmp_path):
    path = tmp_path / "cache.jsonl"
    other = {"model": "other", "key": "k0", "text": "a", "n_tokens": 1, "seconds": 0.1}
    mine = {**other, "model": "fp", "key": "k1"}
    path.write_text(json.dumps(other) + "\n\n" + json.dumps(mine) + "\n")
    cache = GenerationCache(path, "fp")
    assert set(cache.entries) == {"k1"} and cache.dropped == 0


def test_quantize_eval_refuses_a_broken_cache_line_with_exit_2(tmp_path, tiny_llama, monkeypatch):
    """Through the CLI: one message naming the cache file and line, exit 2, no traceback, file untouched."""
    import typer
    from click.testing import CliRunner

    from pipeline.cli.app import app

    monkeypatch.chdir(tmp_path)
    write_params(tmp_path)
    cache = tmp_path / "out" / ".cache" / "math.jsonl"
    cache.parent.mkdir(parents=True)
    content = b'{"model": "fp", "key": "k1", "text": "a", "n_tokens": 1, "seconds": 0.1}\n' + b"[1, 2]\n"
    cache.write_bytes(content)
    result = CliRunner().invoke(typer.main.get_command(app),
                                ["eval", str(tiny_llama), "--suite", "math", "--limit", "1", "--out", "out"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and result.output.count("error: ") == 1, result.output
    assert f"{cache.relative_to(tmp_path)}, line 2: not a cache entry" in result.output, result.output
    assert cache.read_bytes() == content and not (tmp_path / "out" / "math.jsonl").exists()
