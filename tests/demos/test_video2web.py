"""`kimi-vl demo video2web` end to end with a tiny random model on generated screencasts, and its errors."""

import argparse
import json
import random
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from PIL import Image

from kimi_vl.data.screencast import make_screencast, page_html, write_video
from kimi_vl.data.world import item_key, make_sample, sample_rng, split_of
from kimi_vl.demos.similarity import page_similarity
from kimi_vl.demos.video2web import (
    _model_inputs,
    add_video2web_parser,
    blank_page_score,
    fixed_page_scores,
    fixed_pages,
    generate_html,
    load_model,
    page_fields,
    page_fields_read,
    read_video,
    render_and_score,
    run_video2web,
)
from kimi_vl.errors import CheckpointError, ConfigError, InvalidMediaError, KimiVLError
from kimi_vl.text import KimiTextConfig
from tests.demos.conftest import chromium_or_none
from tests.test_export import tiny_model, tiny_processor
from tests.vision.test_media import write_vfr_video


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2w_model")
    proc = tiny_processor()
    model = tiny_model(proc)
    model.save_pretrained(root)
    proc.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def cast(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2w_video")
    sc = make_screencast(random.Random(21), width=160, height=120, num_frames=8, fps=4.0)
    return sc, write_video(sc.frames, root / "cast.mp4", sc.fps)


def well_formed(path) -> ET.Element:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html><html>") and text.endswith("</body></html>")
    root = ET.fromstring(text[len("<!DOCTYPE html>"):])
    assert [c.tag for c in root] == ["head", "body"]
    return root


def cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kimi-vl")
    demo = parser.add_subparsers(dest="command", required=True).add_parser("demo")
    add_video2web_parser(demo.add_subparsers(dest="demo", required=True))
    return parser.parse_args(argv)


def test_end_to_end_truncated_output(model_dir, cast, tmp_path):
    sc, video = cast
    out = tmp_path / "out"
    result = run_video2web(video, model_dir, out, max_new_tokens=24, render=chromium_or_none() is not None)
    assert result.stop == "max_new_tokens" and result.new_tokens == 24  # a random model: cut, malformed output
    assert result.num_frames == 8 and result.frame_size == (160, 120) and result.video_tokens > 0
    well_formed(out / "site.html")
    assert (out / "reply.txt").read_bytes().decode("utf-8") == result.reply
    if result.score is not None:  # Chromium is installed
        assert Image.open(out / "render.png").size == (160, 120)
        assert Image.open(out / "compare.png").size == (2 * 160 + 4, 120)
        score = json.loads((out / "score.json").read_text())
        assert 0.0 <= score["score"] <= 1.0 and len(score["frame_scores"]) == 8
        assert score["frame_size"] == [160, 120]


def test_cli_with_render(model_dir, cast, tmp_path, chromium, capsys):
    _, video = cast
    args = cli(["demo", "video2web", str(video), "--model", str(model_dir), "--out", str(tmp_path / "o"),
                "--num-frames", "4", "--max-new-tokens", "8", "--render"])
    args.func(args)
    printed = capsys.readouterr().out
    assert "read 4 frames of 160x120" in printed and "similarity" in printed
    for name in ("site.html", "render.png", "compare.png", "score.json"):
        assert (tmp_path / "o" / name).is_file()


def test_render_and_score_true_page_into_a_new_folder(cast, tmp_path, chromium):
    """The quickstart scores the screencast's own HTML (the gap's top end) into a folder that does not exist yet;
    the true page scores far above a blank one."""
    sc, _ = cast
    (tmp_path / "target.html").write_text(sc.html)
    frames = np.stack([np.asarray(f) for f in sc.frames])
    render, compare, score_path, score = render_and_score(tmp_path / "target.html", frames, tmp_path / "a" / "true")
    assert render.is_file() and compare.is_file() and json.loads(score_path.read_text()) == score
    assert score["score"] > 0.9
    blank = blank_page_score(frames)  # the floor: a white page of the rendered page's size
    w, h = score["frame_size"]
    assert blank == page_similarity(list(frames), Image.new("RGB", (w, score["page_render_height"]), "white")).score
    assert blank < score["score"] - 0.2


def test_fixed_pages_are_training_pages_scored_like_any_page(tmp_path, chromium):
    """The demo's constant-answer baseline: the same train-split pages on every call; each is scored as a generated
    page would be, so a fixed page scored on its own screencast's frames is the true page's score, and on another
    screencast's frames it lies between the blank page and that screencast's true page."""
    pages = fixed_pages(2)
    assert pages == fixed_pages(2) and len(set(pages)) == 2
    own = make_sample("screencast", sample_rng(0, 0, "fixed-page"))
    assert own.video.html == pages[0] and split_of(item_key(own)) == "train"
    own_frames = np.stack([np.asarray(f) for f in own.video.frames])
    (tmp_path / "own.html").write_text(pages[0])
    assert fixed_page_scores(own_frames, tmp_path / "own", n=1) == [
        render_and_score(tmp_path / "own.html", own_frames, tmp_path / "ref")[3]["score"]]
    other = make_sample("screencast", random.Random(5), split="eval").video
    frames = np.stack([np.asarray(f) for f in other.frames])
    (tmp_path / "true.html").write_text(other.html)
    true = render_and_score(tmp_path / "true.html", frames, tmp_path / "true")[3]["score"]
    scores = fixed_page_scores(frames, tmp_path / "other", n=2)
    assert len(scores) == 2 and all(blank_page_score(frames) < x < true for x in scores)
    assert (tmp_path / "other" / "fixed1" / "render.png").is_file()


def test_page_fields_read_checks_each_stated_field():
    """The true page states every field right; a page that swaps one colour, one height or names another title gets
    exactly that field wrong; a page missing its elements states None and gets them wrong; extra styled elements
    after the button do not shift the fields."""
    spec = make_sample("screencast", random.Random(5), split="eval").video.spec
    html = page_html(spec)
    assert page_fields(html) == {
        "title": spec.title, "header color": spec.header_color, "header height": str(spec.header_height),
        "section 1 color": spec.sections[0].color, "section 1 height": str(spec.sections[0].height),
        "section 2 color": spec.sections[1].color, "section 2 height": str(spec.sections[1].height),
        "button color": spec.button_color, "button width": str(spec.button_width)}
    assert all(page_fields_read(html + '<div style="height:9px;background:red">x</div>', spec).values())
    wrong = "tan" if spec.sections[1].color != "tan" else "plum"
    swapped = html.replace(f"background:{spec.sections[1].color}", f"background:{wrong}")
    assert [k for k, v in page_fields_read(swapped, spec).items() if not v] == ["section 2 color"]
    taller = html.replace(f"height:{spec.sections[0].height}px;background:{spec.sections[0].color}",
                          f"height:{spec.sections[0].height + 4}px;background:{spec.sections[0].color}")
    assert [k for k, v in page_fields_read(taller, spec).items() if not v] == ["section 1 height"]
    retitled = html.replace(f">{spec.title}</div>", ">Nowhere</div>", 1)
    assert [k for k, v in page_fields_read(retitled, spec).items() if not v] == ["title"]
    cut = '<html><body style="margin:0"><div style="background:' + spec.header_color + '">' + spec.title + "</div>"
    assert page_fields(cut)["button color"] is None and page_fields(cut)["header height"] is None
    assert [k for k, v in page_fields_read(cut, spec).items() if v] == ["title", "header color"]
    # a third section does not become the button
    extra = html.replace("<button", f'<div style="margin:4px;height:32px;background:{wrong}">x</div><button')
    assert all(page_fields_read(extra, spec).values())


def test_stops_at_closing_tag(loaded, cast, monkeypatch):
    model, proc = loaded
    _, video = cast
    clip = read_video(video, proc)
    tok = proc.tokenizer
    target = tok("<html><body>hi</body></html> trailing junk", add_special_tokens=False)["input_ids"]

    def fake_generate(input_ids, stopping_criteria, max_new_tokens, **kwargs):
        seq = input_ids
        for t in target[:max_new_tokens]:
            seq = torch.cat([seq, torch.tensor([[t]])], 1)
            if any(bool(c(seq, None).all()) for c in stopping_criteria):
                break
        return seq

    monkeypatch.setattr(model, "generate", fake_generate)
    reply, stop, new_tokens, _ = generate_html(model, proc, clip, max_new_tokens=100)
    assert stop == "html_end" and reply.replace(" ", "").endswith("</body></html>") and "junk" not in reply
    assert new_tokens < len(target)


def test_stop_on_text_criterion(loaded):
    from kimi_vl.eval.generation import StopOnStrings

    _, proc = loaded
    tok = proc.tokenizer
    prompt = tok("the cat", add_special_tokens=False)["input_ids"]
    done = tok("<p>x</p></html>", add_special_tokens=False)["input_ids"]
    crit = StopOnStrings(tok, ["</html>"], len(prompt))
    ids = torch.tensor([prompt + done, prompt + done[:-1] + [done[0]] * (len(done) - len(done[:-1]))])
    assert crit(ids, None).tolist() == [True, False]


def test_long_video_fits_the_budget(loaded, tmp_path):
    _, proc = loaded
    frames = [np.full((48, 64, 3), 4 * i, np.uint8) for i in range(48)]
    video = write_video(frames, tmp_path / "long.mp4", 8.0)
    per_chunk = proc.video_processor.get_num_video_tokens(1, 48, 64)
    clip = read_video(video, proc, fps=8.0, max_video_tokens=2 * per_chunk)  # 2 chunks of 4 frames
    assert clip.frames.shape[0] == 8
    assert clip.indices.tolist() == list(range(0, 48, 6))  # uniformly spaced over the whole video
    assert read_video(video, proc, fps=1.0).frames.shape[0] == 6
    with pytest.raises(ConfigError, match="media budget"):
        read_video(video, proc, num_frames=12, max_video_tokens=2 * per_chunk)
    with pytest.raises(InvalidMediaError, match="over the budget"):
        read_video(video, proc, max_video_tokens=per_chunk - 1)


def test_screen_recording_with_variable_frame_rate(tmp_path):
    """A recorder's variable-frame-rate file (7 s, 24 fps stated, 12 frames): the demo samples one frame per half
    second of it, not 1 frame of a 0.5 s video, and the prompt's chunks carry the frames' own start times."""
    proc = tiny_processor()
    clip = read_video(write_vfr_video(tmp_path / "screen.mkv"), proc, fps=2.0)
    assert clip.indices.tolist() == [0, 4, 5, 5, 5, 5, 9, 9, 9, 9, 9, 10]
    prompt = proc.tokenizer.decode(_model_inputs(proc, clip)["input_ids"][0])
    assert re.findall(r"(\d\d:\d\d:\d\d\.\d{3})<\|media_start\|>video", prompt) == [
        "00:00:00.000", "00:00:02.346", "00:00:04.693"]


def test_bad_videos(model_dir, tmp_path):
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    for video, pattern in ((corrupt, "cannot be decoded|no decodable"), (empty, "empty"),
                           (tmp_path / "missing.mp4", "does not exist")):
        with pytest.raises(InvalidMediaError, match=pattern):
            run_video2web(video, model_dir, tmp_path / "out")
    assert not (tmp_path / "out" / "site.html").exists()


def test_bad_model_directories(cast, tmp_path):
    _, video = cast
    with pytest.raises(CheckpointError, match="does not exist"):
        run_video2web(video, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        run_video2web(video, tmp_path / "empty_dir", tmp_path / "out")
    text_only = tmp_path / "text_only"
    KimiTextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        text_only)
    with pytest.raises(ConfigError, match="no vision encoder"):
        run_video2web(video, text_only, tmp_path / "out")
    args = cli(["demo", "video2web", str(video), "--model", str(tmp_path / "nowhere"), "-o", str(tmp_path / "o")])
    with pytest.raises(KimiVLError):
        args.func(args)


def test_temperature_must_be_finite_and_not_negative(loaded, capsys):
    base = ["demo", "video2web", "v.mp4", "--model", "m", "-o", "o"]
    assert cli(base).temperature == 0.0 and cli(base + ["--temperature", "0.7"]).temperature == 0.7
    for bad in ("-1", "nan", "inf", "warm"):
        with pytest.raises(SystemExit):
            cli(base + ["--temperature", bad])
        assert "argument --temperature" in capsys.readouterr().err
    model, processor = loaded
    for bad in (0.0, -1.0, float("nan")):  # sampling at such a temperature: refused before anything is computed
        with pytest.raises(ConfigError, match="temperature must be a positive number when sampling"):
            generate_html(model, processor, None, do_sample=True, temperature=bad)


def test_device_output_folder_and_model_file_errors(model_dir, loaded, cast, tmp_path, monkeypatch):
    """The demo shares `kimi-vl eval`'s checks: the device (`resolve_device`), the output folder, the model path."""
    _, video = cast
    with pytest.raises(ConfigError, match=r"^--device tpu is not a torch device \(cpu, cuda, cuda:N, mps\)\.$"):
        run_video2web(video, model_dir, tmp_path / "out", device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli(["demo", "video2web", str(video), "--model", str(model_dir), "-o", str(tmp_path / "o"),
                "--device", "cuda"])
    with pytest.raises(ConfigError, match=r"^--device cuda: CUDA is not available on this machine; use --device cpu"):
        args.func(args)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a model directory"):
        run_video2web(video, afile, tmp_path / "out")
    model, processor = loaded
    with pytest.raises(ConfigError, match=r"^-o \S*afile is a file, not a directory"):
        run_video2web(video, None, afile, max_new_tokens=2, model=model, processor=processor)
    assert afile.read_text() == "x" and not (tmp_path / "out").exists()


def test_render_without_a_browser_fails_before_generating(loaded, cast, tmp_path, monkeypatch):
    """`--render` without Chromium stops before the model generates (a real model's reply takes minutes)."""
    import kimi_vl.demos.video2web as v2w
    from kimi_vl.demos.render import BrowserNotFoundError

    _, video = cast
    model, processor = loaded
    monkeypatch.setattr(v2w, "generate_html", lambda *a, **k: pytest.fail("generated before the browser check"))
    with pytest.raises(BrowserNotFoundError, match="is not an executable"):
        run_video2web(video, None, tmp_path / "out", render=True, browser=str(tmp_path / "no-chromium"),
                      model=model, processor=processor)
    assert not (tmp_path / "out").exists()


def test_a_new_page_never_sits_beside_an_earlier_runs_render_and_score(loaded, cast, tmp_path):
    """Rerunning into a folder without `render` (or with a render that fails) leaves no render.png, compare.png or
    score.json of another page or video beside the new site.html."""
    _, video = cast
    model, processor = loaded
    out = tmp_path / "out"
    out.mkdir()
    for name in ("render.png", "compare.png", "score.json"):
        (out / name).write_text("an earlier run's")
    (out / "notes.txt").write_text("mine")
    result = run_video2web(video, None, out, max_new_tokens=4, model=model, processor=processor)
    assert result.score is None
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "reply.txt", "site.html"]


def test_the_page_is_scored_on_the_frames_given(loaded, cast, tmp_path, chromium):
    """`score_frames`: the quickstart and `bench/video2web.py` score the page on the screencast's own frames, as
    they score its blank, true and fixed pages, not on the mp4 codec's decoding of them."""
    sc, video = cast
    model, processor = loaded
    frames = np.stack([np.asarray(f) for f in sc.frames])
    given = run_video2web(video, None, tmp_path / "given", max_new_tokens=4, model=model, processor=processor,
                          render=True, score_frames=frames)
    again = render_and_score(given.site, frames, tmp_path / "again")[3]
    assert given.score["score"] == again["score"] and len(given.score["frame_scores"]) == len(frames)
    decoded = run_video2web(video, None, tmp_path / "decoded", max_new_tokens=4, model=model, processor=processor,
                            render=True)
    assert decoded.html == given.html and decoded.score["score"] != given.score["score"]
