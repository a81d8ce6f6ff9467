"""The synthetic world: determinism, image variety, answers consistent with the pictures, dataset schemas."""

import json
import re

import numpy as np
import pytest
from PIL import Image

from kimi_vl.data.screencast import Screencast
from kimi_vl.data.world import (
    ALL_TASKS,
    COLORS,
    LETTERS,
    MATHVISTA_HINTS,
    PAGE_ELEMENTS,
    TEXT_TASKS,
    VIDEO_TASKS,
    VISION_TASKS,
    WORLD,
    item_key,
    make_sample,
    make_samples,
    mathvista_rows,
    mmlu_pro_rows,
    option_lookup,
    option_lookups,
    sample_rng,
)
from kimi_vl.demos.video2web import page_fields
from kimi_vl.errors import ConfigError
from kimi_vl.training.rewards import reward


def _fingerprint(s) -> tuple:
    media = s.image.tobytes() if s.image is not None else b""
    if s.video is not None:
        frames = s.video.frames if isinstance(s.video, Screencast) else s.video  # `page_swatch`: a list of frames
        media += b"".join(f.tobytes() for f in frames)
    return (s.task, s.question, s.answer, s.response, s.reward, s.choices, json.dumps(s.meta, sort_keys=True), media)


@pytest.fixture(scope="module")
def samples():
    return make_samples(ALL_TASKS, 4 * len(ALL_TASKS), seed=3)


def test_deterministic_by_seed(samples):
    again = make_samples(ALL_TASKS, 4 * len(ALL_TASKS), seed=3)
    assert [_fingerprint(s) for s in again] == [_fingerprint(s) for s in samples]
    other = make_samples(ALL_TASKS, 4 * len(ALL_TASKS), seed=4)
    assert sum(_fingerprint(a) != _fingerprint(b) for a, b in zip(samples, other)) > len(samples) // 2
    # sample i depends on (seed, i) only: a shorter list is a prefix of a longer one
    assert [_fingerprint(s) for s in make_samples(ALL_TASKS, 5, seed=3)] == [_fingerprint(s) for s in samples[:5]]


def test_round_robin_tasks(samples):
    assert [s.task for s in samples] == [ALL_TASKS[i % len(ALL_TASKS)] for i in range(len(samples))]


def test_unknown_task():
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        make_samples(["count", "nope"], 3, 0)
    with pytest.raises(ConfigError, match="unknown task"):
        make_sample("nope", sample_rng(0, 0))


def test_varied_native_resolutions():
    images = [s.image for s in make_samples(VISION_TASKS, 80, seed=0)]
    assert all(im is not None and im.mode == "RGB" for im in images)
    sizes = [im.size for im in images]
    assert all(56 <= w <= 224 and 56 <= h <= 224 for w, h in sizes), sizes
    assert len(set(sizes)) > 60
    ratios = [w / h for w, h in sizes]
    assert min(ratios) < 0.6 and max(ratios) > 1.6  # portrait and landscape
    assert min(min(s) for s in sizes) < 80 and max(max(s) for s in sizes) > 200


def test_every_target_response_earns_full_reward(samples):
    for s in samples:
        assert reward(s, s.response) == 1.0, (s.task, s.response, s.answer)


def test_text_samples_have_no_media(samples):
    for s in samples:
        if s.task in TEXT_TASKS:
            assert s.image is None and s.video is None
        elif s.task in VISION_TASKS:
            assert s.image is not None and s.video is None
        else:
            assert s.video is not None and s.image is None


def _center(image, box):
    x0, y0, x1, y1 = box
    return tuple(np.asarray(image)[(y0 + y1 - 1) // 2, (x0 + x1 - 1) // 2])


def test_count_and_color_match_the_pixels():
    for s in make_samples(("count", "color", "shape"), 45, seed=1):
        objects = s.meta["objects"]
        for o in objects:
            assert _center(s.image, o["box"]) == COLORS[o["color"]]
        if s.task == "count":
            assert s.answer == str(len(objects)) and 1 <= len(objects) <= 6
        elif s.task == "color":
            assert s.answer == objects[0]["color"]
        else:
            assert s.answer == objects[0]["shape"]
    # the number of object pixels of that colour grows with the count
    s = make_samples(("count",), 30, seed=2)
    area = [int((np.abs(np.asarray(x.image).astype(int) - COLORS[x.meta["objects"][0]["color"]]).sum(-1) == 0).sum())
            for x in s]
    assert all(a > 20 * len(x.meta["objects"]) for a, x in zip(area, s))


def test_swatch_is_one_colour_and_stays_out_of_rl():
    from kimi_vl.training.stages import RL_FAMILIES

    samples = make_samples(("swatch",), 20, seed=0)
    for s in samples:
        pixels = np.asarray(s.image).reshape(-1, 3)
        assert (pixels == COLORS[s.answer]).all() and s.response.endswith(f"The answer is {s.answer}.")
    assert len({s.answer for s in samples}) > 5 and len({s.image.size for s in samples}) == 20
    assert "swatch" in VISION_TASKS and "swatch" not in RL_FAMILIES["vision"]


def test_page_color_asks_one_colour_of_the_page_and_stays_out_of_rl():
    """`page_color` asks the background colour of one element of a screencast's page (the colour its HTML states);
    its item is the page, so a page's colour questions share the split of its `screencast` sample."""
    from kimi_vl.training.stages import RL_FAMILIES

    samples = make_samples(("page_color",), 24, seed=0)
    for s in samples:
        element = s.meta["element"]
        assert s.question == f"What color is the {element} of this web page?" and s.reward == "ocr"
        assert f"background:{s.answer}" in s.video.html and s.response.endswith(f"The answer is {s.answer}.")
        stated = page_fields(s.video.html)  # the colours the page's HTML states
        fields = dict(zip(PAGE_ELEMENTS, ("header", "section 1", "section 2", "button"), strict=True))
        assert s.answer == stated[f"{fields[element]} color"]
    assert {s.meta["element"] for s in samples} == set(PAGE_ELEMENTS)
    page = make_sample("screencast", sample_rng(0, 7))
    same_page = make_sample("page_color", sample_rng(0, 7))
    assert item_key(page) == item_key(same_page)
    assert "page_color" in VIDEO_TASKS and "page_color" not in RL_FAMILIES["vision"] + RL_FAMILIES["text"]


def test_page_swatch_is_a_one_colour_video_with_a_training_item_of_every_colour():
    """`page_swatch`: eight frames of one colour at a screencast-like size, the colour as the answer; a curriculum
    task (out of uniform mixtures and RL) whose items (colour x frame width) give every colour a training item."""
    from kimi_vl.data.world import CURRICULUM_TASKS, PAGE_SWATCH_WIDTHS, split_of
    from kimi_vl.training.stages import RL_FAMILIES

    samples = make_samples(("page_swatch",), 40, seed=0)
    for s in samples:
        assert len(s.video) == 8 and len({f.size for f in s.video}) == 1
        width, height = s.video[0].size
        assert width in PAGE_SWATCH_WIDTHS and height == width * 3 // 4
        assert all((np.asarray(f).reshape(-1, 3) == COLORS[s.answer]).all() for f in s.video)
        assert s.question == "What color is the web page?" and s.response.endswith(f"The answer is {s.answer}.")
        assert split_of(item_key(s)) == "train"
    assert len({s.answer for s in samples}) > 5
    assert all(any(split_of(f"page_swatch:{c}:{w}") == "train" for w in PAGE_SWATCH_WIDTHS) for c in COLORS)
    assert "page_swatch" in VIDEO_TASKS and "page_swatch" in CURRICULUM_TASKS
    assert "page_swatch" not in RL_FAMILIES["vision"] + RL_FAMILIES["text"]


def test_grounding_boxes():
    for s in make_samples(("grounding",), 20, seed=0):
        boxes = json.loads(s.answer)
        assert boxes == s.meta["boxes"] and boxes == sorted(boxes)
        target = [o for o in s.meta["objects"] if o["box"] in boxes]
        assert len(target) == len(boxes) and len({(o["shape"], o["color"]) for o in target}) == 1
        w, h = s.image.size
        for x0, y0, x1, y1 in boxes:
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
            assert _center(s.image, [x0, y0, x1, y1]) == COLORS[target[0]["color"]]
        # the boxes do not overlap
        all_boxes = [o["box"] for o in s.meta["objects"]]
        for i, a in enumerate(all_boxes):
            for b in all_boxes[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def test_charts_and_ocr():
    for s in make_samples(("chart_bar", "chart_line", "ocr"), 30, seed=0):
        if s.task == "ocr":
            assert s.answer == s.meta["text"] and s.answer.isupper()
            ink = (np.asarray(s.image).astype(int).sum(-1) < 600).sum()
            assert ink > 10  # the text is drawn
        else:
            assert s.answer == str(s.meta["values"][s.meta["index"]])
            assert s.meta["labels"][s.meta["index"]] in s.question


def test_multiple_choice_format():
    for s in make_samples(("mc",), 30, seed=0):
        assert len(s.choices) == 10 and len(set(s.choices)) == 10
        assert s.answer in LETTERS and s.response.endswith(f"The answer is ({s.answer}).")
        lines = s.question.split("\n")
        assert lines[1] == "Options:" and lines[2:] == [f"{LETTERS[i]}. {c}" for i, c in enumerate(s.choices)]
    # the world facts do not depend on the seed
    for s in make_samples(("fact",), 20, seed=9):
        c = next(c for c in WORLD if c.name == s.meta["creature"])
        assert s.answer == str(getattr(c, s.meta["attribute"]))


def test_visual_math_meta():
    kinds = set()
    for s in make_samples(("visual_math",), 60, seed=0):
        m = s.meta
        kinds.add(m["kind"])
        assert s.question.startswith("Hint: ") and f"Question: {m['stem']}" in s.question
        if m["question_type"] == "multi_choice":
            assert s.choices and s.answer in LETTERS[: len(s.choices)] and m["answer_type"] == "text"
            assert MATHVISTA_HINTS["multi_choice"] in s.question
        else:
            assert s.choices is None
            if m["answer_type"] == "float":
                assert m["precision"] in (1, 2) and s.answer == str(round(float(s.answer), m["precision"]))
            else:
                assert m["answer_type"] == "integer" and m["precision"] is None and s.answer == str(int(s.answer))
    assert kinds == {"bar_sum", "bar_diff", "bar_mean", "bar_max", "rect", "count_free", "count_mc"}


def test_screencast_sample():
    s = make_sample("screencast", sample_rng(0, 0))
    assert isinstance(s.video, Screencast) and s.reward == "html"
    assert s.answer == s.response == s.video.html and s.question == "Write the HTML of this web page."
    assert len({f.size for f in s.video.frames}) == 1


# ------------------------------------------------------------------------------------------------------ schemas
def _types(rows, key):
    return {type(r[key]).__name__ for r in rows}


def test_mmlu_pro_rows_schema(benchmark_samples):
    real = [json.loads(line) for line in open(benchmark_samples / "mmlu_pro" / "llama2_7b_5shot_outputs_sample.jsonl")]
    rows = mmlu_pro_rows(40, seed=0)
    assert rows == mmlu_pro_rows(40, seed=0) and rows != mmlu_pro_rows(40, seed=1)
    expected = (set(real[0]) - {"generated_text", "pred"}) | {"cot_content"}  # the test dump has outputs, no CoT
    for r in rows:
        assert set(r) == expected
    for key in expected - {"cot_content"}:
        assert _types(rows, key) == _types(real, key), key
    assert _types(rows, "cot_content") == {"str"}
    real_categories = {r["category"] for r in real}
    for r in rows:
        assert len(r["options"]) == 10 and all(isinstance(o, str) for o in r["options"])
        assert r["answer"] == LETTERS[r["answer_index"]]
        assert r["category"] in real_categories
        assert r["cot_content"].startswith("A: Let's think step by step. ")
        assert re.search(r"answer is \(?([A-J])\)?", r["cot_content"]).group(1) == r["answer"]
    assert len({r["question_id"] for r in rows}) == len(rows)


def test_mathvista_rows_schema(benchmark_samples, tmp_path):
    real = json.loads((benchmark_samples / "mathvista" / "testmini.json").read_text())
    real_rows = list(real.values())
    rows = mathvista_rows(40, seed=0, image_dir=tmp_path)
    assert list(rows) == [str(i + 1) for i in range(40)]
    for pid, r in rows.items():
        assert set(r) == set(real_rows[0]) and r["pid"] == pid
        assert set(r["metadata"]) == set(real_rows[0]["metadata"])
        for key in r:
            assert type(r[key]).__name__ in _types(real_rows, key), key
        for key in r["metadata"]:
            assert type(r["metadata"][key]).__name__ in {type(x["metadata"][key]).__name__ for x in real_rows}, key
        assert all(isinstance(x, str) for x in r["metadata"]["skills"])
        assert r["question_type"] in ("multi_choice", "free_form")
        if r["question_type"] == "multi_choice":
            assert r["answer"] in r["choices"] and r["answer_type"] == "text" and r["precision"] is None
        else:
            assert r["choices"] is None and r["answer_type"] in ("integer", "float")
            assert (r["precision"] is not None) == (r["answer_type"] == "float")
        with Image.open(tmp_path / r["image"]) as im:
            assert im.size == (r["metadata"]["img_width"], r["metadata"]["img_height"])
    types = {r["question_type"] for r in rows.values()}
    assert types == {"multi_choice", "free_form"}
    again = mathvista_rows(40, seed=0, image_dir=tmp_path / "again")
    assert again == rows
    assert (tmp_path / "images" / "1.png").read_bytes() == (tmp_path / "again" / "images" / "1.png").read_bytes()


def test_multiple_choice_responses_look_the_answer_up_in_the_options():
    """The reasoning ends with the option holding the worked-out value, right before its letter."""
    for s in make_samples(("mc",), 40, seed=1):
        value = s.choices[LETTERS.index(s.answer)]
        assert s.response.endswith(f"The option {value} is ({s.answer}). The answer is ({s.answer}).")
        assert s.meta["cot"].endswith(option_lookup(value, s.answer))
        assert option_lookups(s.response) == [(value, s.answer)]  # the parser reads back what the writer wrote
    for s in make_samples(("visual_math",), 60, seed=1):
        if s.choices:
            assert f"{option_lookup(s.choices[LETTERS.index(s.answer)], s.answer)} The answer is ({s.answer})." \
                in s.response


def test_unit_conversions_state_the_questions_quantity():
    """`units` replies work the conversion out from the question's own quantity (half 2-9 as `mc` asks, half
    10-99), with the step `mc` replies state for the same conversion."""
    quantities = []
    for s in make_samples(("units",), 200, seed=4):
        k = int(re.search(r"\b(\d+) (?:meters|kilometers|hours|minutes|kilograms|days|weeks|liters)\b",
                          s.question).group(1))
        big, factor, small = re.search(r"One of the (\w+) is (\d+) (\w+), so", s.response).groups()
        assert f" {k} {big}" in f" {s.question}" and small in s.question
        assert s.answer == str(k * int(factor)) and s.response.endswith(f"The answer is {s.answer}.")
        quantities.append(k)
    assert min(quantities) == 2 and max(quantities) > 90 and 0.35 < sum(k < 10 for k in quantities) / 200 < 0.65
    mc = [s for s in make_samples(("mc",), 200, seed=4) if s.meta["src"] == "synthetic-units"]
    steps = {s.question: s.response.split(" The answer")[0] for s in make_samples(("units",), 2000, seed=5)}
    shared = [s for s in mc if s.meta["stem"] in steps]
    assert shared and all(s.meta["cot"].startswith(steps[s.meta["stem"]]) for s in shared)


def test_lookup_drill_letters_match_the_options():
    seen = set()
    for s in make_samples(("lookup",), 40, seed=2):
        assert s.image is None and s.reward == "ocr" and len(s.choices) == 10
        lines = s.question.split("\n")
        assert lines[0] == "Options:" and lines[1:11] == [f"{LETTERS[i]}. {c}" for i, c in enumerate(s.choices)]
        found = re.findall(r"The option (.+?) is \(([A-J])\)\.", s.response)
        assert 3 <= len(found) <= 6 and len({v for v, _ in found}) == len(found)
        assert all(s.choices[LETTERS.index(letter)] == value for value, letter in found)
        assert lines[11] == s.meta["stem"] and all(v in s.meta["stem"] for v, _ in found)
        assert s.answer == ", ".join(f"({letter})" for _, letter in found)
        assert reward(s, s.response) == 1.0
        seen.update(letter for _, letter in found)
    assert seen == set(LETTERS)  # every position is asked for


def test_bar_max_chart_when_every_bar_is_one():
    """Regression: a bar_max chart whose random values were all 1 dropped the others to an empty (0) bar, which
    PIL refused to draw (`random.Random(25163)` draws three 1s)."""
    import random

    from kimi_vl.data.world import _chart

    _, _, values, _, _ = _chart(random.Random(25163), "bar", 3, unique_max=True)
    assert min(values) >= 1 and values.count(max(values)) == 1


def test_rectangle_diagrams_show_both_side_lengths_whole():
    """Regression: the right-hand side length ("12 cm") was written past the canvas's right edge on wide
    rectangles, so the diagram hid digits the question needs. Nothing is drawn in the outer 2 pixels of any edge."""
    rects = [s for s in make_samples(("visual_math",), 200, seed=4) if s.meta["kind"] == "rect"]
    assert len(rects) >= 15
    for s in rects:
        gray = np.asarray(s.image.convert("L"))
        edges = [gray[:2], gray[-2:], gray[:, :2], gray[:, -2:]]
        assert min(int(e.min()) for e in edges) > 200, s.meta["sides"]


def test_proxy_items_are_pinned(tmp_path):
    """The evaluation proxies (seed 90210, the held-out `eval` split) are built by these generators: their items -
    questions, options, answers, images - are pinned, so a change of the training data's wording or mixture cannot
    move them (the hashes of the generators with the train / val / eval split of item keys)."""
    import hashlib

    rows = mmlu_pro_rows(140, 90_210)
    text = json.dumps([(r["question"], r["options"], r["answer"]) for r in rows]).encode()
    assert hashlib.sha256(text).hexdigest() == "3b93096c61df24abe896a9e50c8798c6551ca7da0d287fcee5537781a64d9e50"
    digest = hashlib.sha256()
    for r in mathvista_rows(100, 90_210, tmp_path).values():
        digest.update(json.dumps([r["question"], r["choices"], r["answer"], r["unit"], r["precision"]]).encode())
        digest.update((tmp_path / r["image"]).read_bytes())
    assert digest.hexdigest() == "0ba376bb564838a6aef25894ed2e8271ccb84351f486ecbc1e2468290baf90ce"


def test_evaluation_items_are_held_out_from_every_training_draw(tmp_path):
    """No item of the proxies (eval split) - a question's wording with its entity, an expression, a unit
    conversion, a chart's values, a rectangle, an image - is ever generated for training: training draws of every
    task, the SFT conversations' and the drill's sources among them, never produce an eval or val key, and the
    proxies' keys are all eval keys (so the two sets are disjoint)."""
    from kimi_vl.data.world import ALL_TASKS, VIDEO_TASKS, item_key, make_samples, split_of

    eval_mc = make_samples(("mc",), 300, 90_210, "eval")
    eval_math = make_samples(("visual_math",), 150, 90_210, "eval")
    eval_keys = {item_key(s) for s in eval_mc + eval_math}
    assert {split_of(k) for k in eval_keys} == {"eval"}
    stems = {s.meta["stem"] for s in eval_mc}
    train = [s for task in ALL_TASKS for s in make_samples((task,), 60 if task in VIDEO_TASKS else 400, 3)]
    train_keys = {item_key(s) for s in train}
    assert {split_of(k) for k in train_keys} == {"train"}
    assert not eval_keys & train_keys
    train_questions = {s.meta.get("stem", s.question) for s in train}
    assert not stems & train_questions  # no evaluation question is ever asked in training
    charts = {k for k in eval_keys if k.startswith("chart:")}
    assert charts and not charts & {item_key(s) for s in train if s.task in ("chart_bar", "visual_math")}
    val_keys = {item_key(s) for s in make_samples(("mc", "visual_math"), 200, 5, "val")}
    assert {split_of(k) for k in val_keys} == {"val"} and not val_keys & (eval_keys | train_keys)
    with pytest.raises(ConfigError, match="unknown split"):
        make_samples(("mc",), 1, 0, "test")


def test_held_out_questions_keep_their_knowledge_in_training():
    """As with a real benchmark's items, a held-out question's knowledge is met in training under other wordings:
    the creature or conversion of every evaluation question, and the product of most, is asked in training, never
    with the evaluation question's wording (an item keyed by its expression took its result out of training)."""
    from kimi_vl.data.world import make_samples

    eval_mc = make_samples(("mc",), 300, 90_210, "eval")
    train_mc = make_samples(("mc",), 4000, 3)
    train_entities = {s.meta["entity"] for s in train_mc}
    facts_and_units = [s for s in eval_mc if s.meta["src"] in ("synthetic-world", "synthetic-units")]
    products = [s for s in eval_mc if "*" in s.meta["entity"]]
    assert len(facts_and_units) > 200 and all(s.meta["entity"] in train_entities for s in facts_and_units)
    assert len(products) > 10 and sum(s.meta["entity"] in train_entities for s in products) > len(products) / 2
    assert not {s.meta["stem"] for s in eval_mc} & {s.meta["stem"] for s in train_mc}
