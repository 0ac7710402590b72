"""Reading a small YAML settings file (params.yaml, dvc.yaml) with bounds, or a UserError that
names the file, the line and the fix.

- the file: at most MAX_FILE_BYTES, UTF-8 (a UTF-16 file or bytes that are not UTF-8 are named
  with their line), not a directory, readable;
- anchors and aliases (``&name`` / ``*name``) are allowed, but the document counted with every alias
  expanded stays under MAX_EXPANDED_NODES (a 12-line "billion laughs" would otherwise grow a
  stage to gigabytes), an alias may not refer to the node that holds it, and nesting stays under
  MAX_DEPTH;
- a key given twice in one mapping is refused with both line numbers (PyYAML keeps the last
  one without a word);
- every mistake PyYAML finds (a tab in the indentation, an unclosed bracket ...) comes as
  ``FILE:LINE:COLUMN: problem``, with a hint for tabs.

``load`` also returns where each key is (``{("verdict", "bootstrap"): 57}``), so a schema error
found later can name the line too.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from pipeline.errors import UTF16_SAMPLE_BYTES, UserError, cut, not_utf8

MAX_FILE_BYTES = 1 << 20  # a settings file; params.yaml is about 5 KB
MAX_EXPANDED_NODES = 10_000  # scalars, lists and mappings, each alias counted as what it stands for
MAX_DEPTH = 40


class _Refused(yaml.YAMLError):
    """A bound broken while composing: (problem, mark)."""

    def __init__(self, problem: str, mark) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts the document as if every alias were expanded, and bounds its depth."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None and id(target) not in self._expanded:
                raise _Refused(f"the alias *{event.anchor} refers to a node that contains it (a recursive "
                               "structure); write the value out instead", event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep; a settings file needs a few",
                           self.peek_event().start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        if isinstance(node, SequenceNode):
            size = 1 + sum(self._expanded[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            size = 1 + sum(self._expanded[id(k)] + self._expanded[id(v)] for k, v in node.value)
        else:
            size = 1
        if size > MAX_EXPANDED_NODES:
            raise _Refused(f"with its aliases (*name) expanded this value holds {size:,} entries, over the "
                           f"limit of {MAX_EXPANDED_NODES:,} for a settings file; write fewer or drop the aliases",
                           node.start_mark)
        self._expanded[id(node)] = size
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # 2024-13-45 as a date, a 5,000-digit number
            raise _Refused(f"{node.value[:40]!r} cannot be read as {node.tag.rsplit(':', 1)[-1]} ({cut(str(exc).split(':')[0], 80)}); "
                           "quote it to make it text, or fix the value", node.start_mark) from None


class _TaskLoader(_BoundedLoader):
    """The same bounds for an lm-eval task YAML, whose `!function utils.f` values are read as their text ("utils.f")."""


_TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _key_text(node: Node) -> str:
    return node.value if isinstance(node, ScalarNode) else f"<{node.tag.rsplit(':', 1)[-1]}>"


def _key_identity(node: Node):
    """What two key nodes must share to become the same Python key (tag and text of a scalar)."""
    return (node.tag, node.value) if isinstance(node, ScalarNode) else id(node)


def _check_keys(path: Path, root: Node) -> dict[tuple, int]:
    """Refuses a key given twice in one mapping; returns {key path: line} for every key."""
    lines: dict[tuple, int] = {}
    stack, seen_nodes = [(root, ())], set()
    while stack:
        node, where = stack.pop()
        if id(node) in seen_nodes:  # an alias: its keys were checked where it was anchored
            continue
        seen_nodes.add(id(node))
        if isinstance(node, MappingNode):
            first: dict = {}
            for key, value in node.value:
                if key.tag == "tag:yaml.org,2002:merge":
                    continue
                if isinstance(key, ScalarNode) and _unpaired_surrogate(key.value):
                    stack.append((key, where))
                    continue
                identity, name = _key_identity(key), _key_text(key)
                line = key.start_mark.line + 1
                if identity in first:
                    dotted = ".".join((*where, name))
                    raise UserError(f"{path}:{line}: {dotted}: this key is given twice (lines {first[identity]} "
                                    f"and {line}); YAML keeps only the last, so delete one")
                first[identity] = line
                lines.setdefault((*where, name), line)
                stack.append((value, (*where, name)))
        elif isinstance(node, SequenceNode):
            stack.extend((child, (*where, str(i))) for i, child in enumerate(node.value))
        elif _unpaired_surrogate(node.value):  # "\ud800" in a quoted string: no UTF-8 file can hold it
            mark = node.start_mark
            raise UserError(f"{path}:{mark.line + 1}:{mark.column + 1}: {'.'.join(where) or 'value'}: holds an "
                            "unpaired UTF-16 surrogate (half of a character, e.g. \"\\ud800\"); write the "
                            "character whole")
    return lines


def _unpaired_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_text(path: Path, what: str) -> str:
    if path.is_dir():
        raise UserError(f"{path}: is a directory; pass {what}")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise UserError(f"{path}: over {MAX_FILE_BYTES >> 20} MB, too large for {what}; "
                        "is it the right file?")
    encoding = not_utf8(data[:UTF16_SAMPLE_BYTES])
    if encoding is not None:
        how = "" if encoding == "UTF-16" else " without a byte-order mark (every other byte is 0)"
        raise UserError(f"{path}:1: the file is {encoding} encoded{how}; save it as UTF-8")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{line}: bytes that are not UTF-8 (0x{data[exc.start]:02x}); save the file as "
                        "UTF-8") from None


def _syntax_error(path: Path, exc: yaml.YAMLError) -> UserError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    text = f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
    if isinstance(exc, _Refused):
        text = f"{where}: {problem}"
    elif "'\\t'" in problem or "\t" in problem:
        text += "; indent with spaces, not tabs"
    else:
        text += "; fix the file there"
    return UserError(text)


def load(path: Path | str, what: str = "a YAML settings file", *, task: bool = False) -> tuple[object, dict[tuple, int]]:
    """The file's data and {key path: line}; a UserError naming file and line on any problem. task: an lm-eval task
    YAML (its `!function` values read as text)."""
    path = Path(path)
    text = _read_text(path, what)
    try:
        loader = (_TaskLoader if task else _BoundedLoader)(text)
    except yaml.reader.ReaderError as exc:  # a control character such as NUL
        line = text.count("\n", 0, exc.position) + 1
        raise UserError(f"{path}:{line}: character #x{exc.character:04x} is not allowed in YAML; delete it") from None
    try:
        root = loader.get_single_node()
        if root is None:
            return None, {}
        lines = _check_keys(path, root)
        data = loader.construct_document(root)
    except yaml.YAMLError as exc:
        raise _syntax_error(path, exc) from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to read; a settings file needs a few levels") from None
    finally:
        loader.dispose()
    return data, lines
