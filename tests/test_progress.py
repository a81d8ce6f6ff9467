"""Progress reports: tqdm where stderr is interactive, whole lines (`LogLines`) in logs."""

import io
import json

import pytest

from kimi_vl import progress
from kimi_vl.progress import LogLines, interactive, progress_bar


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "monotonic", c)
    return c


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_lines_every_interval_on_a_new_description_and_at_the_end(clock):
    out = io.StringIO()
    bar = LogLines(total=10, desc="pretrain", unit="step", interval=30, file=out)
    for _ in range(4):
        clock.now += 10
        bar.update()
        bar.set_postfix(loss="1.250")
    assert out.getvalue().splitlines() == ["pretrain: 3/10 (30%), 10 s/step, 00:30 elapsed, 01:10 left | loss=1.250"]
    bar.set_description("pretrain [decay]")
    bar.set_description("pretrain [decay]")  # unchanged: no line
    clock.now += 5
    bar.update(6)
    bar.close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[1] == "pretrain [decay]: 4/10 (40%), 10 s/step, 00:40 elapsed, 01:00 left | loss=1.250"
    assert lines[2] == "pretrain [decay]: 10/10 (100%), 4.5 s/step, 00:45 elapsed, 00:00 left | loss=1.250"
    assert len(lines) == 3 and "\r" not in out.getvalue()


def test_a_loop_that_names_its_next_item_writes_one_line_per_item(clock):
    out = io.StringIO()
    bar = LogLines(["a", "b"], desc="run", interval=30, file=out)
    for item in bar:
        bar.set_description(f"run [{item}]")
        clock.now += 60
    assert out.getvalue().splitlines() == ["run [a]: 0/2 (0%), 00:00 elapsed",
                                           "run [a]: 1/2 (50%), 60 s/it, 01:00 elapsed, 01:00 left",
                                           "run [b]: 2/2 (100%), 60 s/it, 02:00 elapsed, 00:00 left"]


def test_a_loop_that_names_its_next_item_before_counting_the_last_writes_them_together(clock):
    """The quickstart's loop: the next stage's name, then the finished stage's count; each line shows both (not the
    new name beside the old count), at once, however short the stage."""
    out = io.StringIO()
    bar = LogLines(total=100, desc="run", unit="%", interval=30, file=out)
    bar.set_description("run [a]")
    for following, share in (("b", 80), ("done", 20)):
        clock.now += 5
        bar.set_description(f"run [{following}]")
        bar.update(share)
    bar.close()
    assert out.getvalue().splitlines() == ["run [a]: 0/100 (0%), 00:00 elapsed",
                                           "run [b]: 80/100 (80%), 16 %/s, 00:05 elapsed, 00:01 left",
                                           "run [done]: 100/100 (100%), 10 %/s, 00:10 elapsed, 00:00 left"]


def test_iteration_resumed_count_and_no_total(clock):
    out = io.StringIO()
    seen = []
    for x in LogLines(["a", "b"], desc="check", unit="record", file=out):
        clock.now += 1
        seen.append(x)
    assert seen == ["a", "b"]
    assert out.getvalue() == "check: 2/2 (100%), 1 record/s, 00:02 elapsed, 00:00 left\n"
    out = io.StringIO()
    bar = LogLines(total=100, initial=40, desc="sft", interval=30, file=out)  # a resumed run: the rate counts new steps
    clock.now += 30
    bar.update(20)
    assert out.getvalue() == "sft: 60/100 (60%), 1.5 s/it, 00:30 elapsed, 01:00 left\n"
    out = io.StringIO()
    with LogLines(desc="stream", interval=30, file=out) as bar:
        bar.update(3)
    assert out.getvalue() == "stream: 3, 00:00 elapsed\n"


def test_progress_bar_picks_lines_for_logs_and_tqdm_for_terminals(monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    assert not interactive()
    assert isinstance(progress_bar(total=3, desc="x"), LogLines)
    silent = progress_bar(total=3, desc="x", enabled=False)
    assert not isinstance(silent, LogLines) and silent.disable
    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    assert interactive()
    bar = progress_bar(total=3, desc="x")
    assert not isinstance(bar, LogLines) and not bar.disable
    bar.close()


def test_a_redirected_cli_run_logs_lines_not_redraws(tmp_path, capsys):
    from transformers.utils import logging as transformers_logging

    from kimi_vl.cli import main

    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"document {i}"}) for i in range(5)))
    assert transformers_logging.is_progress_bar_enabled()
    assert main(["data", "check", str(docs)]) == 0
    assert transformers_logging.is_progress_bar_enabled()  # silenced for the command only
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    (line,) = err.splitlines()
    assert line.startswith(f"check {docs}: 5/5 (100%), ") and " record/s, " in line


@pytest.mark.parametrize("enabled, terminal, shown", [(True, True, True), (False, True, False), (True, False, False)])
def test_transformers_bars_follow_ours_inside_the_block_only(monkeypatch, enabled, terminal, shown):
    from transformers.utils import logging as transformers_logging

    monkeypatch.setattr(progress.sys, "stderr", Terminal() if terminal else io.StringIO())
    with progress.transformers_bars(enabled):
        assert transformers_logging.is_progress_bar_enabled() == shown
    assert transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # a user who switched them off keeps them off
    try:
        with progress.transformers_bars(True):
            assert not transformers_logging.is_progress_bar_enabled()
        assert not transformers_logging.is_progress_bar_enabled()
    finally:
        transformers_logging.enable_progress_bar()


def test_python_stages_and_eval_load_without_transformers_bars_when_progress_is_off(tmp_path, monkeypatch):
    from kimi_vl.eval.generation import Engine
    from kimi_vl.training.stages import load_checkpoint_dir
    from tests.test_export import tiny_model, tiny_processor

    proc = tiny_processor()
    tiny_model(proc).save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    err = Terminal()
    monkeypatch.setattr(progress.sys, "stderr", err)
    monkeypatch.setattr("sys.stderr", err)  # where transformers' tqdm writes
    load_checkpoint_dir(tmp_path, progress=False)
    Engine.from_pretrained(tmp_path, device="cpu", progress=False)
    assert "Loading weights" not in err.getvalue()
    load_checkpoint_dir(tmp_path)
    assert "Loading weights" in err.getvalue()  # the check can see the bar
