"""The benchmark registry: a toy benchmark registered from outside the runner is evaluated end to end (load, prompts,
generation with the response cache, extraction, scoring, reports, the CLI) by a stub engine with known answers."""

import json

import pytest

from kimi_vl.cli import main
from kimi_vl.errors import ConfigError
from kimi_vl.eval import (
    BENCHMARKS,
    Benchmark,
    BenchmarkData,
    EvalConfig,
    Item,
    Prompts,
    evaluate,
    parse_benchmarks,
    register,
    unregister,
)
from kimi_vl.eval.generation import Engine

WORDS = ("red", "green", "blue", "cyan", "pink", "gold")


class EchoEngine(Engine):
    """Answers every prompt with its last word; records the budgets and prompts it was given."""

    def __post_init__(self) -> None:
        self.eos_token_ids = []
        self.calls = []

    def info(self):
        return {"name": self.name, "class": type(self).__name__}

    def generate(self, requests, *, max_new_tokens, stop=()):
        self.calls.append((max_new_tokens, tuple(stop), [r.text for r in requests]))
        return [" " + r.text.split()[-1].upper() for r in requests]


class Colours(Benchmark):
    """Repeat a colour; the prompt ends with the right colour for two items in three (so the echo engine scores
    4/6), and `extract` lower-cases the response."""

    name = "colours"
    title = "Colours"
    max_new_tokens = 5

    def load(self, config, work_dir):
        rows = {f"c{i}": {"answer": w, "hint": w if i % 3 else "black", "group": "odd" if i % 2 else "even"}
                for i, w in enumerate(WORDS)}
        rows = dict(list(rows.items())[: config.limit])
        return BenchmarkData(rows, "toy rows")

    def build_prompts(self, data, engine, config):
        items = [Item(i, f"Repeat the colour {row['answer']}: {row['hint']}", False, row) for i, row in data.rows.items()]
        return Prompts(items, self.budget(config), ("STOP",), {"source": data.source})

    def extract(self, prompts, responses, run):
        return {i: responses[i].strip().lower() for i in responses}

    def score(self, prompts, responses, answers, run):
        right = {it.id: answers[it.id] == it.row["answer"] for it in prompts.items}
        (run.out_dir / f"results.{self.name}.json").write_text(json.dumps(right))
        groups = {}
        for it in prompts.items:
            g = groups.setdefault(it.row["group"], {"correct": 0, "total": 0})
            g["correct"] += right[it.id]
            g["total"] += 1
        for g in groups.values():
            g["accuracy"] = g["correct"] / g["total"]
        correct = sum(right.values())
        return {"accuracy": correct / len(right), "correct": correct, "total": len(right), "categories": groups,
                "settings": {"source": prompts.info["source"]}, "deviations": []}

    def baselines(self, data):
        return {"chance": 0.0, "constant": 1 / len(data.rows), "constant_answer": "always red"}


@pytest.fixture
def colours():
    benchmark = register(Colours())
    yield benchmark
    unregister(benchmark.name)


def test_registered_benchmark_runs_end_to_end(tmp_path, colours):
    engine = EchoEngine(model=None, tokenizer=None, name="echo")
    seen = []
    report = evaluate(engine, "colours", tmp_path, EvalConfig(batch_size=4, progress=False),
                      progress_callback=lambda *a: seen.append(a))
    entry = report["benchmarks"]["colours"]
    assert entry["benchmark"] == "colours" and entry["title"] == "Colours" and entry["proxy"] is False
    assert (entry["correct"], entry["total"]) == (4, 6) and entry["categories"]["even"]["correct"] == 2
    assert [(n, s) for n, s, _ in engine.calls] == [(5, ("STOP",))] * 2  # the benchmark's budget, 2 batches of <= 4
    assert seen == [("colours", 4, 6), ("colours", 6, 6)]
    assert json.loads((tmp_path / "results.colours.json").read_text())["c0"] is False
    assert len((tmp_path / "responses.colours.jsonl").read_text().splitlines()) == 6
    assert "| Colours | 66.67% | 4 | 6 | 0.00% | 16.67% |" in (tmp_path / "report.md").read_text()
    assert entry["constant_answer"] == "always red"
    assert (tmp_path / "colours_categories.png").stat().st_size > 0

    engine.calls.clear()  # cached responses are reused; a config budget overrides the benchmark's
    assert evaluate(engine, "colours", tmp_path, EvalConfig(progress=False))["benchmarks"]["colours"]["correct"] == 4
    assert engine.calls == []
    evaluate(engine, ["colours"], tmp_path / "b", EvalConfig(max_new_tokens=2, limit=3, progress=False))
    assert [(n, len(texts)) for n, _, texts in engine.calls] == [(2, 3)]


def test_cli_evaluates_a_registered_benchmark(tmp_path, colours, monkeypatch, capsys):
    engines = []

    def load(cls, model_dir, **kwargs):
        engines.append(EchoEngine(model=None, tokenizer=None, name=str(model_dir)))
        engines[-1].kwargs = kwargs
        return engines[-1]

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(load))
    out = tmp_path / "out"
    assert main(["eval", "--model", "m", "--benchmarks", "colours", "--out", str(out), "--limit", "3",
                 "--no-progress", "--dtype", "float32"]) == 0
    assert "Colours: 66.67% (2/3)" in capsys.readouterr().out
    assert engines[-1].kwargs == {"device": None, "dtype": "float32", "trust_remote_code": False,
                                 "progress": False}
    assert main(["eval", "--model", "m", "--benchmarks", "colour", "--out", str(out)]) == 2
    assert "unknown benchmark 'colour'; choose from mmlu_pro, mathvista, mmlu_pro_synth, mathvista_synth, colours" \
        in capsys.readouterr().err


def test_readme_names_every_method_a_benchmark_must_implement():
    """README's recipe for a new benchmark names every abstract method of `Benchmark` (a subclass lacking one cannot
    be instantiated)."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    recipe = readme[readme.index("- A benchmark is one registered object"):]
    recipe = recipe[: recipe.index("\n\n")]
    assert Benchmark.__abstractmethods__ and all(f"`{name}`" in recipe for name in Benchmark.__abstractmethods__)


def test_aliases_follow_the_registry(colours):
    assert [b.name for b in parse_benchmarks("all")] == list(BENCHMARKS)[:4] + ["colours"]
    assert [b.name for b in parse_benchmarks(["proxies"])] == ["mmlu_pro_synth", "mathvista_synth"]
    assert [b.name for b in parse_benchmarks("colours,all")][0] == "colours"


def test_register_checks_names(colours):
    with pytest.raises(ConfigError, match="already registered"):
        register(Colours())
    for name in ("proxies", "Bad-Name", ""):
        with pytest.raises(ConfigError):
            register(type("Named", (Colours,), {"name": name})())
    with pytest.raises(ConfigError, match="Benchmark instance"):
        register(Colours)
    with pytest.raises(ConfigError, match="no benchmark named"):
        unregister("nothing")
    with pytest.raises(ConfigError, match="no benchmark given"):
        parse_benchmarks(" , ")
    with pytest.raises(TypeError):  # all four steps are required
        type("Partial", (Benchmark,), {"name": "partial", "load": Colours.load})()
