"""ViT training (`kimi_vl.training.vit`, the `vit` stage): its targets, its batches, its read-outs, the stage's
checkpoint, and joint pre-training starting from that tower."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from kimi_vl.cli import main
from kimi_vl.data.screencast import COLORS as PAGE_COLORS
from kimi_vl.data.world import COLORS, item_key, make_sample, sample_rng, split_of
from kimi_vl.errors import CheckpointError, ConfigError
from kimi_vl.training.presets import get_preset
from kimi_vl.training.stages import build_model, build_processor, load_vision_tower, pretrain, read_summary, vit
from kimi_vl.training.trainer import read_metrics
from kimi_vl.training.vit import VIT_TARGETS, Readout, check_tasks, images_per_task, vit_image, vit_samples


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vit") / "vit"
    vit(out, steps=3, images_per_step=8, vit_tasks={"count": 2, "chart_bar": 1}, progress=False)
    return out


def _labels(task, sample):
    return [t.label(sample) for t in VIT_TARGETS[task]]


def test_targets_are_read_off_the_samples_meta():
    count = make_sample("count", sample_rng(0, 3))
    assert _labels("count", count) == [count.meta["count"] - 1] == [int(count.answer) - 1]
    chart = make_sample("chart_bar", sample_rng(0, 5))
    values = chart.meta["values"]
    tallest, largest, smallest = _labels("chart_bar", chart)
    assert values[tallest] == max(values) and largest == max(values) - 1 and smallest == min(values) - 1
    shape = make_sample("color", sample_rng(0, 2))
    assert list(COLORS)[_labels("color", shape)[0]] == shape.answer == shape.meta["objects"][0]["color"]
    page = make_sample("page_color", sample_rng(0, 4))
    header, section = (list(PAGE_COLORS)[i] for i in _labels("page_color", page))
    assert (header, section) == (page.video.spec.header_color, page.video.spec.sections[0].color)
    assert vit_image(page) is page.video.frames[0] and vit_image(shape) is shape.image
    top = np.asarray(page.video.frames[0])[2, 80]  # the header's background, under no text at its top row
    assert tuple(top) == PAGE_COLORS[header]
    for task, targets in VIT_TARGETS.items():  # every label inside its classes, over many draws
        for i in range(200):
            s = make_sample(task, sample_rng(1, i))
            assert all(0 <= y < t.classes for y, t in zip(_labels(task, s), targets))


def test_images_per_task_split_the_step_by_weight():
    assert images_per_task({"count": 20, "chart_bar": 12}, 32) == {"count": 20, "chart_bar": 12}
    assert images_per_task({"count": 1, "chart_bar": 1}, 5) in ({"count": 3, "chart_bar": 2},
                                                                {"count": 2, "chart_bar": 3})
    assert sum(images_per_task({"count": 0.3, "chart_bar": 0.7}, 7).values()) == 7
    for bad, message in (({}, "empty"), ({"shape": 1}, r"names \['shape'\]"), ({"count": -1}, ">= 0"),
                         ({"count": 0}, "not all 0"), ({"count": math.nan}, "finite")):
        with pytest.raises(ConfigError, match=message):
            check_tasks(bad)


def test_a_steps_images_are_a_pure_function_of_seed_and_step_and_training_items():
    tasks = {"count": 3, "chart_bar": 2}
    first, again = vit_samples(tasks, 5, seed=4, step=7), vit_samples(tasks, 5, seed=4, step=7)
    assert [t for t, _ in first] == ["count"] * 3 + ["chart_bar"] * 2
    assert [s.image.tobytes() for _, s in first] == [s.image.tobytes() for _, s in again]
    other = vit_samples(tasks, 5, seed=4, step=8)
    assert all(a.image.tobytes() != b.image.tobytes() for (_, a), (_, b) in zip(first, other))
    # every image is a training item: the proxies' held-out charts and scenes are never drawn
    assert all(split_of(item_key(s)) == "train" for step in range(20) for _, s in vit_samples(tasks, 5, 4, step))


def test_a_readout_reads_each_image_from_its_own_patches():
    torch.manual_seed(0)
    head = Readout(8, [6, 20])
    x = torch.randn(10, 8)
    first = head(x, [4, 6])
    changed = x.clone()
    changed[4:] += 5.0  # the second image's patches only
    second = head(changed, [4, 6])
    assert [tuple(t.shape) for t in first] == [(2, 6), (2, 20)]
    assert torch.equal(first[0][0], second[0][0]) and not torch.allclose(first[0][1], second[0][1])


def test_the_vit_stage_writes_a_moonvit_checkpoint_with_held_out_accuracies(vit_dir):
    summary = read_summary(vit_dir)
    assert summary["complete"] and summary["stage"] == "vit" and summary["images"] == 3 * 8
    assert set(summary["val_accuracy"]) == {"count.objects", "chart_bar.tallest", "chart_bar.largest",
                                            "chart_bar.smallest"}
    assert all(0 <= a <= 1 for a in summary["val_accuracy"].values())
    assert json.loads((vit_dir / "config.json").read_text())["model_type"] == "kimi_vl_moonvit"
    assert (vit_dir / "preprocessor_config.json").is_file() and (vit_dir / "plots" / "loss.png").is_file()
    assert [m["step"] for m in read_metrics(vit_dir / "metrics.jsonl")] == [1, 2, 3]
    vit(vit_dir, steps=3, images_per_step=8, vit_tasks={"count": 2, "chart_bar": 1}, progress=False)  # finished
    with pytest.raises(ConfigError, match=r"finished vit run with other settings \(images_per_step 8 -> 16\)"):
        vit(vit_dir, steps=3, images_per_step=16, vit_tasks={"count": 2, "chart_bar": 1}, progress=False)


def test_vit_training_learns_to_count_held_out_scenes(tmp_path):
    """300 steps of 32 counting scenes: the tower and its read-out count held-out scenes above chance (1/6 = 16.7%;
    30% here on 300 scenes, whose standard error is 2.6 points; 63% after 1000 steps of the preset's mix)."""
    out = tmp_path / "vit"
    vit(out, steps=300, vit_tasks={"count": 1}, progress=False)
    accuracy = read_summary(out)["val_accuracy"]
    assert set(accuracy) == {"count.objects"} and accuracy["count.objects"] > 0.23


def test_pretrain_starts_from_the_vit_tower(vit_dir, tmp_path):
    preset = get_preset("tiny")
    processor = build_processor(preset.data["pretrain"], texts=["a few words"] * 20)
    model = build_model(preset, processor)
    load_vision_tower(model, vit_dir)
    from kimi_vl.vision import MoonViTModel

    tower = MoonViTModel.from_pretrained(vit_dir).state_dict()
    assert all(torch.equal(v, tower[k]) for k, v in model.vision_tower.state_dict().items())
    out = tmp_path / "pretrain"
    pretrain(out, steps=1, progress=False, val_batches=1, tokenizer_texts=300, vision_tower=str(vit_dir))
    summary = read_summary(out)
    assert summary["from"] == str(vit_dir.resolve()) and summary["from_weights"][0]["name"] == "model.safetensors"


def test_a_vision_tower_of_another_kind_or_shape_is_refused(vit_dir, tmp_path):
    preset = get_preset("tiny")
    model = build_model(preset, build_processor(preset.data["pretrain"], texts=["a few words"] * 20))
    with pytest.raises(CheckpointError, match="holds no config.json"):
        load_vision_tower(model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_vl"}))
    with pytest.raises(CheckpointError, match="not a kimi_vl_moonvit tower"):
        load_vision_tower(model, tmp_path)
    wide = shutil.copytree(vit_dir, tmp_path / "wide")  # a vit stage's folder, its tower swapped for a wider one
    from kimi_vl.vision import MoonViTConfig, MoonViTModel

    MoonViTModel(MoonViTConfig(**{**preset.vision, "hidden_size": 32, "intermediate_size": 64})).save_pretrained(wide)
    with pytest.raises(CheckpointError, match="another shape than this preset's tower"):
        load_vision_tower(model, wide)


def test_the_cli_trains_the_vit_stage(tmp_path, capsys):
    main(["train", "vit", "--out", str(tmp_path / "v"), "--steps", "1", "--images-per-step", "4",
          "--vit-tasks", "count=1", "--no-progress"])
    assert "wrote" in capsys.readouterr().out
    assert read_summary(tmp_path / "v")["tasks"] == {"count": 1.0}


def test_vision_lr_scale_zero_holds_the_tower_while_the_language_model_trains(vit_dir, tmp_path):
    """`vision_lr_scale`: the tower's parameters get groups of their own at `scale * lr` (weight decay scaling
    with it); at 0 joint pre-training keeps the ViT stage's tower exactly."""
    from safetensors.torch import load_file

    out = tmp_path / "pretrain"
    pretrain(out, steps=2, progress=False, val_batches=1, tokenizer_texts=300, vision_tower=str(vit_dir),
             vision_lr_scale=0.0)
    joint, tower = load_file(out / "model.safetensors"), load_file(vit_dir / "model.safetensors")
    assert all(torch.equal(joint[f"vision_tower.{k}"], v) for k, v in tower.items())
    start = build_model(get_preset("tiny"), build_processor(get_preset("tiny").data["pretrain"],
                                                            texts=["a few words"] * 20))
    assert not torch.equal(joint["multi_modal_projector.mlp.fc1.weight"],
                           start.state_dict()["multi_modal_projector.mlp.fc1.weight"])


def test_the_trainer_sets_the_towers_rate_to_its_share_of_the_step(tmp_path):
    from kimi_vl.text import KimiTextConfig, KimiTextForCausalLM
    from kimi_vl.training.trainer import TrainConfig, build_optimizer

    preset = get_preset("tiny")
    model = build_model(preset, build_processor(preset.data["pretrain"], texts=["a few words"] * 20))
    optimizer = build_optimizer(model, TrainConfig(vision_lr_scale=0.25))
    tower = {id(p) for p in model.vision_tower.parameters()}
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        assert ids <= tower and group["lr_scale"] == 0.25 if ids & tower else "lr_scale" not in group
    assert sum(len(g["params"]) for g in optimizer.param_groups) == sum(1 for _ in model.parameters())
    text = KimiTextForCausalLM(KimiTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, kda_num_heads=2, kda_head_dim=8))
    with pytest.raises(ConfigError, match="has no vision_tower"):
        build_optimizer(text, TrainConfig(vision_lr_scale=0.5))
    with pytest.raises(ConfigError, match="vision_lr_scale must be >= 0"):
        TrainConfig(vision_lr_scale=-1)
