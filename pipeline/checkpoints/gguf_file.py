"""A GGUF file parsed once per resave.

transformers' GGUF loader parses the whole file, every metadata field among them (a tokenizer's vocabulary and merges:
~100k strings for the demo model, read one by one from the memory map), each time it is asked for something: the
config, the weights, the tokenizer, and the config again for each of those. A resave asked it seven times (the
check, the model, the processor, the tokenizer, the source's licence): 7 parses of the same bytes, ~70 % of the
demo's resave. Inside `parsed_once()`, every `gguf.GGUFReader(path)` of the same file and mode returns the reader
made first (it holds the parsed fields and a read-only memory map of the tensors; nothing reads it twice
differently), so the file is parsed once and what is built from it is the same as before.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def parsed_once():
    """While inside: `gguf.GGUFReader(path, mode)` (transformers imports it at each call) parses each file once."""
    import gguf

    original = gguf.GGUFReader
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":  # a writable map: never shared
            return original(path, mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()
