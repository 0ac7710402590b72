"""Charts: a bar or line chart of 3 to 12 labelled values (whole numbers 1-99, each printed at its bar or point), and a
question with an exact answer: one value read, the higher of two named, or two summed. Difficulty: the element count
(the table's axis), the chart kind, the question, the image size. Generated (evals/visual/common.py), never stored.
"""

import importlib.util
from pathlib import Path

SUITE = "charts"
AXIS = "elements"  # the report's table: accuracy per element count
ELEMENTS = (3, 5, 8, 12)
KINDS = ("bar", "line")
ASKS = ("read", "compare", "sum")
LABELS = {"bar": ("ash", "elm", "oak", "fir", "yew", "pine", "teak", "bay", "palm", "lime", "cork", "sage"),
          "line": ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")}
STEP, LEFT, TOP, PLOT, FONT_PX = 48, 56, 36, 220, 13  # pixels: per element, margins, plot height, label font


def _common():
    spec = importlib.util.spec_from_file_location("visual_common", Path(__file__).resolve().parents[1] / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _common()


def make(rng, index: int) -> dict:
    n = ELEMENTS[index % len(ELEMENTS)]
    kind = KINDS[(index // len(ELEMENTS)) % len(KINDS)]
    ask = ASKS[(index // (len(ELEMENTS) * len(KINDS))) % len(ASKS)]
    labels = list(LABELS[kind][:n]) if kind == "line" else rng.sample(LABELS[kind], n)
    values = [rng.randint(1, 99) for _ in labels]
    a, b = rng.sample(range(n), 2)
    while values[b] == values[a]:
        values[b] = rng.randint(1, 99)
    width, height = LEFT + STEP * n + 16, TOP + PLOT + 40
    if ask == "read":
        question, answer, typed = f"In the chart, what is the value for {labels[a]}?", values[a], "number"
    elif ask == "compare":
        question = f"In the chart, which is higher: {labels[a]} or {labels[b]}? Answer with its label."
        answer, typed = labels[a] if values[a] > values[b] else labels[b], "text"
    else:
        question = f"In the chart, what is the sum of the values for {labels[a]} and {labels[b]}?"
        answer, typed = values[a] + values[b], "number"
    return {"question": question, "answer": answer, "answer_type": typed,
            "difficulty": {"elements": n, "chart": kind, "question": ask, "width": width, "height": height},
            "spec": {"kind": kind, "labels": labels, "values": values, "width": width, "height": height}}


def render(spec: dict):
    image, draw = common.canvas(spec["width"], spec["height"])
    small = common.font(FONT_PX)
    y_of = lambda v: TOP + PLOT - round(v * PLOT / 100)  # noqa: E731
    for tick in range(0, 101, 25):  # the axis and its gridlines
        draw.line([(LEFT, y_of(tick)), (spec["width"] - 8, y_of(tick))], fill=(225, 225, 225))
        draw.text((LEFT - 6, y_of(tick)), str(tick), font=small, fill=common.INK, anchor="rm")
    draw.line([(LEFT, TOP - 8), (LEFT, y_of(0))], fill=common.INK)
    points = []
    for i, (label, value) in enumerate(zip(spec["labels"], spec["values"])):
        x = LEFT + STEP * i + STEP // 2
        if spec["kind"] == "bar":
            draw.rectangle([x - STEP // 3, y_of(value), x + STEP // 3, y_of(0)], fill=(70, 110, 180))
        points.append((x, y_of(value)))
        draw.text((x, y_of(value) - 4), str(value), font=small, fill=common.INK, anchor="mb")
        draw.text((x, y_of(0) + 6), label, font=small, fill=common.INK, anchor="mt")
    if spec["kind"] == "line":
        draw.line(points, fill=(200, 80, 40), width=2)
        for x, y in points:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(200, 80, 40))
    return image


(load, doc_to_image, doc_to_target, summarize, table_from_lines,
 bench_images) = common.functions(SUITE, make, render, AXIS)  # lm-eval's functions and the suite's hooks
doc_to_text, process_results, options_problem = common.doc_to_text, common.process_results, common.options_problem
