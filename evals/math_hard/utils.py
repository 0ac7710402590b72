"""MATH-500, zero-shot chat prompt; scored on the last \\boxed{} answer, compared with the gold answer by equivalence.

The answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`; nested braces kept) in the text after the
reasoning: what a `</think>` closes is reasoning, and an output cut inside its reasoning (`<think>` never closed) has no
answer. No box, an empty box, or a last box never closed (the output cut at the token cap) is no answer: wrong. A model
that boxes several things committed to the last one, save boxes that close the answer together
(`\\boxed{1}` and `\\boxed{-2}`: a list; the same value twice, `\\boxed{15\\frac{39}{40}}, or \\boxed{\\frac{639}{40}}`: that value).

Both answers are normalised the same way: `$`, `\\(`, `\\)`, `\\left`, `\\right`, `\\displaystyle`, LaTeX spacing
(`\\,` `\\!` `\\;` `~`) dropped; `\\dfrac` / `\\tfrac` are `\\frac`; `\\frac12`, `\\frac{270}7`, `\\sqrt2` get their braces;
`\\text{}` / `\\mbox{}` / `\\mathrm{}` / `\\textbf{}` give their text; a unit after a number (`5.4 cents`, `864 inches^2`,
`15 cm^2`), degrees (`90^\\circ`, `°`, `degrees`), dollars (`\\$`) and percent (`\\%`) are dropped; thousands separators
(`10,\\!080`, `58,500`) go; a base subscript is `_8` however braced (and a bare `52` is read as `52_8` when the gold
names the base); `x = 5` or `x \\in [-2, 7]` against a gold without `=` is its right-hand side.

Then, in order, the first that holds decides "right" (none holding is "wrong"):
1. the two normalised texts are the same (spaces aside);
2. text answers (`\\text{Evelyn}`, `\\text{(C)}`): the same words or choice letter, case and parentheses aside;
3. structure first, then each element by value (4):
   - a matrix or vector (`\\begin{pmatrix}`) element by element, shape kept (a column vector may be written as a tuple);
   - a tuple, point or interval (`(a, b]`): the same brackets, the same length, element by element in order;
   - a union of intervals (`\\cup`), a set (`\\{...\\}`) or a list (`1, -2`; `1 \\pm \\sqrt{19}` is two elements): the
     same elements in any order;
   - an equation (`y = 2x + 3`, a plane `5x - 7y + 11z + 4 = 0`): left minus right side proportional to the gold's;
4. values: each side as a sympy expression (our own LaTeX reading: `\\frac`, `\\sqrt`, `\\sqrt[n]`, `\\binom`, `^`,
   `\\pi`, `\\infty`, `i` the imaginary unit, trigonometric and log functions, implicit products, mixed numbers
   `1\\frac{4}{5}`); decimals are read exactly (`0.15` = 3/20, so `0.333` is not 1/3); numbers are equal when they
   agree to 1e-9 relative at 30 digits, expressions in the same variables when they agree at three fixed points.
   sympy never sees the model's text as code: only numbers, operators, single letters and a list of function names
   reach it; each comparison has TIMEOUT_S (a SIGALRM timer in the main thread, a waited-for thread elsewhere), and a
   power tower or a huge exponent is refused before; a comparison that times out or cannot be read is "not equal".

math-verify (`math_verify`) scores the same answer text (the output after its reasoning) against `$<gold>$`: a peer
figure, reported beside `acc`, not counted. tests/test_math_hard.py measures where it, and lm-eval's
hendrycks_math `is_equiv` (the MATH authors' string normaliser), disagree with a hand-graded corpus.
"""

import gzip
import json
import random
import re
import signal
import threading
from pathlib import Path

DATA = Path(__file__).with_name("math500_test.jsonl.gz")
TIMEOUT_S = 2.0  # one comparison of two values in sympy: parsing and evaluating take milliseconds when they work
PROMPT = ("Solve the following math problem. Reason step by step, and put your final answer within \\boxed{{}}.\n\n"
          "{problem}")


def load_math500(**_):
    import datasets

    with gzip.open(DATA, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for row in rows:  # test/precalculus/807.json -> math500-precalculus-807
        subject, number = row["unique_id"].removesuffix(".json").split("/")[1:]
        row["id"] = f"math500-{subject}-{number}"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return PROMPT.format(problem=doc["problem"])


def doc_to_target(doc):
    return doc["answer"]


# ---------------------------------------------------------------- the answer
BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening just before `start`; None when it never closes."""
    depth = 1
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return None


def answer_text(output: str) -> str:
    """The output after its reasoning: after the last `</think>`; nothing when a `<think>` is never closed."""
    if "</think>" in output:
        return output.rsplit("</think>", 1)[1]
    return "" if "<think>" in output else output


JOINED = re.compile(r"[\s$,.;]*(?:(?:and|or|\\text\s*\{\s*(?:and|or)\s*\}|\\quad)[\s$,.;]*)?")


def final_answer(output: str) -> str | None:
    """The content of the last \\boxed{} after the reasoning, None when there is none, it is empty or never closed.
    Boxes that end the answer joined only by a comma, `and` or `or` (`\\boxed{2} and \\boxed{3}`) are one list, or
    one answer when they are the same value."""
    text = answer_text(output)
    boxes = []
    for match in BOX.finditer(text):
        if boxes and match.start() < boxes[-1][1]:  # a box inside the last one
            continue
        content = _braced(text, match.end())
        if content is None:  # cut at the token cap inside its box
            return None
        end = match.end() + len(content) + 1
        joined = bool(boxes) and JOINED.fullmatch(text[boxes[-1][1]:match.start()]) is not None
        boxes = [*boxes, (content, end)] if joined else [(content, end)]
    contents = [content.strip() for content, _ in boxes if content.strip()]
    if len(contents) > 1 and all(equivalent(other, contents[0]) for other in contents[1:]):
        contents = contents[-1:]  # one value in two forms: `\\boxed{15\\frac{39}{40}}, or \\boxed{\\frac{639}{40}}`
    return ", ".join(contents) or None


# ---------------------------------------------------------------- normalisation
UNITS = (r"(?:square|sq\.?|cubic)?\s*(?:cm|mm|km|meters?|metres?|inch(?:es)?|feet|foot|ft|yards?|miles?|units?"
         r"|in|degrees?|cents?|dollars?|hours?|minutes?|seconds?|days?|weeks?|years?|pounds?|ounces?|grams?|kg"
         r"|liters?|litres?|mph|people|students|ways|points|games|coins|marbles|pages)")
UNIT_TAIL = re.compile(rf"(?<=[\d}}.])\s*(?:{UNITS}\b\s*(?:\^\s*\{{?\d\}}?)?\s*)+$", re.I)
TEXT_COMMAND = re.compile(r"\\(?:text|mbox|mathrm|textbf|textnormal|mathbf|textit|operatorname)\s*\{([^{}]*)\}")
REPLACE = [
    (re.compile(r"\\[dt]frac"), r"\\frac"), (re.compile(r"\\[dt]binom"), r"\\binom"),
    (re.compile(r"\\(?:displaystyle|left|right|bigl|bigr|Bigl|Bigr)(?![a-zA-Z])"), ""),
    (re.compile(r"\\\{,\\}|\{,\}"), ","), (re.compile(r",\\!\s*"), ","),
    (re.compile(r"(?<!\\)\\[,;:!]"), ""), (re.compile(r"(?<!\\)\\ |\\q?quad|~"), " "),
    (re.compile("∞"), r"\\infty "), (re.compile("π"), r"\\pi "), (re.compile("[−–]"), "-"),
    (re.compile("×"), r"\\times "), (re.compile("·"), r"\\cdot "),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree"), ""),
    (re.compile(r"\\%|%|\\\$|\$|\\\(|\\\)"), ""),
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*([0-9a-zA-Z])"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac\s*([0-9a-zA-Z])\s*\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\s*(\{[^{}]*\})\s*([0-9a-zA-Z])"), r"\\frac\1{\2}"),
    (re.compile(r"\\sqrt\s*([0-9a-zA-Z])"), r"\\sqrt{\1}"),
    (re.compile(r"_\s*\{\s*(\w+)\s*\}"), r"_\1"),
    (re.compile(r"^[a-zA-Z]\s*\\in\s*"), ""),
    (re.compile(r"\\boxed\s*\{(.*)\}"), r"\1"),
]


def normalize(answer: str) -> str:
    """An answer in the one form both sides are compared in (the module's docstring lists each rule)."""
    text = answer.strip()
    for _ in range(3):  # \text{...} nested once or twice
        text = TEXT_COMMAND.sub(lambda m: f" {m.group(1)} ", text)
    for pattern, replacement in REPLACE:
        text = pattern.sub(replacement, text)
    text = re.sub(r"\bdegrees?\b", "", text) if re.search(r"\d", text) else text
    text = UNIT_TAIL.sub("", text.strip())
    if not text.startswith(("(", "[")):
        text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)  # 58,500 (a list is written with spaces: 1, 234)
    return _interval(re.sub(r"\s+", " ", text).strip().rstrip(" .,;"))


LESS = r"(<|\\lt|\\leq?(?:slant)?|≤)"
GREATER = r"(>|\\gt|\\geq?(?:slant)?|≥)"


def _interval(text: str) -> str:
    """An inequality in one variable as its interval: `-2 \\le x \\le 7` is `[-2, 7]`, `x > 2` is `(2, \\infty)`."""
    def bracket(operator: str, side: str) -> str:
        strict = operator in ("<", ">", "\\lt", "\\gt")
        return {"left": "(" if strict else "[", "right": ")" if strict else "]"}[side]

    if chain := re.fullmatch(rf"(.+?)\s*{LESS}\s*[a-zA-Z]\s*{LESS}\s*(.+)", text):
        low, first, second, high = chain.groups()
        return f"{bracket(first, 'left')}{low}, {high}{bracket(second, 'right')}"
    if above := re.fullmatch(rf"[a-zA-Z]\s*{GREATER}\s*(.+)", text):
        return f"{bracket(above.group(1), 'left')}{above.group(2)}, \\infty)"
    if below := re.fullmatch(rf"[a-zA-Z]\s*{LESS}\s*(.+)", text):
        return f"(-\\infty, {below.group(2)}{bracket(below.group(1), 'right')}"
    return text


def _compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


# ---------------------------------------------------------------- structure
OPEN, CLOSE = "([{", ")]}"


def _split_top(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside any bracket or brace."""
    parts, depth, start, index = [], 0, 0, 0
    while index < len(text):
        char = text[index]
        if char in OPEN:
            depth += 1
        elif char in CLOSE:
            depth -= 1
        elif depth == 0 and text.startswith(separator, index):
            parts.append(text[start:index])
            start = index + len(separator)
            index = start
            continue
        index += 1
    return [part.strip() for part in parts + [text[start:]]]


def _wraps_whole(text: str) -> bool:
    """The bracket opening `text` closes at its last character (`(3, 4]`), not earlier (`(a+5)(b+2)`)."""
    depth = 0
    for index, char in enumerate(text):
        depth += 1 if char in OPEN else -1 if char in CLOSE else 0
        if depth == 0:
            return index == len(text) - 1
    return False


def _pm(item: str) -> list[str]:
    """`1 \\pm \\sqrt{19}` as its two values (the first \\pm at a time)."""
    if "\\pm" not in item:
        return [item]
    return _pm(item.replace("\\pm", "+", 1)) + _pm(item.replace("\\pm", "-", 1))


def structure(text: str) -> tuple[str, list]:
    """(kind, elements): matrix (rows of elements), tuple with its brackets (`(]`), union, set, equation or value."""
    matrix = re.fullmatch(r"\\begin\{[pbvB]?matrix\}(.*)\\end\{[pbvB]?matrix\}", text, re.S)
    if matrix:
        return "matrix", [[cell.strip() for cell in row.split("&")] for row in re.split(r"\\\\", matrix.group(1))
                          if row.strip()]
    if len(union := _split_top(text, "\\cup")) > 1:
        return "set", union
    if text.startswith("\\{") and text.endswith("\\}"):
        return "set", [v for item in _split_top(text[2:-2], ",") for v in _pm(item)]
    if len(items := _split_top(text, ",")) > 1 or "\\pm" in text:
        return "set", [v for item in items for v in _pm(item)]
    if text[:1] in "([" and text[-1:] in ")]" and _wraps_whole(text) and len(_split_top(text[1:-1], ",")) > 1:
        return "tuple" + text[0] + text[-1], _split_top(text[1:-1], ",")
    if text.count("=") == 1:
        return "equation", [side.strip() for side in text.split("=")]
    return "value", [text]


# ---------------------------------------------------------------- comparison
def equivalent(predicted: str | None, gold: str) -> bool:
    """Whether a model's boxed answer is the gold answer (rules in the module's docstring)."""
    return predicted is not None and _same(normalize(predicted), normalize(gold))


def _same(a: str, b: str) -> bool:
    if ("=" in a) != ("=" in b):  # x = 5 against 5
        a, b = (re.sub(r"^[a-zA-Z]\s*=\s*", "", side) for side in (a, b))
    if re.fullmatch(r"\w+_\d+", b) and re.fullmatch(r"[0-9A-Za-z]+", a):  # 52 against 52_8
        a = f"{a}_{b.rsplit('_', 1)[1]}"
    if _compact(a) == _compact(b):
        return True
    if re.fullmatch(r"\(?[A-Za-z][A-Za-z ]*\)?", b):  # words or a choice letter
        return re.sub(r"[^a-z]", "", b.lower()) == re.sub(r"[^a-z]", "", a.lower())
    (kind_a, items_a), (kind_b, items_b) = structure(a), structure(b)
    if kind_a == "matrix" and kind_b.startswith("tuple("):  # a column vector written as a tuple
        kind_a, items_a = kind_b, [row[0] for row in items_a] if all(len(row) == 1 for row in items_a) else items_a
    if kind_b == "matrix" and kind_a.startswith("tuple("):
        kind_b, items_b = kind_a, [row[0] for row in items_b] if all(len(row) == 1 for row in items_b) else items_b
    if kind_a != kind_b or len(items_a) != len(items_b):
        return False
    if kind_a == "matrix":
        return all(len(r) == len(s) and all(_same(x, y) for x, y in zip(r, s)) for r, s in zip(items_a, items_b))
    if kind_a == "set":
        left = list(items_a)
        for item in items_b:  # each gold element matched by one of the answer's
            match = next((i for i, candidate in enumerate(left) if _same(candidate, item)), None)
            if match is None:
                return False
            left.pop(match)
        return True
    if kind_a.startswith("tuple"):
        return all(_same(x, y) for x, y in zip(items_a, items_b))
    _import_sympy()  # once, before any timer starts: importing it takes seconds on a busy machine
    if kind_a == "equation":
        return bool(_within(TIMEOUT_S, _proportional, f"({items_a[0]})-({items_a[1]})",
                            f"({items_b[0]})-({items_b[1]})"))
    return bool(_within(TIMEOUT_S, _equal_values, a, b))


# ---------------------------------------------------------------- values, through sympy
FUNCTIONS = {"sqrt", "log", "exp", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh",
             "tanh", "binomial", "pi", "oo"}
LATEX_NAMES = {r"\pi": " pi ", r"\infty": " oo ", r"\cdot": "*", r"\times": "*", r"\div": "/", r"\ln": " log ",
               **{f"\\{name}": f" {name} " for name in ("log", "exp", "sin", "cos", "tan", "cot", "sec", "csc",
                                                         "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh")}}
ALLOWED = re.compile(r"[0-9A-Za-z+\-*/(). ]*")


class _TimeUp(Exception):
    pass


def _within(seconds: float, function, *args):
    """function(*args), or None when it raises or takes longer than `seconds` (SIGALRM in the main thread; in
    another thread the call runs in a daemon thread that is waited for that long)."""
    def guarded():
        try:
            return function(*args)
        except Exception:  # sympy's own errors on what it cannot read: not equal
            return None

    if threading.current_thread() is not threading.main_thread():
        box: list = []
        worker = threading.Thread(target=lambda: box.append(guarded()), daemon=True)
        worker.start()
        worker.join(seconds)
        return box[0] if box else None

    def alarm(*_):
        raise _TimeUp

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return guarded()
    except _TimeUp:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _latex_groups(text: str) -> str | None:
    """\\frac{a}{b}, \\sqrt[n]{a}, \\sqrt{a} and \\binom{a}{b} as Python; None when a group never closes."""
    pattern = re.compile(r"\\(frac|binom|sqrt)\s*(?:\[([^\[\]]*)\])?\s*\{")
    while match := pattern.search(text):
        first = _braced(text, match.end())
        if first is None:
            return None
        end = match.end() + len(first) + 1
        if match.group(1) == "sqrt":
            root = f"(({first})**(1/({match.group(2)})))" if match.group(2) else f"sqrt({first})"
            text = text[:match.start()] + root + text[end:]
            continue
        rest = re.match(r"\s*\{", text[end:])
        second = _braced(text, end + rest.end()) if rest else None
        if second is None:
            return None
        joined = f"(({first})/({second}))" if match.group(1) == "frac" else f"binomial({first},{second})"
        text = text[:match.start()] + joined + text[end + rest.end() + len(second) + 1:]
    return text


def to_python(latex: str) -> str | None:
    """A value's LaTeX as the Python text sympy reads, or None when it holds anything outside numbers, operators,
    single letters and FUNCTIONS (nothing else ever reaches sympy's eval)."""
    text = latex.strip()
    mixed = re.fullmatch(r"(-?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}", text)  # 1\frac{4}{5}: one and four fifths
    if mixed:
        text = f"{mixed.group(1)}({mixed.group(2)}+{mixed.group(3)}/{mixed.group(4)})"
    text = _latex_groups(text)
    if text is None:
        return None
    for name, python in LATEX_NAMES.items():
        text = re.sub(re.escape(name) + r"(?![a-zA-Z])", lambda _: python, text)
    text = text.replace("{", "(").replace("}", ")").replace("^", "**").replace("arc", "a")
    if not ALLOWED.fullmatch(text) or re.search(r"[A-Za-z)]\s*\.", text) or len(text) > 400:
        return None
    # words that are not FUNCTIONS are products of single letters (xy = x*y)
    text = re.sub(r"[A-Za-z]{2,}", lambda m: m.group(0) if m.group(0) in FUNCTIONS else "*".join(m.group(0)), text)
    if re.search(r"\d{60,}", text) or re.search(r"\*\*\s*\(?\s*\d{5,}", text) or re.search(r"\*\*\s*\([^()]*\*\*", text):
        return None  # a huge number or a power tower: refused before sympy spends minutes on it
    return text


def _import_sympy() -> None:
    import sympy.parsing.sympy_parser  # noqa: F401


def _sympy(latex: str):
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr, rationalize,
                                            standard_transformations)

    text = to_python(latex)
    if text is None:
        return None
    names = {letter: sympy.Symbol(letter) for letter in set(re.findall(r"(?<![A-Za-z])[A-Za-z](?![A-Za-z])", text))}
    names.update(i=sympy.I, e=sympy.E, pi=sympy.pi, oo=sympy.oo)
    names.update({name: getattr(sympy, name) for name in FUNCTIONS - {"pi", "oo"}})
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor, rationalize)
    return parse_expr(text, local_dict=names, global_dict={"Integer": sympy.Integer, "Float": sympy.Float,
                                                           "Rational": sympy.Rational, "Symbol": sympy.Symbol},
                      transformations=transformations)


SEEDS = (1, 2, 3)


def _at_points(expression, symbols) -> list[complex]:
    """The expression's value at three fixed points of its variables (each in (0.5, 2.5), seeded)."""
    values = []
    for seed in SEEDS:
        rng = random.Random(seed)
        value = complex(expression.subs({s: 0.5 + 2 * rng.random() for s in sorted(symbols, key=str)}).evalf(30))
        values.append(value)
    return values


def _close(x: complex, y: complex) -> bool:
    return abs(x - y) <= 1e-9 * max(abs(x), abs(y))  # relative: 6.72e-5 is not 6.72e-4, nor 1e-12 2e-12


def _equal_values(a: str, b: str) -> bool:
    x, y = _sympy(a), _sympy(b)
    if x is None or y is None or x.free_symbols != y.free_symbols:
        return False
    if x.has(*_infinities()) or y.has(*_infinities()):
        return x == y
    return all(_close(p, q) for p, q in zip(_at_points(x, x.free_symbols), _at_points(y, y.free_symbols)))


def _proportional(a: str, b: str) -> bool:
    """Two equations `left - right` that are a nonzero constant multiple of each other (the same solutions)."""
    x, y = _sympy(a), _sympy(b)
    if x is None or y is None or x.free_symbols != y.free_symbols:
        return False
    ratios = [p / q if q else None for p, q in zip(_at_points(x, x.free_symbols), _at_points(y, y.free_symbols))]
    return None not in ratios and abs(ratios[0]) > 1e-12 and all(_close(r, ratios[0]) for r in ratios)


def _infinities():
    import sympy

    return sympy.oo, -sympy.oo, sympy.zoo


# ---------------------------------------------------------------- scores
def is_correct(output: str, gold: str) -> bool:
    return equivalent(final_answer(output), gold)


def math_verify_correct(output: str, gold: str) -> bool:
    """math-verify's verdict on the answer text (after the reasoning): a peer figure, reported beside `acc`, not
    counted."""
    try:
        from math_verify import parse, verify

        return bool(verify(parse(f"${gold}$"), parse(answer_text(output))))
    except Exception:  # math-verify gives up on odd text
        return False


def process_results(doc, results):
    output, gold = results[0], doc["answer"]
    return {"acc": float(is_correct(output, gold)), "math_verify": float(math_verify_correct(output, gold))}
