"""GSM8K, zero-shot chat prompt; scored on the number the model committed to as its final answer.

The committed answer is found after an explicit final-answer marker, in two tiers:
1. the format the prompt asks for, a line starting `Answer:` (also `Final answer:`, `**Answer:**`),
   or `#### N` (GSM8K's own), or `\\boxed{N}`;
2. only if tier 1 has none: "the (final) answer is N", or `answer:` inside a line.
Within a tier the earliest marker that holds a number wins: a model that runs on after answering
(a new "Question: ... Answer: 7", a note, the answer repeated) committed to the first one. After the
marker, the answer is read from the rest of that line (or the next line when the marker ends its
line), up to the end of its sentence; working in parentheses is skipped; in `6 * 3 = 18` the value
after the last `=` counts, and `18 = 6 * 3` counts 18; a bare expression (`2 + 2 + 2`) is no answer.
Numbers may carry `$`, `%`, units, thousands separators (`1,234`, `1 234` with a thin space, LaTeX
`1{,}234`), decimals (`18.00` = 18), a unicode minus, fractions (`3/4`, `\\frac{3}{4}`, `1 1/2`), and
are compared exactly (as fractions) with the reference.

Numbers are also read written in words after a marker when the answer holds no digits ("Answer:
eighteen", "twenty-five", "one hundred and five", "1.5 million"), with a plain space as thousands
separator (`12 000`), and as powers of ten (`1.2 × 10^6`, `1.2\\times 10^{6}`, `3e4`).

An answer corrected explicitly later is read at its correction: after the committed answer, a
correction ("Wait", "Actually", "Correction", "I made a mistake", "that is wrong", "let me
recalculate") followed by a new committed answer replaces it, unless a new question has begun in
between (a runaway continuation, whose answers are not the model's answer to this one).

An output that is nothing but the answer (a number, with a currency sign, a sign, a percent sign, a
fraction or decimals, and at most three words of unit: `$18.00`, `-5`, `3/4`, `18 apples.`,
"Eighteen.") is that answer. Any other output without a marker scores wrong, whatever numbers it
holds: the prompt asks for `Answer: <number>`, and text alone cannot tell a finished answer from one
cut off at the token cap (an output that hits the cap mid-working ends in a number that is no answer:
`2 + 2 + 2 + 2`, "Step 6: Determine"). So no result line needs to know whether its output was truncated.

Where and why this differs from its peers (tests/test_math_scorer.py measures the agreement):
- lm-eval's gsm8k `strict-match` takes the first `#### N` only: our prompt asks for `Answer:`, so it
  finds nothing in most outputs. We read `####` too (tier 1).
- lm-eval's `flexible-extract` takes the last number anywhere in the output: it scores truncated
  working and runaway continuations on whatever number comes last ("Answer: 18 ... 2 weeks of 7
  days" -> 7), and `$18.00` or `1,234.` keep their symbols. We take the committed answer.
- math-verify on the whole output also extracts from unmarked, cut-off text and from the last
  expression; we keep it as a reported peer metric (`math_verify`), not counted in `acc`.
"""

import json
import re
from fractions import Fraction
from pathlib import Path

DATA = Path(__file__).with_name("gsm8k_test.jsonl")

PROMPT = (
    "Solve this math problem. Think step by step, then write the final answer "
    "on the last line as 'Answer: <number>'.\n\n{question}"
)

# ---------------------------------------------------------------- markers
ANSWER_LINE = re.compile(r"(?im)^[ \t>#*_\-]*(?:the\s+)?(?:final\s+)?answer\s*[*_]*\s*[:：]")
HASHES = re.compile(r"####")
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
ANSWER_IS = re.compile(r"(?i)\b(?:final\s+)?answer\s+(?:is|would\s+be|will\s+be|=)\s*[:：]?")
ANSWER_COLON = re.compile(r"(?i)\b(?:final\s+)?answer\s*[*_]*\s*[:：]")
TIERS = ((ANSWER_LINE, HASHES, BOXED), (ANSWER_IS, ANSWER_COLON))

# ---------------------------------------------------------------- numbers
_SEP = "[, \u202f\u2009\u00a0]"  # thousands separators: comma, plain / narrow / thin / no-break space
_PLAIN = rf"(?:\d{{1,3}}(?:{_SEP}\d{{3}})+|\d+)(?:\.\d+)?|\.\d+"
NUMBER = re.compile(rf"(?<![\w.])(-?)(?:(\d+)\s+(\d+)\s*/\s*(\d+)|(\d+)\s*/\s*(\d+)(?!\.\d)|({_PLAIN}))")
OPERATOR_BETWEEN = re.compile(r"^\s*(?:[+*×x·÷^]|-)\s*$")
SENTENCE_END = re.compile(r"\.(?!\d)|[!?;]")
LATEX = [
    (re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"\1/\2"),
    (re.compile(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}"), r" \1"),
    (re.compile(r"\{,\}"), ","),
    (re.compile(r"\\[,;:! ]"), ""),
    (re.compile(r"\\(?:times|cdot)"), "*"),
    (re.compile(r"\\div"), "/"),
    (re.compile(r"\\[()\[\]]|\\\$|\\%|\$|%|\*\*|__|`"), " "),
    (re.compile(r"\\left|\\right"), ""),
    (re.compile(r"[−–‒]"), "-"),  # unicode minus and dashes
    (re.compile(r"[€£¥]"), " "),
]
# powers of ten: 1.2 x 10^6, 1.2 * 10^{6} (after LATEX: \\times -> *), 1.2 * 10**6, 10^6, 3e4, 3E+4
POWER = re.compile(r"(?<![\w.])(?:(\d+(?:\.\d+)?)\s*[*×x·]\s*)?10\s*(?:\^|\*\*)\s*\{?\s*([+-]?\d{1,3})\s*\}?"
                   r"|(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d{1,3})(?![\w.])")
SCALE = re.compile(r"(?i)(?<![\w.])(\d+(?:\.\d+)?)\s+(thousand|million|billion)\b")
SCALES = {"thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9}
NEW_QUESTION = re.compile(r"(?im)^[ \t>#*_]*(?:question|problem|q)\s*\d*\s*[:.)]")
CORRECTION = re.compile(
    r"(?i)\b(?:wait|actually|correction|oops|on second thought|i made (?:a|an) (?:mistake|error)|i was wrong"
    r"|(?:that|this)(?:'s|\s+is|\s+was)\s+(?:wrong|incorrect|not right|a mistake)"
    r"|let me (?:re-?calculate|re-?check|correct|redo|fix|recompute))\b")
# an output that is nothing but the answer: number (sign, fraction, decimals) and at most three words of unit
BARE = re.compile(r"^\s*(?P<number>.+?)\s*%?\s*(?:°\s*[CF]?)?(?P<unit>(?:\s*[A-Za-z][A-Za-z'/-]*){0,3})\s*[.!]?\s*$")


def load_gsm8k(**_):
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    for index, row in enumerate(rows):
        row["id"] = f"gsm8k-test-{index:04d}"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return PROMPT.format(question=doc["question"])


def gold(doc) -> str:
    return doc["answer"].split("####")[-1].strip().replace(",", "")


def doc_to_target(doc):
    return gold(doc)


def _clean(text: str) -> str:
    for pattern, replacement in LATEX:
        text = pattern.sub(replacement, text)
    return text


def _braced(text: str, start: int) -> str:
    """The content of the brace group opening just before `start` (nested braces kept)."""
    depth = 1
    for index in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start:index]
    return ""  # never closed: cut off at the token cap


def _segment(text: str, match: re.Match) -> str:
    """The text that holds the committed answer: a \\boxed{} group, else the rest of the marker's
    line (the next non-empty line when nothing follows the marker on its own)."""
    if match.re is BOXED:
        return _braced(text, match.end())
    rest = text[match.end():]
    line, _, after = rest.partition("\n")
    if not line.strip(" \t*_:"):
        line = next((candidate for candidate in after.split("\n") if candidate.strip()), "")
    return line


def _value(match: re.Match) -> Fraction:
    sign = -1 if match.group(1) else 1
    whole, num, den, num2, den2, plain = match.groups()[1:]
    if num is not None:
        return sign * (int(whole) + Fraction(int(num), int(den)))
    if num2 is not None:
        return sign * Fraction(int(num2), int(den2))
    return sign * Fraction(re.sub(_SEP, "", plain))


def _number_in(part: str) -> Fraction | None:
    """The answer in a piece of text: its first number, unless that number starts a bare
    expression (`2 + 2 + 2`), which is working, not an answer."""
    numbers = list(NUMBER.finditer(part))
    if not numbers:
        return None
    if len(numbers) > 1 and OPERATOR_BETWEEN.match(part[numbers[0].end():numbers[1].start()]):
        return None
    try:
        return _value(numbers[0])
    except ZeroDivisionError:
        return None


_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
          "sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
WORD_VALUES = {**{w: i for i, w in enumerate(_UNITS)}, **{w: 20 + 10 * i for i, w in enumerate(_TENS)},
               "hundred": 100, **SCALES}
_WORD = "|".join(sorted(WORD_VALUES, key=len, reverse=True))
WORD_NUMBER = re.compile(rf"(?i)\b(?:{_WORD})(?:(?:\s+and\s+|[\s-]+)(?:{_WORD}))*\b")


def _words_value(words: str) -> int:
    """'one hundred and twenty-five' -> 125, 'three thousand four hundred' -> 3400."""
    total = current = 0
    for word in re.findall(r"[a-z]+", words.lower()):
        value = WORD_VALUES.get(word)
        if value is None:  # "and"
            continue
        if value == 100:
            current = (current or 1) * 100
        elif value >= 1000:
            total += (current or 1) * value
            current = 0
        else:
            current += value
    return total + current


def _digits(fraction: Fraction) -> str:
    """A number as plain digits (a finite decimal when it is not whole)."""
    if fraction.denominator == 1:
        return str(fraction.numerator)
    return format(fraction.numerator / fraction.denominator, "f").rstrip("0")


def _expand(text: str) -> str:
    """Powers of ten and 'N million' written out as digits."""
    def power(match: re.Match) -> str:
        mantissa, exponent = (match.group(1) or "1", match.group(2)) if match.group(2) else match.group(3, 4)
        return _digits(Fraction(mantissa) * Fraction(10) ** int(exponent))

    text = POWER.sub(power, text)
    return SCALE.sub(lambda m: _digits(Fraction(m.group(1)) * SCALES[m.group(2).lower()]), text)


def _with_words_read(text: str) -> str:
    """Numbers written in words as digits, only where the text holds no digit at all."""
    if re.search(r"\d", text):
        return text
    return WORD_NUMBER.sub(lambda m: str(_words_value(m.group(0))), text)


def committed_number(segment: str) -> Fraction | None:
    """The number a segment after a final-answer marker commits to."""
    text = _with_words_read(_expand(_clean(segment)))
    end = SENTENCE_END.search(text)
    text = text[:end.start()] if end else text
    while True:  # working in (...) or [...] after the answer is skipped
        shorter = re.sub(r"(?<=\S)\s*(?:\([^()]*\)|\[[^\[\]]*\])", " ", text)
        if shorter == text:
            break
        text = shorter
    if "=" in text:
        parts = text.split("=")
        first = _number_in(parts[0])
        lone = first is not None and len(NUMBER.findall(parts[0])) == 1 and not re.search(r"[A-Za-z]", parts[0])
        return first if lone else _number_in(parts[-1])
    return _number_in(text)


def _committed(output: str, start: int = 0) -> tuple[Fraction | None, int]:
    """The first committed answer at or after `start` (tier 1 before tier 2) and where its marker ends."""
    for tier in TIERS:
        matches = sorted((m for pattern in tier for m in pattern.finditer(output, start)), key=lambda m: m.start())
        for match in matches:
            value = committed_number(_segment(output, match))
            if value is not None:
                return value, match.end()
    return None, len(output)


def bare_answer(output: str) -> Fraction | None:
    """The value of an output that is nothing but the answer (`$18.00`, `-5`, `3/4`, `18 apples.`)."""
    found = BARE.match(_expand(_clean(output)))
    if not found or not found.group("number").strip():
        return None
    number = NUMBER.fullmatch(re.sub(r"-\s+(?=\d)", "-", found.group("number").strip()))
    try:
        return _value(number) if number else None
    except ZeroDivisionError:
        return None


def final_answer(output: str) -> Fraction | None:
    """The number the model committed to as its final answer, or None when it committed to none
    (no marker, an empty or non-numeric answer, an output cut off before it); an explicit correction
    before any new question replaces it; an output that is nothing but a number is that number."""
    value, end = _committed(output)
    if value is None:
        return bare_answer(output)
    while True:
        question = NEW_QUESTION.search(output, end)
        stop = question.start() if question else len(output)
        correction = CORRECTION.search(output, end, stop)
        if not correction:
            return value
        corrected, corrected_end = _committed(output[:stop], correction.end())
        if corrected is None:
            return value
        value, end = corrected, corrected_end


def is_correct(output: str, target: str) -> bool:
    value = final_answer(output)
    return value is not None and value == Fraction(target.replace(",", ""))


def math_verify_correct(output: str, target: str) -> bool:
    """math-verify's verdict on the whole output: a peer figure, reported beside `acc`, not counted."""
    try:
        from math_verify import parse, verify

        return bool(verify(parse(target), parse(output)))
    except Exception:  # math-verify gives up on odd text
        return False


def process_results(doc, results):
    output, target = results[0], gold(doc)
    return {"acc": float(is_correct(output, target)), "math_verify": float(math_verify_correct(output, target))}
