"""The `kimi-vl` command: every option of every subcommand has a help text, `--version`, `--no-progress` reaches
the pipeline, an interrupted command exits with its status and a message, not a traceback, and kimi-vl's warnings
print as one line."""

import argparse

import pytest

import kimi_vl
from kimi_vl.cli import build_parser, main
from kimi_vl.errors import TrainingInterrupted


def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += undocumented(sub, f"{path} {name}")
        elif not action.help and not isinstance(action, argparse._HelpAction):
            found.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return found


def test_every_option_has_help():
    assert undocumented(build_parser(), "kimi-vl") == []


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"kimi-vl {kimi_vl.__version__}\n"


@pytest.mark.parametrize("argv, target", [
    (["quickstart", "--out", "q"], "kimi_vl.quickstart.quickstart"),
    (["ablate", "vision-rl", "--from", "s", "--out", "a"], "kimi_vl.eval.ablation.vision_rl_ablation"),
])
def test_no_progress_reaches_the_pipeline(monkeypatch, tmp_path, argv, target):
    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs["progress"])
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / "ablation.md").write_text("table")
        return tmp_path / "q" / "REPORT.md"

    monkeypatch.setattr(target, record)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0 and main([*argv, "--no-progress"]) == 0
    assert calls == [True, False]


@pytest.mark.parametrize("raised, status, message", [
    (KeyboardInterrupt(), 130, "kimi-vl: interrupted; rerun the same command to go on"),
    (TrainingInterrupted("SIGTERM: stopped after step 3 of 8", 143), 143, "kimi-vl: SIGTERM: stopped after step 3"),
    (TrainingInterrupted("time limit of 5 min: stopped", 124), 124, "kimi-vl: time limit of 5 min: stopped"),
])
def test_an_interrupted_command_exits_with_its_status_without_a_traceback(monkeypatch, capsys, raised, status,
                                                                          message):
    def interrupted(*args, **kwargs):
        raise raised

    monkeypatch.setattr("kimi_vl.quickstart.quickstart", interrupted)
    assert main(["quickstart", "--out", "q"]) == status
    assert capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize("rank", [None, "1"])
def test_kimi_vls_warnings_print_as_one_line_on_rank_0(monkeypatch, capsys, tmp_path, rank):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if rank is not None:  # another rank of a launcher: rank 0 prints the same warning
        monkeypatch.setenv("RANK", rank)
    assert main(["train", "sft", "--from", str(tmp_path / "missing"), "--out", str(tmp_path / "o"),
                 "--preset", "small"]) == 2
    err = capsys.readouterr().err.splitlines()
    if rank is None:
        assert err[0].startswith("kimi-vl: warning: preset 'small' is a GPU recipe")
        assert err[1].startswith("kimi-vl: error: ")
    else:
        assert len(err) == 1 and err[0].startswith("kimi-vl: error: ")


@pytest.mark.parametrize("raised", [None, TrainingInterrupted("SIGTERM: stopped after step 3 of 8", 143)])
def test_a_command_ends_the_process_group_it_started(monkeypatch, tmp_path, raised):
    """Under a launcher accelerate starts the process group inside the command; the command destroys it before
    returning (torch's normal exit), whether training finished or stopped on a signal. A group the caller started
    before the command stays theirs."""
    import torch.distributed as dist

    def start_group(*args, **kwargs):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        if raised:
            raise raised
        return tmp_path / "REPORT.md"

    monkeypatch.setattr("kimi_vl.quickstart.quickstart", start_group)
    assert not dist.is_initialized()
    assert main(["quickstart", "--out", "q"]) == (raised.exit_status if raised else 0)
    assert not dist.is_initialized()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr("kimi_vl.quickstart.quickstart", lambda *a, **k: tmp_path / "REPORT.md")
        assert main(["quickstart", "--out", "q"]) == 0 and dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_only_training_runs_under_a_launcher(monkeypatch, capsys):
    """Under torchrun (WORLD_SIZE > 1) a command other than `train STAGE` would run once per rank over the same
    files: it stops before starting, saying so."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("kimi_vl.quickstart.quickstart", lambda *a, **k: pytest.fail("ran under a launcher"))
    assert main(["quickstart", "--out", "q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-vl: error: `kimi-vl quickstart` runs in one process, but was launched as 2")
    assert "only `kimi-vl train STAGE` trains across processes" in err
