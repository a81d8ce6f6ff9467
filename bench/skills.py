"""Which of the proxies' component skills a trained checkpoint has (the diagnosis behind docs/RESULTS.md).

Teacher-forced, so each number isolates one skill from the others:

- `letter`: on the MMLU-Pro proxy's items (the evaluation's chat prompt), the target reply up to "The option
  <right value> is (" is given; is the next token the right letter? Chance 10%: the option-letter lookup.
- `drill`: the same lookup on bare option lists (`option_drill_document`, 10 options, 5 lookups each).
- `colour`: an image of one shape and "What color is the <shape>?"; the reply "The <shape> is" is given; is the
  next token the right colour? Chance 10%: whether the language model reads the image tokens.
- `swatch`: the same on one-colour images ("What color is the image?", the reply "The image is" given): whether the
  language model reads image tokens at all, when every one of them carries the answer.
- `probe`: a linear probe (logistic regression, 300 training images) on the vision tower's mean-pooled features
  of the same images, scored on 100 others: whether the colour is in the vision features at all.
- `header colour`: a screencast, "Write the HTML of this web page." and the true page up to the header's
  `background:` are given; is the next token the header's colour? Chance 1/12: whether the language model reads the
  video tokens (the colours are what the demo's page must take from the video).
- `header probe`: a linear probe on the projected video tokens of the first chunk (300 training screencasts, 100
  others scored): whether the header colour is in the video features at all.
- `count`, `bar value`: generated (greedy, 24 tokens) answers to the world's counting and bar-value questions,
  the number after "The answer is" compared with the truth: the two skills of the MathVista proxy.

Items come from the world's `--split` (`eval`: the held-out items the reported figures use; `val`: the
validation draw, for tuning); the probe trains on training images.

    python bench/skills.py --model runs/quickstart/pretrain runs/quickstart/sft
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

import kimi_vl  # noqa: F401  (registers the Auto classes)
from kimi_vl.data import PackedStream, option_drill_document
from kimi_vl.data.encode import process
from kimi_vl.data.screencast import COLORS as PAGE_COLORS
from kimi_vl.data.world import COLORS, make_samples
from kimi_vl.demos.video2web import build_prompt
from kimi_vl.eval import mmlu_pro as mp
from kimi_vl.eval.proxies import mmlu_pro_synth
from kimi_vl.training.rewards import reward


def _next_token(model, processor, text: str, image=None) -> str:
    inputs = processor(text=text, images=[image] if image is not None else None, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    return processor.tokenizer.decode([int(logits.argmax())]).strip()


def letter_accuracy(model, processor, split: str) -> float:
    test, val = mmlu_pro_synth(split=split)
    right = 0
    for row in test:
        prompt = mp.build_prompt(val, row, 0)
        text = processor.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        value = row["options"][row["answer_index"]]
        reasoning = row["cot_content"].removeprefix(mp.COT_PREFIX_SHOT).split("The option")[0].strip()
        right += _next_token(model, processor, f"{text}{reasoning} The option {value} is (") == row["answer"]
    return right / len(test)


def drill_accuracy(model, processor, batches: int = 4) -> float:
    stream = PackedStream(lambda draws: option_drill_document(draws.rng, processor, 5, 10), seq_len=256, rows=4,
                          seed=99, processor=processor)
    right = total = 0
    with torch.no_grad():
        for i in range(batches):
            batch = stream.batch(i)
            logits = model(**batch.model_inputs()).logits[0, :-1]
            labels = batch.labels[0, 1:]
            mask = labels != -100
            right += int((logits.argmax(-1)[mask] == labels[mask]).sum())
            total += int(mask.sum())
    return right / total


def _chat_prompt(processor, question: str) -> str:
    return processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True, tokenize=False)


def colour_accuracy(model, processor, split: str = "val", n: int = 100, task: str = "color") -> float:
    """Teacher-forced colour of the one shape (`color`) or of the whole one-colour image (`swatch`): the reply up
    to its first colour word ("The square is", "The image is") is given."""
    right = 0
    for s in make_samples((task,), n, seed=777, split=split):
        prefix = _chat_prompt(processor, s.question) + s.response[:s.response.index(f" {s.answer}")]
        right += _next_token(model, processor, prefix, s.image) == s.answer
    return right / n


def answer_accuracy(model, processor, task: str, split: str, n: int = 60) -> float:
    """Greedy replies to `n` world `task` questions: does the world's verifier (`rewards.reward`) give full reward,
    i.e. is the number (for `ocr`, the normalised text) after "The answer is" the truth?"""
    right = 0
    for s in make_samples((task,), n, seed=778, split=split):
        inputs = processor(text=_chat_prompt(processor, s.question), images=[s.image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        reply = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        right += reward(s, reply) == 1.0
    return right / n


def _linear_probe(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, classes: int
                  ) -> float:
    """Accuracy on `(x_test, y_test)` of a logistic regression fitted on `(x, y)` (features standardised on `x`)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    x, x_test = (x - mean) / std, (x_test - mean) / std
    torch.manual_seed(0)
    w = torch.zeros(x.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + 1e-3 * w.square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(((x_test @ w + b).argmax(1) == y_test).float().mean())


def colour_probe(model, processor, split: str) -> float:
    names = list(COLORS)

    def features(samples):
        out = []
        for s in samples:
            inputs = processor.image_processor([s.image], return_tensors="pt")
            with torch.no_grad():
                merged = model.vision_tower(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            out.append(merged.float().reshape(-1, model.vision_tower.config.hidden_size).mean(0))
        return torch.stack(out), torch.tensor([names.index(s.answer) for s in samples])

    return _linear_probe(*features(make_samples(("color",), 300, seed=1)),
                         *features(make_samples(("color",), 100, seed=2, split=split)), len(names))


def header_colour_accuracy(model, processor, split: str, n: int = 60) -> float:
    """Teacher-forced header colour of screencasts: the video, the question and the true page up to the header's
    `background:` are given; is the next token the colour's first token? Chance 1/12 (the header colours)."""
    tokenizer = processor.tokenizer
    right = 0
    for s in make_samples(("screencast",), n, seed=779, split=split):
        page, colour = s.video.html, s.video.spec.header_color
        cut = page.index(f"background:{colour}") + len("background:")
        ids, media = process(processor, build_prompt(processor) + page[:cut], videos=[s.video])
        before = tokenizer(page[:cut], add_special_tokens=False)["input_ids"]
        target = tokenizer(page[:cut + len(colour)], add_special_tokens=False)["input_ids"]
        if target[:len(before)] != before:
            raise SystemExit(f"the tokenizer merges 'background:' with {colour!r}; this test needs them apart")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), **media).logits[0, -1]
        right += int(logits.argmax()) == target[len(before)]
    return right / n


def header_colour_probe(model, processor, split: str) -> float:
    """A linear probe on the projected video tokens (the first chunk's, flattened: every screencast has the same
    grid) for the header colour: whether the vision tower's video features hold it at all. 300 training
    screencasts, 100 of `split`."""
    names = list(PAGE_COLORS)

    def features(samples):
        out = []
        for s in samples:
            _, media = process(processor, build_prompt(processor), videos=[s.video])
            with torch.no_grad():
                tokens = model.get_video_features(media["pixel_values_videos"], media["video_grid_thw"])
            chunks = media["video_grid_thw"].shape[0]
            out.append(tokens[: tokens.shape[0] // chunks].float().flatten())
        return torch.stack(out), torch.tensor([names.index(s.video.spec.header_color) for s in samples])

    return _linear_probe(*features(make_samples(("screencast",), 300, seed=3)),
                         *features(make_samples(("screencast",), 100, seed=4, split=split)), len(names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", required=True, help="checkpoint directories")
    ap.add_argument("--split", choices=("eval", "val"), default="eval", help="the world's split the items come from")
    args = ap.parse_args()
    print(f"Items of the {args.split} split.\n")
    print("| checkpoint | letter (chance 10%) | drill | colour (chance 10%) | swatch (chance 10%) | "
          "colour probe on the vision tower | header colour (chance 8%) | header probe | count | bar value |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.model:
        model = AutoModelForImageTextToText.from_pretrained(path).eval()
        processor = AutoProcessor.from_pretrained(path)
        cells = [letter_accuracy(model, processor, args.split), drill_accuracy(model, processor),
                 colour_accuracy(model, processor, args.split),
                 colour_accuracy(model, processor, args.split, task="swatch"),
                 colour_probe(model, processor, args.split),
                 header_colour_accuracy(model, processor, args.split),
                 header_colour_probe(model, processor, args.split),
                 answer_accuracy(model, processor, "count", args.split),
                 answer_accuracy(model, processor, "chart_bar", args.split)]
        print(f"| {path} | " + " | ".join(f"{100 * c:.1f}%" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
