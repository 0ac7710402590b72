"""The resume cache survives a kill at any byte, and the hf engine caches each row as it finishes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, read_jsonl
from pipeline.stages import evaluate
from pipeline.engines import GenRequest
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import GenerationCache, model_fingerprint


def _math_prompts(n: int) -> list[str]:
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("math_utils", REPO / "evals" / "math" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    rows = [json.loads(line) for line in (REPO / "evals" / "math" / "gsm8k_test.jsonl").read_text().splitlines()[:n]]
    return [utils.doc_to_text(row) for row in rows]


def test_a_torn_last_line_is_dropped_at_every_byte_and_the_rerun_equals_an_uninterrupted_run(tmp_path, tiny_llama):
    """An uninterrupted run caches 4 generations. For every offset into the last line (a kill mid-append,
    also inside a multi-byte character), the next open drops and counts the torn line and cuts it off the
    file, and the rerun's items equal the uninterrupted run's: the torn item is generated again, the
    others are read back."""
    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=4))
    lm_class = evaluate._lm_class()
    requests = [type("Instance", (), {"args": (engine.apply_chat_template([{"role": "user", "content": p}]),
                                               {"max_gen_toks": 12, "until": []})})
                for p in _math_prompts(4)]
    path, fingerprint = tmp_path / "cache.jsonl", model_fingerprint(tiny_llama)
    uninterrupted = lm_class(engine, GenerationCache(path, fingerprint), chunk=4).generate_until(requests)
    whole = path.read_bytes()
    lines = whole.splitlines(keepends=True)
    # the random model's outputs hold U+FFFD and other multi-byte characters; put such a line last
    lines.sort(key=lambda line: max(line) >= 0x80)
    last = lines[-1]
    assert max(last) >= 0x80, "no multi-byte character in any cached line"
    head = b"".join(lines[:-1])
    inside_a_character = [i for i in range(len(last)) if 0x80 <= last[i] < 0xC0]
    assert inside_a_character
    # Every cut leaves the same file once opened (asserted at each), so the rerun from it is one
    # computation: it runs in full at the first cut, inside a character and just before the newline.
    rerun_at = {0, inside_a_character[0], len(last) - 1}
    for cut in range(len(last)):  # 0: the kill came before the append began; len-1: just before its newline
        path.write_bytes(head + last[:cut])
        cache = GenerationCache(path, fingerprint)
        assert cache.dropped == (1 if cut else 0), cut
        assert path.read_bytes() == head, cut  # the torn bytes are cut off, so the next append starts a line
        assert len(cache.entries) == 3 and all(e["key"].encode() in head for e in cache.entries.values())
        if cut in rerun_at:
            lm = lm_class(engine, cache, chunk=4)
            assert lm.generate_until(requests) == uninterrupted, cut
            assert len(read_jsonl(path)) == 4 and GenerationCache(path, fingerprint).dropped == 0


def test_a_broken_line_in_the_middle_is_refused_naming_file_and_line(tmp_path):
    """Only a torn last line is a kill's doing; any other broken line stops the open (tests/test_keyed_jsonl.py)."""
    path = tmp_path / "cache.jsonl"
    good = '{"model": "m", "key": "k1", "text": "a", "n_tokens": 1, "seconds": 0.1}\n'
    path.write_bytes(good.encode() + b'{"model": "m", "key": \xff\xfe\n' + b"[1, 2]\n" +
                     good.replace("k1", "k2").encode())
    with pytest.raises(UserError, match=f"{path}, line 2: not a cache entry"):
        GenerationCache(path, "m")


@pytest.mark.parametrize("entry", [
    {"model": "m", "key": "k2", "n_tokens": 1, "seconds": 0.1},  # no text
    {"model": "m", "key": "k2", "text": "a\ud800", "n_tokens": 1, "seconds": 0.1},  # no UTF-8 file can hold it
    {"model": "m", "key": "k2", "text": "a", "n_tokens": "1", "seconds": 0.1},
    {"model": "m", "key": "k2", "text": "a", "n_tokens": 1, "seconds": float("nan")},
    {"model": "m", "key": "ll:k2", "logprob": float("nan"), "greedy": True, "n_tokens": 2},
    {"model": "m", "key": "ll:k2", "logprob": -1.5, "greedy": 1, "n_tokens": 2},
])
def test_a_line_without_the_fields_this_cache_writes_is_refused_naming_file_and_line(tmp_path, entry):
    path = tmp_path / "cache.jsonl"
    path.write_text('{"model": "m", "key": "k1", "text": "a", "n_tokens": 1, "seconds": 0.1}\n' + json.dumps(entry)
                    + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=f"{path}, line 2: not a cache entry"):
        GenerationCache(path, "m")


def test_each_row_is_handed_back_when_it_finishes_and_outputs_do_not_change(tiny_llama):
    """on_done gets every row once, rows that end early (EOS, or their own smaller max_new_tokens)
    before the batch ends, with exactly the completion the batch's end decodes."""
    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=16))
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in _math_prompts(12)]
    requests = [GenRequest(p, max_new_tokens=[40, 5, 17][i % 3]) for i, p in enumerate(prompts)]
    plain = engine.generate(requests)
    reported, steps_at_report = {}, {}
    step = {"n": 0}

    from transformers import LogitsProcessor

    class CountSteps(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step["n"] += 1
            return scores

    original = engine.model.generate
    engine.model.generate = lambda **kw: original(**kw, logits_processor=[CountSteps()])

    def on_done(index, completion):
        assert index not in reported
        reported[index] = completion
        steps_at_report[index] = step["n"]

    streamed = engine.generate(requests, on_done=on_done)
    engine.model.generate = original
    assert [(c.text, c.n_tokens) for c in streamed] == [(c.text, c.n_tokens) for c in plain]
    assert sorted(reported) == list(range(12)) and all(reported[i] is streamed[i] for i in range(12))
    last_step = max(steps_at_report.values())
    early = [i for i in range(12) if steps_at_report[i] < last_step]
    assert {i for i in range(12) if requests[i].max_new_tokens < 40} <= set(early)
    for i in early:  # handed back at its own end: its first EOS or its own token limit
        assert steps_at_report[i] == min(requests[i].max_new_tokens, streamed[i].n_tokens + 1)


def test_a_kill_inside_one_large_batch_keeps_the_rows_already_finished(tmp_path, tiny_llama):
    """batch_size 50 puts all 12 items in one generate call; rows are cached as they finish, so a kill
    before the call returns leaves finished rows behind, and the rerun keeps them and generates only the
    rest (that a row handed back early is the row the batch ends with: the test above)."""
    script = (
        "from pipeline.stages import evaluate\n"
        f"evaluate.run({str(tiny_llama)!r}, suite='math', task='quant_gsm8k', variant='base', "
        f"out_dir={str(tmp_path / 'killed')!r}, limit=12, max_new_tokens=200, batch_size=50)\n"
    )
    cache = tmp_path / "killed" / ".cache" / "math.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if cache.exists() and cache.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_jsonl(cache)
    print(f"rows cached before the kill, inside one batch of 12: {len(before)}")
    assert 1 <= len(before) < 12 and not (tmp_path / "killed" / "math.jsonl").exists()
    evaluate.run(tiny_llama, suite="math", task="quant_gsm8k", variant="base", out_dir=tmp_path / "killed",
                 limit=12, max_new_tokens=200, batch_size=50)
    after = read_jsonl(cache)
    assert after[:len(before)] == before and len(after) == 12  # kept, and only the other rows generated
    outputs = {line["prompt"]: line["output"] for line in read_jsonl(tmp_path / "killed" / "math.jsonl")}
    assert len(outputs) == 12 and sorted(e["text"] for e in after) == sorted(outputs.values())


def test_the_eval_bar_moves_once_per_finished_request(tmp_path, tiny_llama):
    """PipelineLM announces every request lm-eval hands it (on_items) and reports each as it finishes
    (on_done): one by one from an engine that reports rows (hf), all at once when read from the cache."""
    from pipeline.engines import hf as hf_engine
    from pipeline.engines.hf import HFEngine

    engine = HFEngine(tiny_llama, hf_engine.Settings(batch_size=4))
    requests = [type("Instance", (), {"args": (engine.apply_chat_template([{"role": "user", "content": p}]),
                                               {"max_gen_toks": 6, "until": []})})
                for p in _math_prompts(3)]
    cache = GenerationCache(tmp_path / "cache.jsonl", model_fingerprint(tiny_llama))
    items, done = [], []
    evaluate._lm_class()(engine, cache, chunk=4, on_done=done.append, on_items=items.append).generate_until(requests)
    assert items == [3] and done == [0, 1, 1, 1]  # none cached, then each row as it finished
    items, done = [], []
    evaluate._lm_class()(engine, cache, chunk=4, on_done=done.append, on_items=items.append).generate_until(requests)
    assert items == [3] and done == [3]  # all read back


def test_a_large_checkpoint_is_hashed_once_per_file_signature(tmp_path, tiny_llama, monkeypatch):
    """GLM-4-9B's 18 GB take ~12 s to hash: once per run, not in each of its ~30 stages; any rewrite of a file
    (even of the same size, its mtime put back) hashes it again."""
    import json
    import os
    import shutil

    from pipeline.checkpoints import fingerprint

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    monkeypatch.setattr(fingerprint, "MEMO_MIN_BYTES", 0)
    monkeypatch.setenv("QUANTIZE_FINGERPRINT_DIR", str(tmp_path / "memo"))
    first = fingerprint.model_fingerprint(model)
    [memo] = (tmp_path / "memo").glob("*.json")
    memo.write_text(json.dumps({**json.loads(memo.read_text()), "fingerprint": "remembered"}))
    assert fingerprint.model_fingerprint(model) == "remembered"  # not hashed again
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = fingerprint.model_fingerprint(model)
    assert changed not in ("remembered", first)
