"""The training stages end to end on the tiny preset with a few steps: checkpoint directories that load, summaries,
skipping finished stages (and refusing to pass one off as a run of other settings), the RL stage's resume, and the
CLI."""

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

import kimi_vl  # noqa: F401  (registers the Auto classes)
from kimi_vl.cli import build_parser, main
from kimi_vl.errors import CheckpointError, ConfigError
from kimi_vl.training.config import load_config_file, resolve, stage_overrides, write_run_config
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import (
    family_tasks,
    load_checkpoint_dir,
    pretrain,
    read_summary,
    rl,
    sft,
    summary_line,
)
from kimi_vl.training.trainer import read_metrics


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("stages") / "pretrain"
    pretrain(out, steps=3, progress=False, val_batches=1)
    return out


def test_pretrain_writes_a_loadable_checkpoint(pretrained):
    summary = read_summary(pretrained)
    assert summary["complete"] and summary["steps"] == 3 and summary["preset"] == "tiny"
    packing = get_preset("tiny").data["pretrain"]
    assert summary["unigram_baseline"] > 3 and summary["tokens"] == 3 * packing.rows * packing.seq_len
    model = AutoModelForImageTextToText.from_pretrained(pretrained)
    assert type(model).__name__ == "KimiVLForConditionalGeneration"
    assert model.config.text_config.hidden_size == get_preset("tiny").text["hidden_size"]
    assert (pretrained / "tokenizer.json").is_file() and (pretrained / "plots" / "loss.png").is_file()
    metrics = read_metrics(pretrained / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["vision_tokens"] > 0 for m in metrics)
    mtime = (pretrained / "model.safetensors").stat().st_mtime
    pretrain(pretrained, steps=3, progress=False)  # finished: not rerun
    pretrain(pretrained, steps=3, num_workers=1, checkpoint_every=7)  # settings of how it runs: the same run
    saved = (pretrained / "run_config.json").read_text()
    legacy = {**json.loads(saved), "data": dataclasses.asdict(get_preset("tiny").data["pretrain"])}
    (pretrained / "run_config.json").write_text(json.dumps(legacy))  # written before: every field, RL's too
    pretrain(pretrained, steps=3, progress=False)  # still the same run
    (pretrained / "run_config.json").write_text(saved)
    with pytest.raises(ConfigError, match=r"finished pretrain run with other settings \(lr 0.003 -> 0.001; steps 3 -> "
                                          r"5\).*another --out"):
        pretrain(pretrained, steps=5, lr=1e-3, progress=False)  # not passed off as the run asked for
    assert (pretrained / "model.safetensors").stat().st_mtime == mtime


@pytest.mark.parametrize("stage", ["pretrain", "sft", "rl"])
def test_a_runs_resolved_configuration_is_accepted_back(stage, tmp_path):
    """`OUT/run_config.json` holds the settings of its stage only, so `--config` takes it back as it is (a field of
    another stage, such as RL's `families` in a pre-training run's file, would be an unknown setting)."""
    cfg = resolve(stage, "tiny", {"lr": 1e-3, "sources": ["a.jsonl=2"]}, seed=3)
    settings = load_config_file(write_run_config(cfg, tmp_path))
    preset, seed = settings.pop("preset"), settings.pop("seed")
    assert resolve(stage, preset, settings, seed=seed) == cfg
    # a file written before (every section's every field, RL's too) is accepted back the same
    legacy = {"stage": stage, "preset": "tiny", "seed": 3, "train": dataclasses.asdict(cfg.train),
              "data": dataclasses.asdict(cfg.data), "rl": dataclasses.asdict(get_preset("tiny").rl_algorithm)}
    (tmp_path / "legacy.json").write_text(json.dumps(legacy))
    settings = load_config_file(tmp_path / "legacy.json")
    preset, seed = settings.pop("preset"), settings.pop("seed")
    assert resolve(stage, preset, settings, seed=seed) == cfg


def test_data_none_is_the_embedded_data(tmp_path):
    """`--data none` (the option's help: "none: the embedded data"), e.g. to override a config file's sources, and
    `data: null` in the file give no sources; `--val-data none` no validation sources."""
    (tmp_path / "c.yaml").write_text("data: null\nval_data: [v.jsonl]\n")
    args = build_parser().parse_args(["train", "sft", "--from", "f", "--out", "o", "--data", "none",
                                      "--val-data", "none"])
    assert resolve("sft", "tiny", stage_overrides(args, "sft")).data.sources == []
    assert resolve("sft", "tiny", stage_overrides(args, "sft")).data.val_sources == []
    assert resolve("sft", "tiny", load_config_file(tmp_path / "c.yaml")).data.sources == []



def test_settings_take_paths_and_numbers_as_python_passes_them(tmp_path):
    """From Python, file settings take `pathlib.Path`s as `out_dir` does (`pretrain(out, sources=[Path(...)])`): a
    path is its text, and one path given for a list setting is its one item, not split at a comma in its name.
    Numbers may be numpy's (a sweep over `np.arange` / `np.float32` values), integers still not real numbers."""
    data, tokenizer = tmp_path / "docs,v2.jsonl", tmp_path / "tok"
    cfg = resolve("pretrain", "tiny", {"sources": [data, "b.jsonl=2"], "val_sources": data, "tokenizer": tokenizer,
                                       "media_root": tmp_path})
    assert cfg.data.sources == [str(data), "b.jsonl=2"] and cfg.data.val_sources == [str(data)]
    assert cfg.data.tokenizer == str(tokenizer) and cfg.data.media_root == str(tmp_path)
    numpy = resolve("pretrain", "tiny", {"steps": np.int64(5), "lr": np.float32(0.5), "vision_ratio": np.float64(0.25),
                                         "text_tasks": {"mc": np.int32(2)}})
    assert numpy == resolve("pretrain", "tiny", {"steps": 5, "lr": 0.5, "vision_ratio": 0.25, "text_tasks": "mc=2"})
    assert type(numpy.train.steps) is int and type(numpy.train.lr) is float
    with pytest.raises(ConfigError, match=r"steps must be a int, got 5.0"):
        resolve("pretrain", "tiny", {"steps": 5.0})


@pytest.mark.parametrize("finished_here", [True, False])
def test_ranks_that_see_a_stage_in_different_states_stop(pretrained, tmp_path, monkeypatch, finished_here):
    """A stage that one rank sees finished and another does not (an --out on each machine's own disk) stops every
    rank with CheckpointError, before any training: the ranks that found it finished would return while the others
    waited for them in the training's first collective until the process group's timeout."""
    import kimi_vl.training.stages as stages

    out = pretrained if finished_here else tmp_path / "fresh"
    seen = []
    monkeypatch.setattr(stages, "gather_ints", lambda done, device: seen.append(done) or [done, 1 - done])
    here, there = ("finished", "not finished") if finished_here else ("not finished", "finished")
    with pytest.raises(CheckpointError, match=rf"different states of .*\(rank 0: {here}, rank 1: {there}\): every "
                                              "rank must read the same --out folder"):
        pretrain(out, steps=3, progress=False, val_batches=1)
    assert seen == [int(finished_here)] and (finished_here or not out.exists())



@pytest.mark.parametrize("setting,value", [("vocab_size", 1200), ("image_max_patches", 16)])
def test_resuming_with_another_processor_is_refused_not_ignored(pretrained, tmp_path, setting, value):
    """A resumed run keeps the tokenizer and media processors saved at its start: asked for other ones it stops
    naming the change, instead of training with the saved ones while its run_config.json records the new values."""
    cut = tmp_path / "cut"
    shutil.copytree(pretrained, cut)
    (cut / "training_summary.json").unlink()  # as if killed after its last checkpoint
    saved = (cut / "run_config.json").read_text()
    old = json.loads(saved)["data"][setting]
    with pytest.raises(ConfigError, match=rf"started with another processor or model \({setting} {old} -> {value}\)"
                                          r".*Resume it with its settings"):
        pretrain(cut, steps=3, progress=False, val_batches=1, **{setting: value})
    assert (cut / "run_config.json").read_text() == saved


def test_resuming_from_another_checkpoint_is_refused_not_ignored(pretrained, tmp_path):
    """An unfinished SFT asked to go on from another --from stops naming both, rather than go on from its training
    checkpoint (trained from the first) under a summary that names the second; a copy of the first is the same."""
    other = tmp_path / "other"
    shutil.copytree(pretrained, other)
    weights = load_file(other / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    out, settings = tmp_path / "sft", dict(progress=False, val_batches=1, rows=2, seq_len=64)
    sft(pretrained, out, steps=1, **settings)
    (out / "training_summary.json").unlink()  # as if killed after its last checkpoint
    with pytest.raises(ConfigError, match=rf"unfinished run started from {pretrained.resolve()}, .* not from {other}\."
                                          rf" Resume it with --from {pretrained.resolve()}"):
        sft(other, out, steps=2, **settings)
    shutil.copytree(pretrained, tmp_path / "copy")
    assert sft(tmp_path / "copy", out, steps=2, **settings) == out


def test_a_from_checkpoint_trained_again_in_place_is_another_start(tmp_path):
    """A stage (an ablation's RL run) that recorded its `from` weights is the same run only from those weights: a
    copy of them anywhere counts, the same folder holding other weights (the SFT checkpoint trained again in place)
    does not, so a rerun refuses it rather than pass off runs from the old weights as runs from the new ones. Runs
    that recorded no weights are matched by their folder."""
    from kimi_vl.training.stages import _same_from, weights_fingerprint

    ckpt = tmp_path / "sft"
    ckpt.mkdir()
    save_file({"w": torch.zeros(4)}, ckpt / "model.safetensors")
    recorded = weights_fingerprint(ckpt)
    shutil.copytree(ckpt, tmp_path / "copy")
    assert _same_from(str(ckpt), recorded, ckpt) and _same_from(str(ckpt), recorded, tmp_path / "copy")
    save_file({"w": torch.ones(4)}, ckpt / "model.safetensors")
    assert not _same_from(str(ckpt), recorded, ckpt)
    assert _same_from(str(ckpt), None, ckpt)


def test_a_run_killed_while_saving_its_processor_starts_again(pretrained, tmp_path):
    """Killed between the tokenizer's files and `processor_config.json` (the processor's, written last), the rerun
    builds and saves the processor again, rather than fail on the half-saved one with transformers' OSError."""
    out = tmp_path / "pre"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(pretrained / name, out / name)
    pretrain(out, steps=1, progress=False, val_batches=1, rows=2, seq_len=64, tokenizer_texts=200)
    assert read_summary(out)["complete"] and (out / "processor_config.json").is_file()

def test_sft_then_rl_and_rl_resume(pretrained, tmp_path, monkeypatch):
    sft_dir = sft(pretrained, tmp_path / "sft", steps=2, progress=False, val_batches=1)
    assert read_summary(sft_dir)["from"] == str(pretrained.resolve())
    with pytest.raises(ConfigError, match=r"other settings \(from '.*pretrain' -> '.*elsewhere'\)"):
        sft(tmp_path / "elsewhere", sft_dir, steps=2, progress=False, val_batches=1)
    monkeypatch.chdir(pretrained.parent)  # the same checkpoint named from another folder: the same run
    assert sft(Path("pretrain"), sft_dir, steps=2, progress=False) == sft_dir
    monkeypatch.undo()
    moved = tmp_path / "moved"  # a run folder copied elsewhere: its `from` has the recorded weights, the same run
    shutil.copytree(pretrained, moved / "pretrain")
    shutil.copytree(sft_dir, moved / "sft")
    assert sft(moved / "pretrain", moved / "sft", steps=2, progress=False) == moved / "sft"
    summary = read_summary(moved / "sft")
    del summary["from_weights"]  # written before they were recorded: the weights where `from` was still count
    (moved / "sft" / "training_summary.json").write_text(json.dumps(summary))
    assert sft(moved / "pretrain", moved / "sft", steps=2, progress=False) == moved / "sft"
    with pytest.raises(ConfigError, match=r"other settings \(from '.*pretrain' -> '.*sft'\)"):  # other weights
        sft(sft_dir, moved / "sft", steps=2, progress=False)
    # the tiny preset makes 2 optimizer steps per rollout batch: 4 steps are 2 batches, the cut falls between them
    assert get_preset("tiny").rl_algorithm.updates_per_batch == 2
    full = rl(sft_dir, tmp_path / "rl_full", steps=4, progress=False, checkpoint_every=1, prompts_per_family=2, k=2,
              max_new_tokens=6)
    reference = read_metrics(full / "metrics.jsonl")
    assert set(reference[0]) >= {"reward_mean", "response_length", "masked_fraction", "entropy"}
    assert any(k.startswith("reward/") for k in reference[0])
    assert (full / "plots" / "rewards.png").is_file()
    summary = read_summary(full)
    assert summary["updates_per_batch"] == 2 and 0 <= summary["masked_fraction"] <= 1
    assert summary["log_ratio_abs_mean"] > 0  # the second update of each batch sees a log-ratio
    assert set(summary["family_reward_first_fifth"]) == set(summary["families"])

    cut = tmp_path / "rl_cut"
    rl(sft_dir, cut, steps=2, progress=False, checkpoint_every=1, prompts_per_family=2, k=2, max_new_tokens=6)
    (cut / "training_summary.json").unlink()  # as if killed after the first rollout batch's checkpoint
    rl(sft_dir, cut, steps=4, progress=False, checkpoint_every=1, prompts_per_family=2, k=2, max_new_tokens=6)
    resumed = read_metrics(cut / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for i in (2, 3):
        assert resumed[i]["loss"] == reference[i]["loss"] and resumed[i]["reward_mean"] == reference[i]["reward_mean"]
    a, _ = load_checkpoint_dir(full)
    b, _ = load_checkpoint_dir(cut)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_training_starts_from_zero_expert_loads(pretrained, tmp_path):
    """`expert_load` is a non-persistent buffer: from_pretrained leaves it uninitialised, so training entry points
    zero it (else the first router-bias update follows garbage counts)."""
    from kimi_vl.text.moe import TopKRouter
    from kimi_vl.training.trainer import TrainConfig, Trainer

    model, _ = load_checkpoint_dir(pretrained)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for r in routers:
        r.expert_load.fill_(1e30)  # what uninitialised memory may hold
    Trainer(model, SimpleNamespace(batch=lambda index: None), TrainConfig(steps=1, progress=False), tmp_path)  # built only
    assert all(bool((r.expert_load == 0).all()) for r in routers)
    for r in routers:
        r.expert_load.fill_(1e30)
    model.language_model.model.reset_expert_loads()
    assert all(bool((r.expert_load == 0).all()) for r in routers)


def test_stage_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        sft(tmp_path / "missing", tmp_path / "out", steps=1, progress=False)
    with pytest.raises(ConfigError, match="unknown RL task families"):
        family_tasks(("audio",))
    with pytest.raises(ConfigError, match="unknown preset"):
        pretrain(tmp_path / "p", preset="huge", progress=False)


def test_a_seed_or_preset_beside_a_run_config_is_not_dropped(tmp_path, monkeypatch):
    """`pretrain(out, config=base, seed=s)` (a seed sweep over one resolved configuration) would train `base.seed`
    under every `s`: a seed or preset other than the RunConfig's is refused like any setting beside it; the same
    ones, or none, go through."""
    base = resolve("pretrain", "tiny", {"steps": 1})
    for stage, call in (("pretrain", lambda **kw: pretrain(tmp_path / "p", **kw)),
                        ("sft", lambda **kw: sft(tmp_path / "none", tmp_path / "s", **kw))):
        config = dataclasses.replace(base, stage=stage)
        for given in ({"seed": 1}, {"preset": "small"}, {"seed": 1, "lr": 1e-3}):
            with pytest.raises(ConfigError, match=rf"pass either a {stage} RunConfig or settings, not both"):
                call(config=config, **given)
    runs = []  # the configuration each call would train (a finished run is returned as it is)
    monkeypatch.setattr("kimi_vl.training.stages._finished", lambda out_dir, cfg, *a: runs.append(cfg) or True)
    pretrain(tmp_path / "p", config=base, seed=0, preset="tiny")
    pretrain(tmp_path / "p", seed=2, steps=1)
    assert runs[0] == base and runs[1] == dataclasses.replace(base, seed=2)


def test_a_bad_from_or_out_folder_is_a_clear_error(pretrained, tmp_path):
    """A `--from` folder whose config.json is not JSON, or that holds another kind of model, and an `--out` that is a
    file are refused before anything loads or trains, naming the path."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=re.escape(str(broken / "config.json"))):
        sft(broken, tmp_path / "out", steps=1, progress=False)
    foreign = tmp_path / "llama"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for stage in (sft, rl):
        with pytest.raises(CheckpointError, match=re.escape(f"{foreign} is a 'llama' checkpoint, not a kimi_vl one; "
                                                            "pass a folder written by a kimi-vl training stage")):
            stage(foreign, tmp_path / "out", steps=1, progress=False)
    afile = tmp_path / "afile"
    afile.touch()
    with pytest.raises(ConfigError, match=re.escape(f"--out {afile} is a file, not a directory; pass a directory")):
        sft(pretrained, afile, steps=1, progress=False)
    with pytest.raises(ConfigError, match=re.escape(f"--out {afile / 'run'} lies in {afile}, which is a file")):
        pretrain(afile / "run", steps=1, progress=False)
    assert afile.read_bytes() == b"" and not (tmp_path / "out").exists()


def test_cli_refuses_a_setting_out_of_range(pretrained, tmp_path, capsys):
    """`--max-grad-norm -1` would clip by flipping the gradient (gradient ascent): the command stops before training,
    naming the setting, its value and its range."""
    assert main(["train", "sft", "--from", str(pretrained), "--out", str(tmp_path / "x"), "--steps", "2",
                 "--max-grad-norm", "-1"]) == 2
    assert ("kimi-vl: error: max_grad_norm must be > 0 (or none/null to disable clipping), got -1."
            in capsys.readouterr().err)
    assert main(["train", "sft", "--from", str(pretrained), "--out", str(tmp_path / "x"), "--lr", "nan"]) == 2
    assert "lr must be finite and > 0, got nan." in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_gpu_preset_warns_that_it_would_run_on_the_cpu(monkeypatch, tmp_path):
    """`--preset small` without a CUDA device would train for days on the CPU: a stage (the quickstart's first, or
    `kimi-vl train`) says so when it resolves its configuration, before it loads or trains anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="'small' is a GPU recipe and no CUDA device is visible"):
        with pytest.raises(CheckpointError):  # the warning comes first
            sft(tmp_path / "missing", tmp_path / "out", preset="small")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError):
            sft(tmp_path / "missing", tmp_path / "out", preset="tiny")


def test_cli_train_rl(pretrained, tmp_path, capsys):
    assert main(["train", "rl", "--from", str(pretrained), "--out", str(tmp_path / "rl"), "--steps", "1",
                 "--families", "text"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^wrote .*rl \(1 step, mean reward [0-9.]+ in the first fifth of the steps, [0-9.]+ in the "
                     r"last, \d+ s\)$", captured.out.strip())
    assert re.search(r"^rl \(text\): 1/1 \(100%\), .* \| loss=[-0-9.]+, lr=[0-9.e-]+, reward=[0-9.]+$",
                     captured.err, re.M)  # the progress line of a log: RL steps show their mean reward
    line = summary_line({"steps": 2000, "final_loss": 0.4591, "val_loss": 0.63, "bad_records": 3, "wall_time_s": 787})
    assert line == "2000 steps, final loss 0.459, validation loss 0.630, 3 bad records skipped (data_errors.jsonl), 13.1 min"
    summary = json.loads((tmp_path / "rl" / "training_summary.json").read_text())
    assert summary["families"] == ["text"] and summary["steps"] == 1
    assert main(["train", "rl", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2


def test_stage_outputs_load_without_kimi_vl(pretrained, tmp_path):
    """A stage's output folder carries the remote code: a process in which kimi_vl cannot be imported loads it with
    `trust_remote_code=True` and computes the same logits and generation as kimi_vl does."""
    from tests.test_export import assert_same, reference_outputs, run_script, write_media

    png, mp4 = write_media(tmp_path)
    model, proc = load_checkpoint_dir(pretrained)
    body = """
    from transformers import AutoModelForImageTextToText, AutoProcessor
    model = AutoModelForImageTextToText.from_pretrained(MODEL, trust_remote_code=True).eval()
    proc = AutoProcessor.from_pretrained(MODEL, trust_remote_code=True)
    """
    got = run_script(body, tmp_path, block_kimi_vl=True, MODEL=pretrained, PNG=png, MP4=mp4)
    assert_same(got, reference_outputs({"model": model.eval(), "proc": proc, "png": png, "mp4": mp4}))


def test_rl_prompts_give_every_task_its_share_and_arms_the_same_text_prompts():
    """Each family's tasks come equally often over the steps (visual_math and grounding included), and adding the
    vision family adds its prompts without taking any text prompt away (the Vision-RL ablation's arms)."""
    import math
    from collections import Counter

    from kimi_vl.training.stages import RL_FAMILIES, world_prompts

    seen = Counter()
    steps = math.lcm(*(len(tasks) for tasks in RL_FAMILIES.values()))  # 4 prompts a step: whole cycles of each
    for step in range(steps):
        both = world_prompts(["text", "vision"], 4, seed=0, step=step)
        text = world_prompts(["text"], 4, seed=0, step=step)
        assert [s.task for s in both[:4]] == [s.task for s in text] and len(both) == 8
        assert [s.question for s in both[:4]] == [s.question for s in text]
        seen.update(s.task for s in both)
    assert set(seen) == set(RL_FAMILIES["text"]) | set(RL_FAMILIES["vision"])
    for family in ("text", "vision"):
        assert {seen[t] for t in RL_FAMILIES[family]} == {4 * steps // len(RL_FAMILIES[family])}, family


def test_family_rewards_average_each_familys_task_entries():
    from kimi_vl.training.stages import family_rewards

    rows = [{"reward/mc": 1.0, "reward/arithmetic": 0.0, "reward/count": 0.5, "reward_mean": 0.5},
            {"reward/mc": 0.5, "reward/color": 1.0, "reward/chart_bar": 0.0}]
    assert family_rewards(rows, ["text", "vision"]) == {"text": pytest.approx(0.5), "vision": pytest.approx(0.5)}
    assert family_rewards(rows[:1], ["vision"]) == {"vision": 0.5}
    assert family_rewards([{"reward/mc": 1.0}], ["text", "vision"]) == {"text": 1.0, "vision": None}


def test_a_stage_writes_its_checkpoint_without_transformers_bars_when_progress_is_off(tmp_path, monkeypatch):
    """`progress=False` (`--no-progress`) keeps transformers' bars out of a log at the stage's end too: the bar of
    writing the weights, as the one of loading them (`load_checkpoint_dir`)."""
    from kimi_vl import progress
    from kimi_vl.training.stages import _finish
    from tests.test_export import tiny_model, tiny_processor
    from tests.test_progress import Terminal

    proc = tiny_processor()
    model = tiny_model(proc)
    err = Terminal()
    monkeypatch.setattr(progress.sys, "stderr", err)
    monkeypatch.setattr("sys.stderr", err)  # where transformers' tqdm writes
    _finish("sft", model, model.state_dict(), proc, tmp_path / "off", {}, progress=False)
    assert "Writing model shards" not in err.getvalue()
    _finish("sft", model, model.state_dict(), proc, tmp_path / "on", {}, progress=True)
    assert "Writing model shards" in err.getvalue()  # the check can see the bar


def test_pretraining_steps_without_a_loss_target_are_skipped_and_counted(tmp_path, monkeypatch):
    """Users' documents of which one is a long video with a word of text: a batch that holds only its blocks has no
    loss target; the step is skipped (not stepped with a loss of 0), logged so, and counted in the summary."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # the source's name, "docs.jsonl", seeds its order: the same batches in any folder

    frames = []
    for i in range(48):  # 12 chunks of 4 frames
        pixels = np.random.default_rng(i).integers(0, 256, (56, 56, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / f"f{i}.png")
        frames.append(f"f{i}.png")
    docs = [{"text": "<video> ok", "videos": [frames]}] + [
        {"text": f"The quick brown fox jumps over the lazy dog number {i} and more words here."} for i in range(3)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    out = pretrain(tmp_path / "pre", sources=["docs.jsonl"], rows=2, seq_len=64, steps=6, vocab_size=300,
                   tokenizer_texts=50, progress=False)
    metrics = read_metrics(out / "metrics.jsonl")
    empty = [m["step"] for m in metrics if m.get("skip_reason") == "no targets"]
    assert empty and all(m["loss"] is None and m["skipped"] for m in metrics if m["step"] in empty)
    assert all(m["loss"] > 0 and not m["skipped"] for m in metrics if m["step"] not in empty)
    summary = read_summary(out)
    assert summary["steps_without_targets"] == summary["skipped_steps"] == len(empty)
    assert f"{len(empty)} step{'' if len(empty) == 1 else 's'} skipped without a loss target" in summary_line(summary)


def test_report_to_gets_the_stages_settings_as_hyperparameters(pretrained, tmp_path):
    """A tracker's hyperparameters are the run's settings: the stage, preset and seed and the data (and RL) settings
    too, not only the optimizer's and loop's, so runs compare by sequence length, data or seed there."""
    out = sft(pretrained, tmp_path / "sft", steps=1, rows=1, seed=3, report_to="tensorboard", progress=False)
    (hparams,) = (out / "trackers" / "kimi-vl").glob("*/hparams.yml")
    text = hparams.read_text()
    for line in ("stage: sft", "preset: tiny", "seed: 3", "seq_len: 512", "rows: 1", "lr: 0.0005", "steps: 1"):
        assert line in text.splitlines(), line
