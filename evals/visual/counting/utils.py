"""Counting: n shapes of one kind and colour (n from 1 to 14) among up to 4 of other kinds or colours, none touching,
on a 320 x 320 image; the answer is n. Difficulty: the count (the table's axis), the distractors. A blind answer
scores about one in len(COUNTS). Generated (evals/visual/common.py), never stored.
"""

import importlib.util
from pathlib import Path

SUITE = "counting"
AXIS = "count"  # the report's table: accuracy per count
COUNTS = (1, 2, 3, 5, 7, 10, 14)
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (210, 40, 40), "blue": (40, 80, 210), "green": (30, 150, 60)}
SIZE, RADIUS = 320, 14


def _common():
    spec = importlib.util.spec_from_file_location("visual_common", Path(__file__).resolve().parents[1] / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _common()


def _places(rng, n: int) -> list[list[int]]:
    """n centres at least 2.5 radii apart, inside the image (seeded rejection sampling)."""
    places: list[list[int]] = []
    while len(places) < n:
        x, y = rng.randint(RADIUS + 4, SIZE - RADIUS - 4), rng.randint(RADIUS + 4, SIZE - RADIUS - 4)
        if all((x - a) ** 2 + (y - b) ** 2 >= (2.5 * RADIUS) ** 2 for a, b in places):
            places.append([x, y])
    return places


def make(rng, index: int) -> dict:
    n = COUNTS[index % len(COUNTS)]
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    others = [(s, c) for s in SHAPES for c in COLOURS if (s, c) != (shape, colour)]
    distractors = rng.randint(0, 4)
    kinds = [(shape, colour)] * n + [rng.choice(others) for _ in range(distractors)]
    objects = [[s, c, x, y] for (s, c), (x, y) in zip(kinds, _places(rng, len(kinds)))]
    rng.shuffle(objects)
    return {"question": f"How many {colour} {shape}s are in the image?", "answer": n, "answer_type": "number",
            "difficulty": {"count": n, "distractors": distractors, "width": SIZE, "height": SIZE},
            "spec": {"objects": objects}}


def render(spec: dict):
    image, draw = common.canvas(SIZE, SIZE)
    for shape, colour, x, y in spec["objects"]:
        box, fill = [x - RADIUS, y - RADIUS, x + RADIUS, y + RADIUS], COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x, y - RADIUS), (x - RADIUS, y + RADIUS), (x + RADIUS, y + RADIUS)], fill=fill)
    return image


(load, doc_to_image, doc_to_target, summarize, table_from_lines,
 bench_images) = common.functions(SUITE, make, render, AXIS)  # lm-eval's functions and the suite's hooks
doc_to_text, process_results, options_problem = common.doc_to_text, common.process_results, common.options_problem
