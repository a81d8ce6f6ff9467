"""A deterministic synthetic world: text and vision tasks with short, verifiable answers, and exports of its samples
in MMLU-Pro's and MathVista's dataset schemas.

Everything is generated from a `random.Random`: the same seed gives the same samples, images included. The
vocabulary is deliberately small (10 colours, 4 shapes, 16 creatures, 10 towns, a few question templates) so that a
~1-2M-parameter model with a 2-3k-token BPE vocabulary can learn the tasks within minutes on a CPU.

The world has fixed facts (the same for every seed, see `WORLD`): 16 creatures, each with a colour, a home town and
a number of legs. `fact` samples state them in prose, `mc` samples ask about them (and about arithmetic and unit
conversions) as 10-option multiple choice questions in MMLU-Pro's format; `arithmetic` and `units` ask sums and
conversions free-form. `lookup` samples drill the step every
multiple-choice answer ends with, finding an option's letter from its value: the options of an `mc` question, then
the request for the letters of 3 to 6 of them, answered with one "The option 42 is (C)." sentence each (the phrase
`mc` responses use).

Tasks (`Sample.task`):

| task        | media | question (example)                                   | answer         | reward      |
|-------------|-------|------------------------------------------------------|----------------|-------------|
| arithmetic  | -     | What is 17 + 25?                                     | 42             | number      |
| units       | -     | How many minutes are in 6 hours?                     | 360            | number      |
| mc          | -     | What color is Bavo? + 10 options A-J                 | C              | choice      |
| fact        | -     | How many legs does Bavo have?                        | 6              | number/ocr  |
| lookup      | -     | 10 options + Which letters do red and 7 have?        | (C), (H)       | ocr         |
| count       | image | How many circles are in the image?                   | 4              | count       |
| color       | image | What color is the square?                            | red            | ocr         |
| swatch      | image | What color is the image? (the whole image one colour)| red            | ocr         |
| shape       | image | What shape is in the image?                          | triangle       | ocr         |
| chart_bar   | image | What is the value of the Elm bar?                    | 12             | number      |
| chart_line  | image | What is the value at x = 3?                          | 7              | number      |
| ocr         | image | What text is written in the image?                   | BAVO           | ocr         |
| grounding   | image | Where are the red circles? ...                       | [[3,4,20,21]]  | grounding   |
| visual_math | image | MathVista-style query (hint, question, choices)     | 8 / B          | number/choice|
| screencast  | video | Write the HTML of this web page.                     | the page HTML  | html        |
| page_color  | video | What color is the header of this web page?           | navy           | ocr         |
| page_swatch | video | What color is the web page? (every frame one colour) | red            | ocr         |

Splits: every sample is an item with a key (`item_key`: the wording of a question with its entity, a creature, an
expression or a unit conversion; a chart's labels and values, a rectangle's sides, a page, or an image's pixels); a
hash of the key puts 15% of the items in the held-out `eval` split, 10% in `val` and the rest in `train` (`split_of`).
`make_sample(task, rng, split)` draws until it gets an item of its split (default `train`), so every training draw
(pre-training, SFT, RL, the drill, tokenizer texts) avoids the items the proxies ask about (`mmlu_pro_rows` and
`mathvista_rows` draw from `eval`), by construction. The knowledge stays shared: a held-out question on a creature's
colour is stated in other sentences and asked in other wordings in training, as real benchmarks test knowledge
their test items do not teach; so, likewise, is a held-out arithmetic or conversion question's result ("How many
days are in 8 weeks?" held out, "Convert 8 weeks to days." in training).

Responses are short: a templated sentence of reasoning and a final "The answer is X." (multiple choice: the
reasoning, then the option holding the worked-out value, "The option 42 is (C).", then "The answer is (C)."), which
`kimi_vl.training.rewards` extracts; screencast responses are the HTML itself.

Images: RGB, native size with each side in 56..224 px (varied aspect ratios), light background. Boxes are
`[x0, y0, x1, y1]` pixel coordinates with exclusive ends (the object covers columns `x0 .. x1 - 1`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from ..errors import ConfigError
from .screencast import Screencast, make_screencast, page_colors

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (230, 200, 20),
    "purple": (130, 50, 170), "orange": (245, 130, 20), "pink": (240, 110, 180), "brown": (125, 75, 35),
    "gray": (125, 125, 125), "black": (20, 20, 20),
}
"""The world's colours (names and the RGB values objects are painted with)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
NAMES: tuple[str, ...] = ("Bavo", "Kiro", "Lumo", "Mira", "Noxa", "Pell", "Quin", "Rube", "Sela", "Tavi", "Umbo",
                          "Vexa", "Wren", "Yano", "Zeph", "Dara")
TOWNS: tuple[str, ...] = ("Ash", "Elm", "Fig", "Oak", "Yew", "Bay", "Cob", "Dew", "Ivy", "Sol")
"""Town names; also the labels of chart bars (three letters fit under a narrow bar)."""
LETTERS = "ABCDEFGHIJ"
WORLD_SEED = 20240601

TEXT_TASKS: tuple[str, ...] = ("arithmetic", "units", "mc", "fact", "lookup")
VISION_TASKS: tuple[str, ...] = ("count", "color", "swatch", "shape", "chart_bar", "chart_line", "ocr", "grounding",
                                 "visual_math")
VIDEO_TASKS: tuple[str, ...] = ("screencast", "page_color", "page_swatch")
CURRICULUM_TASKS: tuple[str, ...] = ("swatch", "page_color", "page_swatch")
"""Tasks drawn only when a mixture weights them by name: not in uniform task mixtures, not in RL."""
ALL_TASKS: tuple[str, ...] = TEXT_TASKS + VISION_TASKS + VIDEO_TASKS

MIN_SIDE, MAX_SIDE = 56, 224
SPLIT_SHARES = {"eval": 0.15, "val": 0.10}
"""Shares of the item keys in the held-out evaluation split and the validation split (the rest: train)."""
MAX_DRAWS = 10_000
FACT_QUESTIONS: dict[str, tuple[str, ...]] = {
    "color": ("What color is {name}?", "Which color does {name} have?", "{name} is a creature of which color?"),
    "town": ("Which town is {name} from?", "Where does {name} live?", "{name} lives in which town?"),
    "legs": ("How many legs does {name} have?", "{name} has how many legs?", "On how many legs does {name} walk?"),
}
"""Wordings of the questions on the world's facts (each wording of each creature is one item)."""
ARITHMETIC_QUESTIONS: tuple[str, ...] = ("What is {expression}?", "How much is {expression}?", "Compute {expression}.")
UNIT_QUESTIONS: tuple[str, ...] = ("How many {small} are in {k} {big}?", "{k} {big} is how many {small}?",
                                   "Convert {k} {big} to {small}.")
"""Wordings of the arithmetic and unit-conversion questions: as with the facts, each wording of each expression or
conversion is one item, so a held-out question's result is still met in training under another wording."""
SCREENCAST_QUESTION = "Write the HTML of this web page."

# MathVista's hints (the official query construction), by answer format.
MATHVISTA_HINTS = {
    "multi_choice": "Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.",
    "integer": "Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, "
               "at the end.",
    1: "Please answer the question requiring a floating-point number with one decimal place and provide the final "
       "value, e.g., 1.2, 1.3, 1.4, at the end.",
    2: "Please answer the question requiring a floating-point number with two decimal places and provide the final "
       "value, e.g., 1.23, 1.34, 1.45, at the end.",
}


@dataclass
class Sample:
    """One task instance of the synthetic world.

    Attributes:
        task: one of `ALL_TASKS`.
        question: the user's text, without media placeholders (multiple choice: stem + options; visual_math: the
            MathVista query with its hint).
        answer: canonical short answer ("7", "B", "3.5", "HELLO", "[[x0,y0,x1,y1],...]", html); the option letter
            for multiple choice.
        response: a full target reply ending in the answer ("... The answer is (B)."; the HTML for screencasts).
        reward: how RL verifies it: "choice" | "number" | "count" | "ocr" | "grounding" | "html".
        image: the image (vision tasks), else None.
        video: the video (video tasks): a `Screencast`, or the frames of a `page_swatch`; else None.
        choices: option texts (multiple choice), else None.
        meta: task details, e.g. {"boxes": ..., "precision": 1, "unit": "cm", "category": ..., "stem": ...};
            multiple choice and arithmetic also name what the question asks about (`entity`: "8 weeks in days",
            "7 * 8", "Bavo's color"), which every wording of the question shares.
    """

    task: str
    question: str
    answer: str
    response: str
    reward: str
    image: Image.Image | None = None
    video: Screencast | list[Image.Image] | None = None
    choices: list[str] | None = None
    meta: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- the world facts
@dataclass(frozen=True)
class Creature:
    name: str
    color: str
    town: str
    legs: int


def _build_world() -> tuple[Creature, ...]:
    rng = random.Random(WORLD_SEED)
    colors = list(COLORS)
    return tuple(
        Creature(name, rng.choice(colors), rng.choice(TOWNS), rng.choice((2, 4, 6, 8, 10, 12))) for name in NAMES
    )


WORLD: tuple[Creature, ...] = _build_world()
"""The fixed facts of the world (independent of any seed)."""


def world_facts() -> list[str]:
    """Every fact of the world as one sentence each (what `fact` samples paraphrase)."""
    return [f"{c.name} is a {c.color} creature from {c.town} with {c.legs} legs." for c in WORLD]


# ---------------------------------------------------------------------------------------------------- helpers
def _plural(shape: str, n: int = 2) -> str:
    return shape if n == 1 else shape + "s"


@lru_cache(maxsize=32)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size)


def _canvas(w: int, h: int, rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    v = rng.randint(236, 255)
    image = Image.new("RGB", (w, h), (v, v, v))
    return image, ImageDraw.Draw(image)


def _size(rng: random.Random, lo: int = MIN_SIDE, hi: int = MAX_SIDE) -> tuple[int, int]:
    return rng.randint(lo, hi), rng.randint(lo, hi)


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: Sequence[int], color: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box[0], box[1], box[2] - 1, box[3] - 1  # PIL's boxes include their end pixel
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=color)
    elif shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=color)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=color)
    else:  # diamond
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=color)


def _place(rng: random.Random, w: int, h: int, n: int) -> list[list[int]]:
    """`n` non-overlapping square boxes inside a `w x h` image: one per cell of a grid of at least `n + 2` cells."""
    cell = min(w, h, 100)
    while cell > 12 and (w // cell) * (h // cell) < n + 2:
        cell -= 1
    cols, rows = w // cell, h // cell
    if cols * rows < n:
        raise ConfigError(f"cannot place {n} objects in a {w}x{h} image; use fewer objects or a larger image.")
    ox, oy = (w - cols * cell) // 2, (h - rows * cell) // 2
    boxes = []
    for c in rng.sample(range(cols * rows), n):
        s = rng.randint(max(8, cell // 2), max(8, cell * 4 // 5))
        x0 = ox + (c % cols) * cell + rng.randint(0, cell - s)
        y0 = oy + (c // cols) * cell + rng.randint(0, cell - s)
        boxes.append([x0, y0, x0 + s, y0 + s])
    return boxes


def _fmt_boxes(boxes: Sequence[Sequence[int]]) -> str:
    return "[" + ",".join("[" + ",".join(str(int(v)) for v in b) + "]" for b in boxes) + "]"


def _fmt_number(x: float, precision: int | None = None) -> str:
    """MathVista's normal form: `str(int)` for integers, `str(round(x, precision))` for floats."""
    if precision is None:
        return str(int(round(x)))
    return str(round(float(x), int(precision)))


def _options(rng: random.Random, correct: str, pool: Sequence[str], k: int = 10) -> tuple[list[str], int]:
    """`k` distinct options (the correct one included) from `pool`, shuffled; returns (options, correct index)."""
    others = [p for p in dict.fromkeys(pool) if p != correct]
    if len(others) < k - 1:
        raise ConfigError(f"need {k - 1} distractors for {correct!r}, the pool has {len(others)}.")
    options = rng.sample(others, k - 1) + [correct]
    rng.shuffle(options)
    return options, options.index(correct)


def _number_pool(rng: random.Random, value: int, lo: int = 0) -> list[str]:
    """Plausible wrong numbers near `value` (at least 9 distinct ones, all >= `lo`)."""
    span = max(10, abs(value) // 4)
    pool = {value + d for d in range(-span, span + 1) if value + d >= lo and d != 0}
    return [str(v) for v in sorted(pool)]


def option_lookup(value: str, letter: str) -> str:
    """The reasoning step of a multiple-choice response that finds the option holding the worked-out value:
    "The option 42 is (C)." The value comes right before its letter, so the letter is looked up from the value
    just written (the final "The answer is (C)." then repeats it)."""
    return f"The option {value} is ({letter})."


_OPTION_LOOKUP = re.compile(r"The option (.+?) is \(([A-J])\)\.")


def option_lookups(text: str) -> list[tuple[str, str]]:
    """The `(value, letter)` of every `option_lookup` step in `text`, in order."""
    return _OPTION_LOOKUP.findall(text)


def options_block(options: Sequence[str], letters: Sequence[str] = LETTERS) -> str:
    """MMLU-Pro's option list: `Options:\nA. ...\nB. ...` (no trailing newline); `letters[i]` heads option i."""
    return "Options:\n" + "\n".join(f"{letters[i]}. {o}" for i, o in enumerate(options))


def _mc_question(stem: str, options: Sequence[str]) -> str:
    return f"{stem}\n{options_block(options)}"


def mathvista_query(stem: str, *, question_type: str, answer_type: str, precision: int | None = None,
                    unit: str | None = None, choices: Sequence[str] | None = None) -> str:
    """MathVista's default zero-shot query: `Hint: ...\\nQuestion: ...[ (Unit: u)][\\nChoices:\\n(A) ...]`."""
    if question_type == "multi_choice":
        hint = MATHVISTA_HINTS["multi_choice"]
    elif answer_type == "float":
        hint = MATHVISTA_HINTS[int(precision or 1)]
    else:
        hint = MATHVISTA_HINTS["integer"]
    text = f"Hint: {hint}\nQuestion: {stem}"
    if unit:
        text += f" (Unit: {unit})"
    if choices:
        text += "\nChoices:\n" + "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(choices))
    return text


# ---------------------------------------------------------------------------------------------------- text tasks
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _arith_operands(rng: random.Random) -> tuple[int, str, int, int]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
    else:
        a, b = rng.randint(0, 60), rng.randint(0, 60)
        if op == "-" and b > a:
            a, b = b, a
    return a, op, b, _OPS[op](a, b)


def _arithmetic_question(rng: random.Random) -> tuple[str, str, int]:
    """`(question, expression, result)`: drawn operands asked in one of `ARITHMETIC_QUESTIONS`' wordings."""
    a, op, b, c = _arith_operands(rng)
    expression = f"{a} {op} {b}"
    return rng.choice(ARITHMETIC_QUESTIONS).format(expression=expression), expression, c


def _task_arithmetic(rng: random.Random) -> Sample:
    question, expression, c = _arithmetic_question(rng)
    return Sample("arithmetic", question, str(c), f"We compute {expression} = {c}. The answer is {c}.",
                  "number", meta={"entity": expression, "key": f"question:{question}"})


_UNITS = (("meters", "centimeters", 100), ("kilometers", "meters", 1000), ("hours", "minutes", 60),
          ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("days", "hours", 24), ("weeks", "days", 7),
          ("liters", "milliliters", 1000))


def _conversion(rng: random.Random, quantity: Callable[[random.Random], int]) -> tuple[str, str, str, int, int]:
    """`(question, cot, entity, k, factor)`: a drawn unit, `k = quantity(rng)` of it, asked in one of
    `UNIT_QUESTIONS`' wordings (drawn in that order); `cot` is the worked step the `mc` and `units` replies state,
    `factor` the unit's size in the smaller unit."""
    big, small, factor = rng.choice(_UNITS)
    k = quantity(rng)
    question = rng.choice(UNIT_QUESTIONS).format(small=small, k=k, big=big)
    cot = f"One of the {big} is {factor} {small}, so {k} {big} is {k} * {factor} = {k * factor} {small}."
    return question, cot, f"{k} {big} in {small}", k, factor


def _units_quantity(rng: random.Random) -> int:
    # Half the quantities are 2-9, as the `mc` conversions ask; half are 10-99, so that copying the question's
    # quantity, not recalling one met with its units and wording, is what lowers the loss on it.
    return rng.randint(2, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def _task_units(rng: random.Random) -> Sample:
    question, cot, entity, k, factor = _conversion(rng, _units_quantity)
    return Sample("units", question, str(k * factor), f"{cot} The answer is {k * factor}.", "number",
                  meta={"entity": entity, "key": f"question:{question}"})


def _task_mc(rng: random.Random) -> Sample:
    kind = rng.choice(("world", "world", "arithmetic", "units"))
    if kind == "arithmetic":
        stem, entity, c = _arithmetic_question(rng)
        correct, pool = str(c), _number_pool(rng, c)
        cot, category, src = f"We compute {entity} = {c}.", "math", "synthetic-arithmetic"
    elif kind == "units":
        stem, cot, entity, k, factor = _conversion(rng, lambda r: r.randint(2, 9))
        correct = str(k * factor)
        pool = [str(k * factor + d * factor // 10) for d in range(-12, 13) if d] + [str(k), str(factor)]
        pool = [p for p in pool if int(p) > 0]
        category, src = "engineering", "synthetic-units"
    else:
        c = rng.choice(WORLD)
        attr = rng.choice(("color", "town", "legs"))
        stem = rng.choice(FACT_QUESTIONS[attr]).format(name=c.name)
        if attr == "color":
            correct, pool = c.color, list(COLORS)
            cot = f"We know that {c.name} is a {c.color} creature."
        elif attr == "town":
            correct, pool = c.town, list(TOWNS)
            cot = f"We know that {c.name} is from {c.town}."
        else:
            correct, pool = str(c.legs), [str(i) for i in range(1, 15)]
            cot = f"We know that {c.name} has {c.legs} legs."
        category, src, entity = "other", "synthetic-world", f"{c.name}'s {attr}"
    key = f"question:{stem}"
    options, idx = _options(rng, correct, pool)
    letter = LETTERS[idx]
    cot = f"{cot} {option_lookup(correct, letter)}"
    return Sample("mc", _mc_question(stem, options), letter, f"{cot} The answer is ({letter}).", "choice",
                  choices=options, meta={"stem": stem, "entity": entity, "category": category, "src": src, "cot": cot,
                                         "key": key})


def _task_lookup(rng: random.Random) -> Sample:
    base = _task_mc(rng)
    options = base.choices or []
    picks = rng.sample(range(len(options)), rng.randint(3, 6))
    values = [options[i] for i in picks]
    stem = f"Which letters do the options {', '.join(values[:-1])} and {values[-1]} have?"
    answer = ", ".join(f"({LETTERS[i]})" for i in picks)
    steps = " ".join(option_lookup(options[i], LETTERS[i]) for i in picks)
    question = f"{options_block(options)}\n{stem}"
    return Sample("lookup", question, answer, f"{steps} The answer is {answer}.", "ocr", choices=options,
                  meta={"stem": stem, "category": base.meta["category"], "picks": picks, "key": base.meta["key"]})


def _task_fact(rng: random.Random) -> Sample:
    c = rng.choice(WORLD)
    sentences = [rng.choice((f"{c.name} is a {c.color} creature.", f"The creature {c.name} is {c.color}.")),
                 rng.choice((f"{c.name} lives in {c.town}.", f"{c.name} is from {c.town}.")),
                 rng.choice((f"{c.name} has {c.legs} legs.", f"{c.name} walks on {c.legs} legs."))]
    rng.shuffle(sentences)
    attr = rng.choice(("color", "town", "legs"))
    question = rng.choice(FACT_QUESTIONS[attr]).format(name=c.name)
    answer = {"color": c.color, "town": c.town, "legs": str(c.legs)}[attr]
    return Sample("fact", question, answer, " ".join(sentences) + f" The answer is {answer}.",
                  "number" if attr == "legs" else "ocr",
                  meta={"creature": c.name, "attribute": attr, "key": f"question:{question}"})


# ---------------------------------------------------------------------------------------------------- vision tasks
def _objects_image(rng: random.Random, specs: Sequence[tuple[str, str]], w: int, h: int
                   ) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Draw one object per (shape, color) of `specs`; returns the image and the objects with their boxes."""
    image, draw = _canvas(w, h, rng)
    boxes = _place(rng, w, h, len(specs))
    objects = []
    for (shape, color), box in zip(specs, boxes):
        _draw_shape(draw, shape, box, COLORS[color])
        objects.append({"shape": shape, "color": color, "box": box})
    return image, objects


def _task_count(rng: random.Random) -> Sample:
    n = rng.randint(1, 6)
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    image, objects = _objects_image(rng, [(shape, color)] * n, *_size(rng))
    return Sample("count", f"How many {_plural(shape)} are in the image?", str(n),
                  f"There {'is' if n == 1 else 'are'} {n} {color} {_plural(shape, n)}. The answer is {n}.", "count",
                  image=image, meta={"objects": objects, "count": n})


def _task_color(rng: random.Random) -> Sample:
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    image, objects = _objects_image(rng, [(shape, color)], *_size(rng))
    return Sample("color", f"What color is the {shape}?", color, f"The {shape} is {color}. The answer is {color}.",
                  "ocr", image=image, meta={"objects": objects})


def _task_swatch(rng: random.Random) -> Sample:
    """The whole image one colour: every image token carries the answer, so a language model learns to read image
    tokens from it in tens of steps, where a shape among background tokens takes hundreds (the pre-training
    curriculum of the tiny preset; see docs/RESULTS.md)."""
    color, (w, h) = rng.choice(list(COLORS)), _size(rng)
    return Sample("swatch", "What color is the image?", color, f"The image is {color}. The answer is {color}.", "ocr",
                  image=Image.new("RGB", (w, h), COLORS[color]), meta={"key": f"swatch:{color}:{w}x{h}"})


def _task_shape(rng: random.Random) -> Sample:
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    image, objects = _objects_image(rng, [(shape, color)], *_size(rng))
    return Sample("shape", "What shape is in the image?", shape, f"It is a {color} {shape}. The answer is {shape}.",
                  "ocr", image=image, meta={"objects": objects})


def _chart(rng: random.Random, kind: str, n: int, *, unique_max: bool = False
           ) -> tuple[Image.Image, list[str], list[int], int, int]:
    """A bar or line chart of `n` values in 1..20 with each value printed above its bar / point; returns the image,
    the x labels, the values, and the size."""
    w, h = rng.randint(max(112, 26 * n), MAX_SIDE), rng.randint(96, MAX_SIDE)
    image, draw = _canvas(w, h, rng)
    labels = rng.sample(TOWNS, n) if kind == "bar" else [str(i + 1) for i in range(n)]
    values = [rng.randint(1, 20) for _ in range(n)]
    if unique_max:
        top = max(values)
        keep = values.index(top)
        if top == 1:  # all bars at 1: lift the kept one (the others would drop to 0, an empty bar)
            values[keep] = top = 2
        values = [v if i == keep or v < top else top - 1 for i, v in enumerate(values)]
    font = _font(10)
    top, bottom, left = 16, h - 14, 6
    slot = (w - 2 * left) / n
    color = COLORS[rng.choice(("blue", "green", "red", "purple", "orange", "brown"))]
    draw.line([(left, bottom), (w - left, bottom)], fill=(0, 0, 0))
    points = []
    for i, (label, v) in enumerate(zip(labels, values)):
        cx = left + slot * (i + 0.5)
        y = bottom - (bottom - top) * v / 20
        if kind == "bar":
            half = max(3, slot * 0.3)
            draw.rectangle([cx - half, y, cx + half, bottom - 1], fill=color)
        points.append((cx, y))
        draw.text((cx, y - 2), str(v), fill=(0, 0, 0), font=font, anchor="mb")
        draw.text((cx, bottom + 2), label, fill=(0, 0, 0), font=font, anchor="mt")
    if kind == "line":
        draw.line(points, fill=color, width=2)
        for cx, y in points:
            draw.ellipse([cx - 2, y - 2, cx + 2, y + 2], fill=color)
    return image, labels, values, w, h


def _chart_key(kind: str, labels: Sequence[str], values: Sequence[int]) -> str:
    return f"chart:{kind}:" + ",".join(f"{label}={v}" for label, v in zip(labels, values))


def _task_chart_bar(rng: random.Random) -> Sample:
    image, labels, values, _, _ = _chart(rng, "bar", rng.randint(3, 5))
    i = rng.randrange(len(labels))
    return Sample("chart_bar", f"What is the value of the {labels[i]} bar?", str(values[i]),
                  f"The {labels[i]} bar shows {values[i]}. The answer is {values[i]}.", "number", image=image,
                  meta={"labels": labels, "values": values, "index": i, "key": _chart_key("bar", labels, values)})


def _task_chart_line(rng: random.Random) -> Sample:
    image, labels, values, _, _ = _chart(rng, "line", rng.randint(4, 6))
    i = rng.randrange(len(labels))
    return Sample("chart_line", f"What is the value at x = {labels[i]}?", str(values[i]),
                  f"At x = {labels[i]} the line shows {values[i]}. The answer is {values[i]}.", "number",
                  image=image, meta={"labels": labels, "values": values, "index": i,
                                     "key": _chart_key("line", labels, values)})


_OCR_WORDS = tuple(w.upper() for w in NAMES + TOWNS + tuple(COLORS) + SHAPES)


def _task_ocr(rng: random.Random) -> Sample:
    text = " ".join(rng.sample(_OCR_WORDS, rng.choice((1, 1, 2))))
    font = _font(rng.randint(12, 22))
    x0, y0, x1, y1 = font.getbbox(text)
    tw, th = x1 - x0, y1 - y0
    w = min(MAX_SIDE, max(MIN_SIDE, tw + 8 + rng.randint(0, 60)))
    h = min(MAX_SIDE, max(MIN_SIDE, th + 8 + rng.randint(0, 60)))
    if tw + 4 > w:  # a long pair of words in a large font: fall back to one word
        text = text.split()[0]
        tw = font.getbbox(text)[2] - font.getbbox(text)[0]
        w = min(MAX_SIDE, max(w, tw + 8))
    image, draw = _canvas(w, h, rng)
    ink = COLORS[rng.choice(("black", "blue", "red", "green", "purple", "brown"))]
    px, py = rng.randint(2, max(2, w - tw - 2)), rng.randint(2, max(2, h - th - 2))
    draw.text((px - x0, py - y0), text, fill=ink, font=font)
    return Sample("ocr", "What text is written in the image?", text, f"The text reads {text}. The answer is {text}.",
                  "ocr", image=image, meta={"text": text})


def _task_grounding(rng: random.Random) -> Sample:
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    specs = [(shape, color)] * rng.randint(1, 3)
    for _ in range(rng.randint(0, 2)):  # distractors differ in shape or colour
        if rng.random() < 0.5:
            specs.append((rng.choice([s for s in SHAPES if s != shape]), color))
        else:
            specs.append((shape, rng.choice([c for c in COLORS if c != color])))
    image, objects = _objects_image(rng, specs, *_size(rng))
    boxes = sorted(o["box"] for o in objects if o["shape"] == shape and o["color"] == color)
    answer = _fmt_boxes(boxes)
    return Sample("grounding", f"Where are the {color} {_plural(shape)}? Give each box as [x0,y0,x1,y1] in pixels.",
                  answer, f"The answer is {answer}.", "grounding", image=image,
                  meta={"boxes": boxes, "objects": objects})


def _task_visual_math(rng: random.Random) -> Sample:
    kind = rng.choice(("bar_sum", "bar_diff", "bar_mean", "bar_max", "rect", "count_free", "count_mc"))
    precision: int | None = None
    unit: str | None = None
    choices: list[str] | None = None
    extra: dict[str, Any] = {}
    if kind.startswith("bar"):
        image, labels, values, w, h = _chart(rng, "bar", rng.randint(3, 5), unique_max=kind == "bar_max")
        extra.update(labels=labels, values=values, key=_chart_key("bar", labels, values))
        listing = ", ".join(f"{label} = {v}" for label, v in zip(labels, values))
        context, task, category = "bar chart", "figure question answering", "math-targeted-vqa"
        if kind == "bar_sum":
            i, j = rng.sample(range(len(labels)), 2)
            stem = f"What is the sum of the {labels[i]} and {labels[j]} bars?"
            value = values[i] + values[j]
            extra["pair"] = [i, j]
            cot = f"The bars show {listing}. {values[i]} + {values[j]} = {value}."
            skills = ["arithmetic reasoning", "statistical reasoning"]
        elif kind == "bar_diff":
            stem = "What is the difference between the largest and the smallest bar?"
            value = max(values) - min(values)
            cot = f"The bars show {listing}. {max(values)} - {min(values)} = {value}."
            skills = ["arithmetic reasoning", "statistical reasoning"]
        elif kind == "bar_mean":
            precision = rng.choice((1, 2))
            stem = "What is the average value of the bars?"
            value = sum(values) / len(values)
            cot = f"The bars show {listing}. {sum(values)} / {len(values)} = {_fmt_number(value, precision)}."
            skills = ["statistical reasoning"]
        else:
            stem = "Which bar has the largest value?"
            choices = list(labels)
            value = labels[values.index(max(values))]
            cot = f"The bars show {listing}. The largest is {value}."
            skills = ["statistical reasoning"]
    elif kind == "rect":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        image, w, h = _rectangle_image(rng, a, b)
        extra.update(sides=[a, b], key=f"rect:{a}:{b}")
        context, task, category = "geometry diagram", "geometry problem solving", "math-targeted-vqa"
        if rng.random() < 0.5:
            stem, unit, value = "What is the perimeter of the rectangle?", "cm", 2 * (a + b)
            cot = f"The sides are {a} cm and {b} cm. 2 * ({a} + {b}) = {value}."
        else:
            stem, unit, value = "What is the area of the rectangle?", "cm^2", a * b
            cot = f"The sides are {a} cm and {b} cm. {a} * {b} = {value}."
        skills = ["geometry reasoning", "arithmetic reasoning"]
    else:
        n = rng.randint(1, 6)
        shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        w, h = _size(rng)
        image, objects = _objects_image(rng, [(shape, color)] * n, w, h)
        extra["objects"] = objects
        context, task, category = "synthetic scene", "visual question answering", "general-vqa"
        stem = f"How many {_plural(shape)} are there?"
        cot = f"There {'is' if n == 1 else 'are'} {n} {color} {_plural(shape, n)}."
        skills = ["arithmetic reasoning"]
        value = n
        if kind == "count_mc":
            pool = [str(k) for k in range(1, 10) if k != n]
            choices = rng.sample(pool, 3) + [str(n)]
            rng.shuffle(choices)
            value = str(n)

    if choices is not None:
        question_type, answer_type = "multi_choice", "text"
        letter = LETTERS[choices.index(str(value))]
        answer, final = letter, f"({letter})"
        cot = f"{cot} {option_lookup(str(value), letter)}"
    else:
        question_type = "free_form"
        answer_type = "float" if precision is not None else "integer"
        answer = final = _fmt_number(value, precision)
    query = mathvista_query(stem, question_type=question_type, answer_type=answer_type, precision=precision,
                            unit=unit, choices=choices)
    meta = {"stem": stem, "question_type": question_type, "answer_type": answer_type, "precision": precision,
            "unit": unit, "category": category, "task": task, "context": context, "skills": skills,
            "grade": "elementary school" if kind.startswith("count") else "daily life", "kind": kind,
            "img_width": w, "img_height": h, **extra}
    return Sample("visual_math", query, answer, f"{cot} The answer is {final}.",
                  "choice" if choices is not None else "number", image=image, choices=choices, meta=meta)


def _rectangle_image(rng: random.Random, a: int, b: int) -> tuple[Image.Image, int, int]:
    """A rectangle drawn to scale (a x b cm) with its two side lengths written next to it."""
    w, h = _size(rng, 96)
    image, draw = _canvas(w, h, rng)
    font = _font(10)
    side = font.getlength(f"{b} cm") + 3  # the right-hand label must fit inside the canvas
    scale = min((w - 12 - side) / a, (h - 30) / b)
    rw, rh = max(8, int(a * scale)), max(8, int(b * scale))
    x0, y0 = int(w - rw - side) // 2, (h - rh) // 2
    draw.rectangle([x0, y0, x0 + rw, y0 + rh], outline=(0, 0, 0), width=2)
    draw.text((x0 + rw / 2, y0 - 2), f"{a} cm", fill=(0, 0, 0), font=font, anchor="mb")
    draw.text((x0 + rw + 3, y0 + rh / 2), f"{b} cm", fill=(0, 0, 0), font=font, anchor="lm")
    return image, w, h


def _task_screencast(rng: random.Random) -> Sample:
    video = make_screencast(rng)
    return Sample("screencast", SCREENCAST_QUESTION, video.html, video.html, "html", video=video,
                  meta={"fps": video.fps, "num_frames": len(video.frames)})


PAGE_ELEMENTS = ("header", "first section", "second section", "button")
"""The elements a `page_color` question asks about, in page order (`page_colors`: header, sections, button)."""


def _task_page_color(rng: random.Random) -> Sample:
    """The background colour of one element of a screencast's page, in one short reply: the colours the page's HTML
    states, asked one at a time (a video counterpart of `color`; the item is the page, as for `screencast`)."""
    video = make_screencast(rng)
    element = rng.choice(PAGE_ELEMENTS)
    color = dict(zip(PAGE_ELEMENTS, page_colors(video.spec), strict=True))[element]
    return Sample("page_color", f"What color is the {element} of this web page?", color,
                  f"The {element} is {color}. The answer is {color}.", "ocr", video=video,
                  meta={"element": element, "fps": video.fps, "num_frames": len(video.frames)})


PAGE_SWATCH_WIDTHS = (128, 144, 160, 176, 192)
"""Frame widths of `page_swatch` videos (height 3/4 of the width; the screencasts' frames are 160 x 120)."""


def _task_page_swatch(rng: random.Random) -> Sample:
    """A video whose every frame is one colour (8 frames): the video counterpart of `swatch`. Every video token
    carries the answer, so the language model learns to read video tokens from it before it reads an element's colour
    in a screencast (`page_color`; docs/RESULTS.md). The item is the colour at its frame size."""
    color, width = rng.choice(list(COLORS)), rng.choice(PAGE_SWATCH_WIDTHS)
    frames = [Image.new("RGB", (width, width * 3 // 4), COLORS[color])] * 8
    return Sample("page_swatch", "What color is the web page?", color, f"The page is {color}. The answer is {color}.",
                  "ocr", video=frames, meta={"key": f"page_swatch:{color}:{width}", "num_frames": len(frames)})


_TASKS = {
    "arithmetic": _task_arithmetic, "units": _task_units, "mc": _task_mc, "fact": _task_fact, "lookup": _task_lookup,
    "count": _task_count, "color": _task_color, "swatch": _task_swatch, "shape": _task_shape,
    "chart_bar": _task_chart_bar, "chart_line": _task_chart_line, "ocr": _task_ocr, "grounding": _task_grounding,
    "visual_math": _task_visual_math, "screencast": _task_screencast, "page_color": _task_page_color,
    "page_swatch": _task_page_swatch,
}


# ---------------------------------------------------------------------------------------------------- splits
def item_key(sample: Sample) -> str:
    """What identifies a sample as an item (its split follows from it): the question's text for the world's facts,
    arithmetic and unit conversions (`question:What color is Bavo?`, `question:Compute 8 * 7.`), the labels and
    values of a chart (`chart:bar:...`: the same chart values whatever the rendering or the question), the sides of a
    rectangle, the page of a screencast, and the pixels of any other image."""
    if "key" in sample.meta:
        return sample.meta["key"]
    if sample.video is not None:
        return "page:" + hashlib.sha1(sample.video.html.encode()).hexdigest()
    if sample.image is not None:
        return f"image:{sample.task}:" + hashlib.sha1(sample.image.tobytes()).hexdigest()
    raise ConfigError(f"a {sample.task} sample has no item key; give its generator a meta['key'].")


def split_of(key: str) -> str:
    """The split of an item key: a hash of it puts `SPLIT_SHARES["eval"]` of the keys in `eval`, the next
    `SPLIT_SHARES["val"]` in `val`, the rest in `train`."""
    u = int(hashlib.sha1(key.encode()).hexdigest()[:12], 16) / float(1 << 48)
    if u < SPLIT_SHARES["eval"]:
        return "eval"
    return "val" if u < SPLIT_SHARES["eval"] + SPLIT_SHARES["val"] else "train"


# ---------------------------------------------------------------------------------------------------- public API
def make_sample(task: str, rng: random.Random, split: str = "train") -> Sample:
    """One sample of `task` (one of `ALL_TASKS`) from `split` ("train", "val" or "eval"): samples are drawn from
    `rng` until one's item key falls in the split, so the splits share no item (see the module docstring);
    deterministic given the state of `rng`."""
    if task not in _TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of {', '.join(ALL_TASKS)}.")
    if split not in SPLIT_SHARES and split != "train":
        raise ConfigError(f"unknown split {split!r}; choose train, val or eval.")
    for _ in range(MAX_DRAWS):
        sample = _TASKS[task](rng)
        if split_of(item_key(sample)) == split:
            return sample
    raise ConfigError(f"no {task} sample of the {split} split in {MAX_DRAWS} draws; its item space is too small.")


def sample_rng(seed: int, index: int, namespace: str = "world") -> random.Random:
    """The random generator of item `index` of a stream seeded with `seed` (independent of every other item)."""
    return random.Random(f"{namespace}:{int(seed)}:{int(index)}")


def make_samples(tasks: Sequence[str], n: int, seed: int, split: str = "train") -> list[Sample]:
    """`n` samples of `split` cycling through `tasks` (sample `i` has task `tasks[i % len(tasks)]`). Sample `i`
    depends only on `(seed, i, its task, split)`, so a longer list extends a shorter one."""
    if isinstance(tasks, str):
        tasks = (tasks,)
    if not tasks:
        raise ConfigError(f"tasks is empty; pass some of {', '.join(ALL_TASKS)}.")
    for t in tasks:
        if t not in _TASKS:
            raise ConfigError(f"unknown task {t!r}; choose among {', '.join(ALL_TASKS)}.")
    return [make_sample(tasks[i % len(tasks)], sample_rng(seed, i), split) for i in range(n)]


def mmlu_pro_rows(n: int, seed: int, split: str = "eval") -> list[dict]:
    """`n` synthetic multiple-choice questions of `split` (default the held-out `eval` items) as MMLU-Pro rows.

    Fields and types as in `TIGER-Lab/MMLU-Pro`: `question_id` (int), `question` (str, the stem), `options`
    (list of 10 str), `answer` (letter A-J), `answer_index` (int), `cot_content` (str, "A: Let's think step by
    step. ... The answer is (X)."), `category` (str: "math", "engineering" or "other"), `src` (str).
    """
    rows = []
    for i, s in enumerate(make_samples(("mc",), n, seed, split)):
        idx = LETTERS.index(s.answer)
        rows.append({
            "question_id": i,
            "question": s.meta["stem"],
            "options": list(s.choices or []),
            "answer": s.answer,
            "answer_index": idx,
            "cot_content": f"A: Let's think step by step. {s.meta['cot']} The answer is ({s.answer}).",
            "category": s.meta["category"],
            "src": s.meta["src"],
        })
    return rows


def mathvista_rows(n: int, seed: int, image_dir: str | Path, split: str = "eval") -> dict[str, dict]:
    """`n` synthetic visual-math problems of `split` (default the held-out `eval` items) as MathVista testmini rows,
    keyed by `pid` ("1" .. "n").

    Each image is written to `image_dir / row["image"]` (`"images/<pid>.png"`), so `image_dir` plays the role of the
    dataset root. Fields and types as in MathVista's `testmini.json`: `question` (the bare question), `image`,
    `choices` (list of str or None), `unit` (str or None), `precision` (int for floats, else None), `answer` (str;
    the choice text for multi_choice), `question_type`, `answer_type`, `pid`, `metadata` (split, language,
    img_width, img_height, source, category, task, context, grade, skills). The `query` field is not written (the
    evaluation builds it; `Sample.question` of visual_math samples holds the same default query).
    """
    root = Path(image_dir)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for i, s in enumerate(make_samples(("visual_math",), n, seed, split)):
        pid = str(i + 1)
        rel = f"images/{pid}.png"
        assert s.image is not None
        s.image.save(root / rel)
        m = s.meta
        answer = s.choices[LETTERS.index(s.answer)] if s.choices else s.answer
        rows[pid] = {
            "question": m["stem"],
            "image": rel,
            "choices": list(s.choices) if s.choices else None,
            "unit": m["unit"],
            "precision": m["precision"],
            "answer": answer,
            "question_type": m["question_type"],
            "answer_type": m["answer_type"],
            "pid": pid,
            "metadata": {
                "split": "testmini",
                "language": "english",
                "img_width": s.image.width,
                "img_height": s.image.height,
                "source": "kimi-vl-synthetic",
                "category": m["category"],
                "task": m["task"],
                "context": m["context"],
                "grade": m["grade"],
                "skills": list(m["skills"]),
            },
        }
    return rows


def sample_text(sample: Sample) -> str:
    """The sample as plain text (pre-training form): MMLU-Pro's `Question: ... Answer: Let's think step by step.`
    layout for multiple choice (and option lookups), `Question: ...\\nAnswer: ...` otherwise (visual_math: without
    MathVista's hint)."""
    if sample.task in ("mc", "lookup"):
        return f"Question:\n{sample.question}\nAnswer: Let's think step by step. {sample.response}"
    if sample.task == "visual_math":  # the question without MathVista's hint, which the chat form keeps
        m = sample.meta
        question = m["stem"] + (f" (Unit: {m['unit']})" if m.get("unit") else "")
        if sample.choices:
            question += "\nChoices:\n" + "\n".join(f"({LETTERS[i]}) {c}" for i, c in enumerate(sample.choices))
        return f"Question: {question}\nAnswer: {sample.response}"
    return f"Question: {sample.question}\nAnswer: {sample.response}"


__all__ = [
    "ALL_TASKS", "COLORS", "CURRICULUM_TASKS", "LETTERS", "MATHVISTA_HINTS", "NAMES", "PAGE_ELEMENTS",
    "SCREENCAST_QUESTION", "SHAPES",
    "TEXT_TASKS", "TOWNS", "VIDEO_TASKS", "VISION_TASKS", "WORLD", "Creature", "Sample", "make_sample", "make_samples",
    "mathvista_query", "mathvista_rows", "mmlu_pro_rows", "option_lookup", "option_lookups", "options_block",
    "sample_rng", "sample_text",
    "world_facts", "FACT_QUESTIONS", "ARITHMETIC_QUESTIONS", "UNIT_QUESTIONS", "SPLIT_SHARES", "item_key", "split_of",
]
