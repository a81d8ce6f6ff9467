"""The Vision-RL ablation: confidence intervals, and the command end to end on the tiny preset (slow)."""

import json
import math
import statistics
from pathlib import Path

import pytest

from kimi_vl.cli import main
from kimi_vl.errors import ConfigError
from kimi_vl.eval.ablation import ablation_markdown, mean_ci, t95


def test_mean_ci_uses_student_t():
    values = [0.1, 0.3, 0.2, 0.4]
    m, half = mean_ci(values)
    assert m == pytest.approx(0.25)
    assert half == pytest.approx(3.182 * statistics.stdev(values) / 2)
    assert math.isnan(mean_ci([0.5])[1])
    assert t95(1) == 12.706 and t95(12) == 2.228 and t95(100) == 2.0
    with pytest.raises(ConfigError):
        t95(0)


# Exact two-sided 95% t quantiles (the root of the regularized incomplete beta I_{df/(df+t^2)}(df/2, 1/2) = 0.05).
EXACT_T95 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646, 8: 2.3060, 9: 2.2622,
             10: 2.2281, 11: 2.2010, 14: 2.1448, 29: 2.0452, 30: 2.0423, 31: 2.0395, 35: 2.0301, 40: 2.0211,
             50: 2.0086, 60: 2.0003, 80: 1.9901, 120: 1.9799, 200: 1.9719, 1000: 1.9623}


def test_t95_is_exact_for_few_seeds_and_never_narrower_than_exact():
    """n = 2..11 seeds get the exact quantile; more get a tabulated one at least as large (to its 3 decimals), so
    no interval is narrower than the exact 95% one (31-120 degrees of freedom used the normal 1.96, up to 3.9%
    too narrow)."""
    for df, exact in EXACT_T95.items():
        assert t95(df) >= exact - 5e-4, df
        if df <= 10:
            assert t95(df) == pytest.approx(exact, abs=5e-4)


def test_markdown_labels_proxies_and_states_sizes():
    result = {"sft_checkpoint": "sft", "preset": "tiny", "rl_steps": 5, "rl_prompts_per_step": 8, "rl_k": 4,
              "seeds": 2, "proxies": True, "items": {"mmlu_pro_synth": 10, "mathvista_synth": 400},
              "eval_options": {"num_shots": 0},
              "baselines": {"mmlu_pro_synth": {"chance": 0.1, "constant": 0.143, "sft": 0.25}},
              "summary": {"mmlu_pro_synth": {"text": (0.2, 0.1), "text+vision": (0.3, 0.05), "delta": (0.1, 0.2)}}}
    md = ablation_markdown(result)
    assert "| mmlu_pro_synth (synthetic proxy) | 10.0 | 14.3 | 25.0 | 20.0 ± 10.0 | 30.0 ± 5.0 | 10.0 ± 20.0 |" in md
    assert "preset `tiny`" in md and "5 optimizer steps, 1 per rollout batch of 8 text prompts" in md
    assert "x 4 responses" in md and "not MMLU-Pro" in md
    assert "Items per benchmark: mmlu_pro_synth 10, mathvista_synth 400; evaluation options: {'num_shots': 0}" in md
    assert "1 optimizer step, 1 per rollout batch" in ablation_markdown({**result, "rl_steps": 1})
    assert "Mean reward at the start" not in md  # no reward figures recorded: nothing claimed


@pytest.mark.parametrize("limit, data_dir, expected", [
    (None, None, {"mmlu_pro_synth": 140, "mathvista_synth": 400}),  # the proxies' default draws
    (5, None, {"mmlu_pro_synth": 5, "mathvista_synth": 5}),
    (None, "data", {"mmlu_pro": None, "mathvista": None}),  # real benchmarks: every item
])
def test_ablation_evaluates_each_benchmark_on_its_own_item_count(tmp_path, monkeypatch, limit, data_dir, expected):
    from kimi_vl.eval import ablation

    calls = []

    def fake_evaluate(engine, benchmarks, out_dir, config):
        calls.append((engine, benchmarks[0], config.limit, Path(out_dir).name))
        return {"benchmarks": {benchmarks[0]: {"accuracy": 0.5 if engine == "sft" else 0.6, "chance": 0.1,
                                               "constant": 0.2}}}

    monkeypatch.setattr(ablation, "rl", lambda *args, **kwargs: None)
    monkeypatch.setattr(ablation, "read_summary", lambda path: {})
    monkeypatch.setattr(ablation.Engine, "from_pretrained",
                        classmethod(lambda cls, model_dir, **kwargs: "sft" if Path(model_dir).name == "sft" else "rl"))
    monkeypatch.setattr(ablation, "evaluate", fake_evaluate)
    monkeypatch.setattr(ablation, "plot_ablation", lambda result, path: path)
    result = ablation.vision_rl_ablation("sft", tmp_path, seeds=2, limit=limit, data_dir=data_dir, progress=False)
    assert result["items"] == expected
    assert len(calls) == (2 * 2 + 1) * len(expected)  # (seeds x arms + the SFT checkpoint) x benchmarks
    assert {(b, n, d) for _, b, n, d in calls} == {(b, n, b) for b, n in expected.items()}
    assert [c[0] for c in calls[:len(expected)]] == ["sft"] * len(expected)
    assert result["baselines"] == {b: {"chance": 0.1, "constant": 0.2, "sft": 0.5} for b in expected}
    assert all(v == [0.6, 0.6] for arm in result["scores"].values() for v in arm.values())


def test_ablation_shows_the_whole_jobs_progress(tmp_path, monkeypatch):
    """One line per RL run over the whole ablation (each run's RL and evaluation show only their own): the run now
    going, the runs done and the time left; a rerun counts the runs it reuses as done from the start."""
    import io

    from kimi_vl import progress
    from kimi_vl.eval import ablation

    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ablation, "rl", lambda *args, **kwargs: clock.__setitem__(0, clock[0] + 60))
    monkeypatch.setattr(ablation, "read_summary", lambda path: {})
    monkeypatch.setattr(ablation.Engine, "from_pretrained", classmethod(lambda cls, model_dir, **kwargs: None))
    monkeypatch.setattr(ablation, "evaluate", lambda engine, benchmarks, out_dir, config: {"benchmarks": {
        benchmarks[0]: {"accuracy": 0.5, "chance": 0.1, "constant": 0.2}}})
    monkeypatch.setattr(ablation, "plot_ablation", lambda result, path: path)
    monkeypatch.setattr(progress.sys, "stderr", log := io.StringIO())  # a log file: whole lines
    ablation.vision_rl_ablation("sft", tmp_path, seeds=2, limit=1, progress=True)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("vision-rl ablation")]
    assert lines == ["vision-rl ablation [text, seed 0]: 0/4 (0%), 00:00 elapsed",
                     "vision-rl ablation [text+vision, seed 0]: 1/4 (25%), 60 s/run, 01:00 elapsed, 03:00 left",
                     "vision-rl ablation [text, seed 1]: 2/4 (50%), 60 s/run, 02:00 elapsed, 02:00 left",
                     "vision-rl ablation [text+vision, seed 1]: 3/4 (75%), 60 s/run, 03:00 elapsed, 01:00 left",
                     "vision-rl ablation [done]: 4/4 (100%), 60 s/run, 04:00 elapsed, 00:00 left"]
    log.seek(0), log.truncate()
    monkeypatch.setattr(ablation, "stage_complete", lambda path: "seed0" in str(path))  # seed 0's runs: reused
    ablation.vision_rl_ablation("sft", tmp_path, seeds=2, limit=1, progress=True)
    lines = [line for line in log.getvalue().splitlines() if line.startswith("vision-rl ablation")]
    assert lines[0] == "vision-rl ablation [text, seed 0]: 2/4 (50%), 00:00 elapsed" and lines[-1].startswith(
        "vision-rl ablation [done]: 4/4 (100%)")


def test_a_rerun_with_paths_spelled_otherwise_evaluates_the_same_engines(tmp_path, monkeypatch):
    """The response caches are keyed on the evaluated engine's name: a rerun that gives --from and --out as absolute
    paths instead of relative ones (or from another directory) names every model as the first run did, so its
    cached responses are reused rather than generated again."""
    from kimi_vl.eval import ablation

    names = []
    monkeypatch.setattr(ablation, "rl", lambda *args, **kwargs: None)
    monkeypatch.setattr(ablation, "read_summary", lambda path: {})
    monkeypatch.setattr(ablation.Engine, "from_pretrained",
                        classmethod(lambda cls, model_dir, **kwargs: names.append(str(model_dir))))
    monkeypatch.setattr(ablation, "evaluate", lambda engine, benchmarks, out_dir, config: {"benchmarks": {
        benchmarks[0]: {"accuracy": 0.5, "chance": 0.1, "constant": 0.2}}})
    monkeypatch.setattr(ablation, "plot_ablation", lambda result, path: path)
    monkeypatch.chdir(tmp_path)
    ablation.vision_rl_ablation("sft", "out", seeds=2, limit=1, progress=False)
    first, names[:] = names[:], []
    ablation.vision_rl_ablation(tmp_path / "sft", tmp_path / "out", seeds=2, limit=1, progress=False)
    assert names == first and len(first) == 5 and first[0] == str(tmp_path.resolve() / "sft")


def test_a_single_seed_writes_standard_json(tmp_path, monkeypatch):
    """With one seed the intervals have no half-width: ablation.json says null (standard JSON), the table no ±."""
    from kimi_vl.eval import ablation

    monkeypatch.setattr(ablation, "rl", lambda *args, **kwargs: None)
    monkeypatch.setattr(ablation, "read_summary", lambda path: {})
    monkeypatch.setattr(ablation.Engine, "from_pretrained", classmethod(lambda cls, model_dir, **kwargs: None))
    monkeypatch.setattr(ablation, "evaluate", lambda engine, benchmarks, out_dir, config: {"benchmarks": {
        benchmarks[0]: {"accuracy": 0.5, "chance": 0.1, "constant": 0.2}}})
    monkeypatch.setattr(ablation, "plot_ablation", lambda result, path: path)
    ablation.vision_rl_ablation("sft", tmp_path, seeds=1, limit=1, progress=False)

    def refuse(constant):
        raise ValueError(f"{constant} is not standard JSON")

    saved = json.loads((tmp_path / "ablation.json").read_text(), parse_constant=refuse)
    assert saved["summary"]["mmlu_pro_synth"] == {"text": [0.5, None], "text+vision": [0.5, None], "delta": [0.0, None]}
    assert "| 50.0 | 50.0 | 0.0 |" in (tmp_path / "ablation.md").read_text()


@pytest.mark.parametrize("vision, informative", [(0.25, True), (0.01, False)])
def test_markdown_reports_the_start_reward_and_flags_a_vision_arm_without_reward(vision, informative):
    result = {"sft_checkpoint": "sft", "preset": "tiny", "rl_steps": 20, "rl_updates_per_batch": 2,
              "rl_prompts_per_step": 4, "rl_k": 4, "seeds": 3, "proxies": True, "items": {"mmlu_pro": None},
              "eval_options": {},
              "start_reward": {"text": {"text": 0.4}, "text+vision": {"text": 0.41, "vision": vision}},
              "summary": {}}
    md = ablation_markdown(result)
    assert f"text tasks 0.410, vision tasks {vision:.3f}" in md
    assert ("not informative" in md) is not informative


@pytest.mark.slow
def test_ablation_command_end_to_end(tmp_path):
    from kimi_vl.eval.proxies import PROXY_EVAL_CONFIG
    from kimi_vl.training.stages import pretrain, sft

    pre = pretrain(tmp_path / "pre", steps=2, progress=False, val_batches=1)
    sft_dir = sft(pre, tmp_path / "sft", steps=2, progress=False, val_batches=1)
    out = tmp_path / "ablation"
    assert main(["ablate", "vision-rl", "--from", str(sft_dir), "--out", str(out), "--seeds", "2", "--steps", "1",
                 "--limit", "3"]) == 0
    result = json.loads((out / "ablation.json").read_text())
    assert result["benchmarks"] == ["mmlu_pro_synth", "mathvista_synth"] and result["proxies"]
    assert result["items"] == {"mmlu_pro_synth": 3, "mathvista_synth": 3}
    assert set(result["baselines"]) == set(result["benchmarks"]) and (out / "sft_eval" / "mathvista_synth").is_dir()
    assert result["eval_options"] == PROXY_EVAL_CONFIG.changes()  # the quickstart's proxy settings, comparable
    for arm in ("text", "text+vision"):
        assert all(len(v) == 2 for v in result["scores"][arm].values())
    assert set(result["start_reward"]["text"]) == {"text"} and set(result["start_reward"]["text+vision"]) == {
        "text", "vision"}
    assert all(0 <= r <= 1 for rewards in result["start_reward"].values() for r in rewards.values())
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    assert "Vision-RL ablation" in (out / "ablation.md").read_text()
