"""Small text: one short random code (6 characters of letters and digits that cannot be mistaken for one another) or a
word, written once at a seeded place of a 320 x 96 image at a font size from 24 down to 6 pixels; the answer is the
text itself (case ignored). Difficulty: the font size (the table's axis), code or word, its length. A code cannot be
guessed from the language: below the size the model can read, it scores 0. Generated (evals/visual/common.py).
"""

import importlib.util
from pathlib import Path

SUITE = "small_text"
AXIS = "font_px"  # the report's table: accuracy per font size
FONT_PX = (24, 16, 12, 10, 8, 6)
KINDS = ("code", "word")
CODE_CHARACTERS = "ACDEFHJKLMNPRTUVWXY34679"  # no 0/O, 1/I, 2/Z, 5/S, 8/B
CODE_LENGTH = 6
WORDS = ("harbor", "velvet", "marble", "thistle", "lantern", "meadow", "copper", "falcon", "orchid", "timber",
         "saddle", "pepper", "glacier", "walnut", "canyon", "ribbon", "hammer", "kettle", "pillow", "anchor")
WIDTH, HEIGHT = 320, 96


def _common():
    spec = importlib.util.spec_from_file_location("visual_common", Path(__file__).resolve().parents[1] / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _common()


def make(rng, index: int) -> dict:
    px = FONT_PX[index % len(FONT_PX)]
    kind = KINDS[(index // len(FONT_PX)) % len(KINDS)]
    text = ("".join(rng.choice(CODE_CHARACTERS) for _ in range(CODE_LENGTH)) if kind == "code"
            else rng.choice(WORDS))
    room = max(0, WIDTH - 16 - common.text_width(text, px))
    x, y = 8 + rng.randint(0, room), rng.randint(8, HEIGHT - 8 - round(px * 1.3))
    return {"question": "What text is written in the image?", "answer": text, "answer_type": "text",
            "difficulty": {"font_px": px, "kind": kind, "length": len(text), "width": WIDTH, "height": HEIGHT},
            "spec": {"text": text, "font_px": px, "x": x, "y": y}}


def render(spec: dict):
    image, draw = common.canvas(WIDTH, HEIGHT)
    draw.text((spec["x"], spec["y"]), spec["text"], font=common.font(spec["font_px"]), fill=common.INK)
    return image


(load, doc_to_image, doc_to_target, summarize, table_from_lines,
 bench_images) = common.functions(SUITE, make, render, AXIS)  # lm-eval's functions and the suite's hooks
doc_to_text, process_results, options_problem = common.doc_to_text, common.process_results, common.options_problem
