"""Zero-vision SFT data: text-only conversations (no image or video anywhere) that teach the answer formats of the
evaluations and, as in Kimi K2.5's zero-vision SFT, answer questions about images through programmatic image
operations written in Python.

Kinds of conversation (drawn with these weights):
- `mc` (0.3): a 10-option multiple choice question of the synthetic world in one of MMLU-Pro's prompt layouts (the
  API prompt, the local prompt - the one the evaluation sends -, or just the question and options); the reply is a
  short chain of thought, the option holding its result ("The option 42 is (C).") and "The answer is (C).".
- `lookup` (0.25): the world's `lookup` drill: the options of such a question, then a request for the letters of 3
  to 6 of them; the reply finds each ("The option 42 is (C).").
- `number` (0.1): arithmetic (also divisions with one or two decimals), and word problems on the world's facts,
  with MathVista's hints or none; the reply ends "The answer is 42.".
- `fact` (0.05): a question on the world's facts answered with the facts and "The answer is ...".
- `trace` (0.2): a question about an image that the model cannot see: the user describes the image in text (its
  size and the objects with their colours and pixel boxes, or the values printed on a chart, or the labelled sides
  of a rectangle) and asks the same question as the vision task. Half of them also ask for Python
  (`CODE_REQUEST`): the reply writes a short Python snippet operating on the image file with PIL / numpy (colour
  masks, connected components, pixel reads) or on the read-off values, states what it prints and ends with the
  task's final answer. The snippet is not executed: the reply states its result, which is computed from the
  sample. The other half do not ask for code and get the vision task's own short reply (a sentence of reasoning
  and the final answer, the format pre-training taught for real images), so a question that does not ask for code
  (an evaluation prompt) keeps that short format.
- `page` (0.1): a web page described in words (header, sections with their colours and heights, button) and the
  request to write its HTML; the reply is the page's HTML exactly as the video-to-website targets write it, so the
  answer format of that task survives the text-only SFT.
Some conversations start with a system prompt (no loss on it).
"""

from __future__ import annotations

import random
from typing import Any

from ..errors import ConfigError
from ..tokenization.chat_template import KIMI_DEFAULT_SYSTEM_PROMPT
from .screencast import page_html, random_page
from .world import (
    COLORS,
    LETTERS,
    MATHVISTA_HINTS,
    WORLD,
    Sample,
    make_sample,
    sample_rng,
)

KINDS: tuple[tuple[str, float], ...] = (("mc", 0.3), ("lookup", 0.25), ("number", 0.1), ("fact", 0.05),
                                        ("trace", 0.2), ("page", 0.1))
CODE_REQUEST = "Solve it with Python on image.png."
"""The request that asks for a programmatic trace (the other described-image questions get a direct reply)."""
CODE_FRACTION = 0.5

_MMLU_API = ('The following are multiple choice questions (with answers) about {category}. Think step by step and '
             'then output the answer in the format of "The answer is (X)" at the end.\n\n')
_MMLU_LOCAL = ('The following are multiple choice questions (with answers) about {category}. Think step by step and '
               'then finish your answer with "the answer is (X)" where X is the correct letter choice.\n\n\n\n')


def _mc(rng: random.Random) -> tuple[str, str]:
    s = make_sample("mc", rng)
    stem, options, category = s.meta["stem"], s.choices or [], s.meta["category"]
    layout = rng.choice(("api", "local", "local", "plain"))  # the local layout is the evaluation prompt
    if layout == "api":
        opts = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
        prompt = _MMLU_API.format(category=category) + f"Question: {stem}\nOptions: {opts}\n"
        prompt += "Answer: Let's think step by step."
    elif layout == "local":
        opts = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
        prompt = _MMLU_LOCAL.format(category=category) + f"Question:\n{stem}\nOptions:\n{opts}\n"
        prompt += "Answer: Let's think step by step."
    else:
        prompt = s.question
    return prompt, s.response


def _hinted(rng: random.Random, question: str, precision: int | None) -> str:
    if rng.random() < 0.5:
        return question
    hint = MATHVISTA_HINTS["integer"] if precision is None else MATHVISTA_HINTS[precision]
    return f"Hint: {hint}\nQuestion: {question}"


def _number(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(("arithmetic", "arithmetic", "division", "legs"))
    if kind == "arithmetic":
        s = make_sample("arithmetic", rng)
        return _hinted(rng, s.question, None), s.response
    if kind == "division":
        precision = rng.choice((1, 2))
        a, b = rng.randint(1, 99), rng.choice((2, 4, 5, 8))
        value = str(round(a / b, precision))
        return _hinted(rng, f"What is {a} / {b}?", precision), f"We compute {a} / {b} = {value}. The answer is {value}."
    x, y = rng.sample(WORLD, 2)
    question = f"{x.name} has {x.legs} legs and {y.name} has {y.legs} legs. How many legs do they have together?"
    total = x.legs + y.legs
    return _hinted(rng, question, None), f"We compute {x.legs} + {y.legs} = {total}. The answer is {total}."


def _fact(rng: random.Random) -> tuple[str, str]:
    s = make_sample("fact", rng)
    return s.question, s.response


# ------------------------------------------------------------------------------------------------ zero-vision traces
_LOAD = 'import numpy as np\nfrom PIL import Image\nimg = np.asarray(Image.open("image.png"), int)\n'


def _describe_objects(sample: Sample, objects: list[dict[str, Any]], *, colors: bool = True) -> str:
    w, h = sample.image.size if sample.image is not None else (0, 0)
    parts = [(f"{o['color']} " if colors else "") + f"{o['shape']} [{','.join(map(str, o['box']))}]"
             for o in objects]
    return f"image.png is {w}x{h} and shows: " + "; ".join(parts) + "."


def _mask_line(color: str) -> str:
    r, g, b = COLORS[color]
    return f"from scipy import ndimage\nm = np.abs(img - [{r}, {g}, {b}]).sum(-1) < 60\n"


def _trace(rng: random.Random) -> tuple[str, str]:
    task = rng.choice(("count", "color", "grounding", "chart_bar", "chart_line", "visual_math"))
    s = make_sample(task, rng)
    m = s.meta
    if task == "count" or (task == "visual_math" and "objects" in m):
        objects = m["objects"]
        o = objects[0]
        description = _describe_objects(s, objects)
        code = _LOAD + _mask_line(o["color"]) + "print(ndimage.label(m)[1])\n"
        result = f"It prints {len(objects)}."
        intro = f"I count the {o['color']} regions."
    elif task == "color":
        o = m["objects"][0]
        x0, y0, x1, y1 = o["box"]
        description = _describe_objects(s, m["objects"], colors=False)
        code = _LOAD + f"print(img[{(y0 + y1) // 2}, {(x0 + x1) // 2}])\n"
        r, g, b = COLORS[o["color"]]
        result = f"It prints [{r} {g} {b}], which is {o['color']}."
        intro = f"I read the centre pixel of the {o['shape']}."
    elif task == "grounding":
        description = _describe_objects(s, m["objects"])
        target = next(o for o in m["objects"] if o["box"] == m["boxes"][0])
        code = (_LOAD + _mask_line(target["color"])
                + "print([[s[1].start, s[0].start, s[1].stop, s[0].stop] for s in "
                + "ndimage.find_objects(ndimage.label(m)[0])])\n")
        result = f"I keep the {target['shape']}s."
        intro = f"I find the boxes of the {target['color']} regions."
    elif "sides" in m:
        a, b = m["sides"]
        description = f"The image shows a rectangle whose sides are labelled {a} cm and {b} cm."
        expr = "2 * (a + b)" if m["unit"] == "cm" else "a * b"
        code = f"a, b = {a}, {b}\nprint({expr})\n"
        result = f"It prints {s.answer}."
        intro = "I compute it from the labelled sides."
    else:  # charts (chart_bar, chart_line and the bar kinds of visual_math)
        labels, values = m["labels"], m["values"]
        kind = "line chart" if task == "chart_line" else "bar chart"
        listing = ", ".join(f"{lab} = {v}" for lab, v in zip(labels, values))
        description = f"The image is a {kind} with the values {listing} printed on it."
        table = "values = {" + ", ".join(f'"{lab}": {v}' for lab, v in zip(labels, values)) + "}\n"
        if task in ("chart_bar", "chart_line"):
            key = labels[m["index"]]
            code, result = table + f'print(values["{key}"])\n', f"It prints {s.answer}."
        elif "pair" in m:
            keys = [labels[k] for k in m["pair"]]
            code = table + f'print(values["{keys[0]}"] + values["{keys[1]}"])\n'
            result = f"It prints {s.answer}."
        elif m.get("kind") == "bar_diff":
            code, result = table + "print(max(values.values()) - min(values.values()))\n", f"It prints {s.answer}."
        elif m.get("kind") == "bar_mean":
            code = table + f"print(round(sum(values.values()) / len(values), {m['precision']}))\n"
            result = f"It prints {s.answer}."
        else:
            top = labels[values.index(max(values))]
            code, result = table + "print(max(values, key=values.get))\n", f"It prints {top}."
        intro = "I put the printed values in a table."
    if rng.random() >= CODE_FRACTION:  # no code asked for: the vision task's own reply
        return f"{description}\n{s.question}", s.response
    final = s.response[s.response.rindex("The answer is"):]
    prompt = f"{description}\n{s.question}\n{CODE_REQUEST}"
    reply = f"{intro}\n```python\n{code}```\n{result} {final}"
    return prompt, reply


def _page(rng: random.Random) -> tuple[str, str]:
    spec = random_page(rng)
    sections = "; ".join(f"a {sec.color} section {sec.height}px tall with the heading '{sec.heading}' and the text "
                         f"'{sec.text}'" for sec in spec.sections)
    prompt = (f"A web page has a {spec.header_color} header {spec.header_height}px tall titled '{spec.title}', then "
              f"{sections}, then a {spec.button_color} button {spec.button_width}px wide labelled '{spec.button}'. "
              "Write the HTML of this web page.")
    return prompt, page_html(spec)


def _lookup(rng: random.Random) -> tuple[str, str]:
    s = make_sample("lookup", rng)
    return s.question, s.response


_MAKERS = {"mc": _mc, "lookup": _lookup, "number": _number, "fact": _fact, "trace": _trace, "page": _page}


def sft_conversation(rng: random.Random) -> list[dict[str, str]]:
    """One text-only conversation (see the module docstring), deterministic given the state of `rng`: an optional
    system message, a user message and an assistant reply, all with string content."""
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    prompt, reply = _MAKERS[kind](rng)
    messages = [{"role": "system", "content": KIMI_DEFAULT_SYSTEM_PROMPT}] if rng.random() < 0.25 else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def sft_conversations(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` zero-vision SFT conversations; conversation `i` depends only on `(seed, i)`."""
    if n < 0:
        raise ConfigError(f"n must be >= 0, got {n}.")
    return [sft_conversation(sample_rng(seed, i, "sft")) for i in range(n)]


__all__ = ["CODE_REQUEST", "KINDS", "sft_conversation", "sft_conversations"]
