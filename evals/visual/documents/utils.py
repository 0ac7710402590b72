"""Documents: a rendered table, form, receipt or block of text at a font size of 10 to 20 pixels, and a question
whose exact answer is one of its cells or fields (a code, a name, a date, a price, a total). Difficulty: the font size
(the table's axis), the kind, the rows, the image size. Generated (evals/visual/common.py), never stored.
"""

import importlib.util
from pathlib import Path

SUITE = "documents"
AXIS = "font_px"  # the report's table: accuracy per font size
FONT_PX = (10, 12, 15, 20)
KINDS = ("table", "form", "receipt", "text")
NAMES = ("Ada", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Juno", "Kai", "Lena", "Milo", "Nora")
SURNAMES = ("Ortiz", "Park", "Quinn", "Rossi", "Sato", "Tanaka", "Umar", "Vidal", "Weber", "Young")
CITIES = ("Lisbon", "Oslo", "Quito", "Dakar", "Hanoi", "Perth", "Bergen", "Cusco", "Tallinn", "Lyon")
GOODS = ("coffee", "bagel", "tea", "muffin", "juice", "salad", "soup", "toast", "water", "cookie", "wrap", "yogurt")
LETTERS = "ABCDEFGHJKMNPQRSTUVWXYZ"
PAD = 8  # pixels around a cell's text


def _common():
    spec = importlib.util.spec_from_file_location("visual_common", Path(__file__).resolve().parents[1] / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _common()


def _code(rng, letters: int = 2, digits: int = 4) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(letters)) + "-" + "".join(rng.choice("0123456789")
                                                                              for _ in range(digits))


def _table(rng):
    names = rng.sample(NAMES, rng.randint(4, 7))
    rows = [[name, _code(rng), str(rng.randint(1, 500))] for name in names]
    pick, column = rng.randrange(len(rows)), rng.choice((1, 2))
    header = ["Name", "Code", "Qty"]
    question = f"In the table, what is the {header[column]} for {rows[pick][0]}?"
    return [header, *rows], question, rows[pick][column], ("text", "number")[column - 1], True


def _form(rng):
    values = {"Name": f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}",
              "Date": f"20{rng.randint(10, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
              "Invoice No.": f"INV-{rng.randint(10000, 99999)}", "City": rng.choice(CITIES),
              "Account": str(rng.randint(10_000_000, 99_999_999)), "Reference": _code(rng, 3, 3)}
    fields = rng.sample(list(values), rng.randint(4, 6))
    asked = rng.choice(fields)
    return [[f"{field}:", values[field]] for field in fields], f"What is the {asked} on the form?", values[asked], \
        "text", True


def _receipt(rng):
    items = rng.sample(GOODS, rng.randint(3, 7))
    cents = [rng.randint(50, 2500) for _ in items]
    rows = [["RECEIPT", ""], *[[item, f"{c / 100:.2f}"] for item, c in zip(items, cents)], ["TOTAL", f"{sum(cents) / 100:.2f}"]]
    if rng.random() < 0.5:
        return rows, "What is the total on the receipt?", f"{sum(cents) / 100:.2f}", "number", False
    pick = rng.randrange(len(items))
    return rows, f"What is the price of {items[pick]} on the receipt?", f"{cents[pick] / 100:.2f}", "number", False


def _text(rng):
    code, city, name = _code(rng, 3, 4), rng.choice(CITIES), rng.choice(NAMES)
    sentences = [f"Dear {name}, thank you for your order.", f"It ships from our store in {city} this week.",
                 f"Your booking reference is {code}.", "Keep it for any question about your order.",
                 "We hope to see you again soon."]
    del sentences[rng.randint(3, 4)]
    return [[s] for s in sentences], "What is the booking reference in the text?", code, "text", False


MAKERS = {"table": _table, "form": _form, "receipt": _receipt, "text": _text}


def _layout(rows: list[list[str]], px: int) -> tuple[list[int], int]:
    """Each column's width and each row's height at `px` pixels."""
    columns = max(len(r) for r in rows)
    widths = [max(common.text_width(r[c], px) for r in rows if c < len(r)) + 2 * PAD for c in range(columns)]
    return widths, round(px * 1.3) + PAD


def make(rng, index: int) -> dict:
    px = FONT_PX[index % len(FONT_PX)]
    kind = KINDS[(index // len(FONT_PX)) % len(KINDS)]
    rows, question, answer, typed, grid = MAKERS[kind](rng)
    widths, row_height = _layout(rows, px)
    width, height = sum(widths) + 2 * PAD, row_height * len(rows) + 2 * PAD
    return {"question": question, "answer": answer, "answer_type": typed,
            "difficulty": {"font_px": px, "kind": kind, "rows": len(rows), "width": width, "height": height},
            "spec": {"rows": rows, "font_px": px, "grid": grid, "width": width, "height": height}}


def render(spec: dict):
    image, draw = common.canvas(spec["width"], spec["height"])
    px, rows = spec["font_px"], spec["rows"]
    face = common.font(px)
    widths, row_height = _layout(rows, px)
    for r, row in enumerate(rows):
        y, x = PAD + r * row_height, PAD
        for c, cell in enumerate(row):
            if spec["grid"]:
                draw.rectangle([x, y, x + widths[c], y + row_height], outline=(120, 120, 120))
            draw.text((x + PAD, y + row_height // 2), cell, font=face, fill=common.INK, anchor="lm")
            x += widths[c]
    return image


(load, doc_to_image, doc_to_target, summarize, table_from_lines,
 bench_images) = common.functions(SUITE, make, render, AXIS)  # lm-eval's functions and the suite's hooks
doc_to_text, process_results, options_problem = common.doc_to_text, common.process_results, common.options_problem
