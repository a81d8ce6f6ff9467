"""The eval runner end to end on local fixture files: a tiny random transformers causal LM (text only) and a tiny
Kimi-VL model (with images), reports, the CLI entry points, and resuming an interrupted run."""

import argparse
import dataclasses
import json
import random
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import LlamaConfig, LlamaForCausalLM

from kimi_vl.cli import main
from kimi_vl.errors import CheckpointError, ConfigError
from kimi_vl.eval import DataUnavailableError, EvalConfig, parse_benchmarks, runner
from kimi_vl.eval import mathvista as mv
from kimi_vl.eval.generation import Engine, cut_at_stop, resolve_device
from kimi_vl.tokenization import IM_USER, IMAGE_PROMPT, build_tokenizer
from tests.test_export import tiny_model, tiny_processor

MMLU_TEST_IDS = (7918, 8239, 10717, 10549)  # two math, two computer-science rows of the fixture
MMLU_VAL = {8790: "A: Let's think step by step. 8 * 4 = 32. The answer is (I).",
            7818: "A: Let's think step by step. The opposite is 7. The answer is (F).",
            10717: "A: Let's think step by step. 8 >> 1 = 4. The answer is (E)."}
MATHVISTA_PIDS = ("5", "6", "7")  # multiple choice, free-form integer rows of testmini


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, benchmark_samples):
    """DIR/mmlu_pro/{test.parquet,validation.jsonl} and DIR/mathvista/{testmini.json,images/} from the fixtures."""
    root = tmp_path_factory.mktemp("data")
    rows = {}
    with open(benchmark_samples / "mmlu_pro" / "llama2_7b_5shot_outputs_sample.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows[r["question_id"]] = {k: r[k] for k in ("question_id", "question", "options", "answer", "answer_index",
                                                        "category", "src")}
    (root / "mmlu_pro").mkdir()
    pq.write_table(pa.Table.from_pylist([{**rows[q], "cot_content": ""} for q in MMLU_TEST_IDS]),
                   root / "mmlu_pro" / "test-00000-of-00001.parquet")
    (root / "mmlu_pro" / "validation.jsonl").write_text(
        "".join(json.dumps({**rows[q], "cot_content": c}) + "\n" for q, c in MMLU_VAL.items()), encoding="utf-8")
    testmini = json.loads((benchmark_samples / "mathvista" / "testmini.json").read_text(encoding="utf-8"))
    (root / "mathvista" / "images").mkdir(parents=True)
    (root / "mathvista" / "testmini.json").write_text(json.dumps({p: testmini[p] for p in MATHVISTA_PIDS}))
    for i, pid in enumerate(MATHVISTA_PIDS):
        Image.new("RGB", (40 + 8 * i, 30), (40 * i, 120, 200)).save(root / "mathvista" / "images" / f"{pid}.jpg")
    return root


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama with a small byte-level tokenizer (with a chat template), saved."""
    rng = random.Random(0)
    words = "question options answer think step the is of a what value compute python".split()
    tok = build_tokenizer([" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)], 300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    proc = tiny_processor()
    tiny_model(proc).save_pretrained(path)
    proc.save_pretrained(path)
    return path


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _check_outputs(out, report, benchmarks):
    for name in benchmarks:
        entry = report["benchmarks"][name]
        assert 0.0 <= entry["accuracy"] <= 1.0 and entry["total"] > 0
        assert (out / f"{name}_categories.png").stat().st_size > 0
        assert len(_lines(out / f"responses.{name}.jsonl")) == entry["total"]
        assert (out / f"results.{name}.json").is_file()
    saved = json.loads((out / "report.json").read_text())
    assert set(saved["benchmarks"]) == set(benchmarks)
    return (out / "report.md").read_text()


def test_tiny_causal_lm_end_to_end(tmp_path, data_dir, llama_dir):
    out = tmp_path / "out"
    report = runner.evaluate(llama_dir, "mmlu_pro,mathvista", out, EvalConfig(
        data_dir=data_dir, batch_size=2, max_new_tokens=3, mathvista_extractor="self", progress=False))
    md = _check_outputs(out, report, ["mmlu_pro", "mathvista"])
    mmlu = report["benchmarks"]["mmlu_pro"]
    assert mmlu["total"] == 4 and set(mmlu["categories"]) == {"math", "computer science"}
    assert mmlu["settings"]["format"] == "official" and "format=official," in md  # the raw prompt, by default
    results = json.loads((out / "results.mmlu_pro.json").read_text())
    assert [(r["category"], r["shots"]) for r in results] == [("computer science", 1)] * 2 + [("math", 2)] * 2
    assert all("pred" in r and "model_outputs" in r for r in results)
    for category, entry in mmlu["categories"].items():  # each MMLU-Pro category beside its own baselines
        rows = [r for r in results if r["category"] == category]
        assert entry["chance"] == pytest.approx(sum(1 / len(r["options"]) for r in rows) / len(rows))
        top = max(sum(r["answer"] == a for r in rows) for a in {r["answer"] for r in rows})
        assert entry["constant"] == pytest.approx(top / len(rows)) and entry["constant_answer"].startswith("always (")
    mathvista = report["benchmarks"]["mathvista"]
    scores = json.loads((out / "scores.mathvista.json").read_text())
    assert scores["average"]["total"] == 3 and list(scores)[1:] == list(mv.SCORE_KEYS)
    assert mathvista["settings"]["images"] is False
    for key in ("category", "task"):  # the official breakdowns, MathVista's categories (general-vqa, ...) included
        for value, s in scores[key].items():
            label = mv.TASK_ABBREVIATIONS.get(value, value)
            assert mathvista["categories"][label]["total"] == s["total"]
    assert any(label.endswith("vqa") for label in mathvista["categories"])
    # each MathVista category beside its own baselines: the three rows are math-targeted-vqa multiple choice with 4, 4
    # and 5 options, right at A, A and B
    part = mathvista["categories"]["math-targeted-vqa"]
    assert part["chance"] == pytest.approx((1 / 4 + 1 / 4 + 1 / 5) / 3) and part["constant"] == pytest.approx(2 / 3)
    assert part["constant_answer"] == "(A) on multiple choice"
    # every task and skill too, hand-computed: 5 and 6 are geometry (GPS, GEO, ALG) with 4 options, right at A; 7 a
    # word problem (MWP, NUM) with 5 options, right at B
    for label, chance, letter in (("GPS", 1 / 4, "A"), ("GEO", 1 / 4, "A"), ("ALG", 1 / 4, "A"), ("MWP", 1 / 5, "B"),
                                  ("NUM", 1 / 5, "B")):
        part = mathvista["categories"][label]
        assert part["chance"] == pytest.approx(chance) and part["constant"] == 1.0
        assert part["constant_answer"] == f"({letter}) on multiple choice"
        # and the Markdown shows each part's score beside them
        assert re.search(rf"^\| {label} \| [0-9.]+% \| \d \| {part['total']} \| {100 * chance:.2f}% \| 100.00% "
                         rf"\(\({letter}\) on multiple choice\) \|$", md, re.M)
    for category, entry in mmlu["categories"].items():
        assert re.search(rf"^\| {category} \| .* \| {100 * entry['chance']:.2f}% \| {100 * entry['constant']:.2f}% "
                         rf"\({re.escape(entry['constant_answer'])}\) \|$", md, re.M)
    assert any("query text only" in d for d in mathvista["deviations"])
    assert any("official GPT extractor is replaced" in d for d in mathvista["deviations"])
    assert any("--quick_extract rule" in d for d in mathvista["deviations"])  # on by default; the official's is off
    outputs = json.loads((out / "results.mathvista.json").read_text())
    assert set(outputs) == set(MATHVISTA_PIDS)
    assert all({"response", "extraction", "prediction", "true_false", "query"} <= set(o) for o in outputs.values())
    assert "## MMLU-Pro" in md and "## MathVista testmini" in md and "synthetic proxy" not in md


def test_mathvista_rows_with_their_metadata_fields_at_the_top_level(tmp_path, data_dir, llama_dir):
    """A testmini file whose rows carry task, skills, category, ... at the top level instead of in `metadata` (as
    `compute_scores` reads them) is scored with the same breakdowns, each beside its own baselines."""
    flat = tmp_path / "data" / "mathvista"
    shutil.copytree(data_dir / "mathvista" / "images", flat / "images")
    rows = json.loads((data_dir / "mathvista" / "testmini.json").read_text())
    flat.joinpath("testmini.jsonl").write_text(
        "".join(json.dumps({**{k: v for k, v in r.items() if k != "metadata"}, **r["metadata"]}) + "\n"
                for r in rows.values()), encoding="utf-8")
    config = EvalConfig(max_new_tokens=2, mathvista_extractor="rules", progress=False)
    nested = runner.evaluate(llama_dir, "mathvista", tmp_path / "nested", dataclasses.replace(config, data_dir=data_dir))
    report = runner.evaluate(llama_dir, "mathvista", tmp_path / "flat", dataclasses.replace(config, data_dir=flat.parent))
    entry = report["benchmarks"]["mathvista"]
    assert entry["categories"] == nested["benchmarks"]["mathvista"]["categories"]
    assert entry["categories"]["math-targeted-vqa"]["total"] == 3 and entry["categories"]["GPS"]["chance"] == 0.25


def test_a_cache_line_cut_by_an_interruption_does_not_swallow_the_next_response(tmp_path):
    """An interrupted write leaves a partial last line: the next response goes on a line of its own and is reused."""
    path = tmp_path / "responses.x.jsonl"
    path.write_text(json.dumps({"id": "a", "key": "k", "response": "A"}) + "\n" + '{"id": "b", "ke', encoding="utf-8")
    with pytest.warns(UserWarning, match="unreadable cache line"):
        cache = runner.ResponseCache(path)
    cache.extend([("b", "k", "B")])
    cache.extend([("c", "k", "C")])
    with pytest.warns(UserWarning, match=":2: unreadable"):
        again = runner.ResponseCache(path)
    assert [again.get(i, "k") for i in "abc"] == ["A", "B", "C"]


def test_tiny_kimi_vl_end_to_end_with_images(tmp_path, data_dir, kimi_dir, monkeypatch):
    seen_images = []
    original = Engine.generate

    def spy(self, requests, **kwargs):
        seen_images.extend(r.image for r in requests)
        return original(self, requests, **kwargs)

    monkeypatch.setattr(Engine, "generate", spy)
    out = tmp_path / "out"
    report = runner.evaluate(kimi_dir, ["mathvista", "mmlu_pro"], out,
                             EvalConfig(data_dir=data_dir, batch_size=2, max_new_tokens=3, progress=False))
    _check_outputs(out, report, ["mathvista", "mmlu_pro"])
    assert report["model"]["class"] == "KimiVLForConditionalGeneration" and report["model"]["images"]
    assert report["benchmarks"]["mathvista"]["settings"]["images"] is True
    assert sum(isinstance(im, Image.Image) for im in seen_images) == len(MATHVISTA_PIDS)
    assert not any("query text only" in d for d in report["benchmarks"]["mathvista"]["deviations"])


def test_raw_mathvista_format_gives_an_image_model_its_images(tmp_path, data_dir, kimi_dir, monkeypatch):
    """--mathvista-format raw on a model that takes images: the image's placeholder, then the query, no chat turn."""
    rendered = []
    original = Engine.render

    def spy(self, request):
        rendered.append((request.image is not None, original(self, request)))
        return rendered[-1][1]

    monkeypatch.setattr(Engine, "render", spy)
    report = runner.evaluate(kimi_dir, "mathvista", tmp_path / "out", EvalConfig(
        data_dir=data_dir, max_new_tokens=2, mathvista_format="raw", progress=False))
    assert report["benchmarks"]["mathvista"]["total"] == len(MATHVISTA_PIDS)
    assert len(rendered) == len(MATHVISTA_PIDS) and all(image for image, _ in rendered)
    assert all(text.startswith(IMAGE_PROMPT + "Hint: ") and IM_USER not in text for _, text in rendered)


def test_chat_format_on_a_model_without_chat_template_is_reported_as_the_raw_prompt(tmp_path, data_dir, llama_dir):
    """--mmlu-pro-format chat on a model without a chat template sends the official raw prompt: the report says so
    and claims no chat turn."""
    engine = Engine.from_pretrained(llama_dir)
    engine.tokenizer.chat_template = None
    entry = runner.evaluate(engine, "mmlu_pro", tmp_path / "out", EvalConfig(
        data_dir=data_dir, max_new_tokens=2, mmlu_pro_format="chat", progress=False))["benchmarks"]["mmlu_pro"]
    assert entry["settings"]["format"] == "official (chat asked, but the model has no chat template)"
    assert not any("chat template" in d for d in entry["deviations"])


def test_interrupted_run_resumes_without_recomputing(tmp_path, data_dir, llama_dir, monkeypatch):
    generated = []
    original = Engine.generate

    def counting(self, requests, **kwargs):
        generated.extend(r.text for r in requests)
        return original(self, requests, **kwargs)

    monkeypatch.setattr(Engine, "generate", counting)

    def stop_after_two(benchmark, done, total):
        if done >= 2:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    config = EvalConfig(data_dir=data_dir, batch_size=1, max_new_tokens=3, progress=False)
    with pytest.raises(KeyboardInterrupt):
        runner.evaluate(llama_dir, "mmlu_pro", out, config, progress_callback=stop_after_two)
    assert len(generated) == 2 and len(_lines(out / "responses.mmlu_pro.jsonl")) == 2
    first = set(generated)

    generated.clear()
    report = runner.evaluate(llama_dir, "mmlu_pro", out, config)
    assert len(generated) == 2 and not first & set(generated)  # only the two unfinished items
    assert report["benchmarks"]["mmlu_pro"]["total"] == 4

    generated.clear()
    again = runner.evaluate(llama_dir, "mmlu_pro", out, config)
    assert generated == []
    assert again["benchmarks"]["mmlu_pro"]["correct"] == report["benchmarks"]["mmlu_pro"]["correct"]

    fresh = runner.evaluate(llama_dir, "mmlu_pro", tmp_path / "fresh", config)  # same answers as uninterrupted
    resumed = [r["model_outputs"] for r in json.loads((out / "results.mmlu_pro.json").read_text())]
    assert resumed == [r["model_outputs"] for r in json.loads((tmp_path / "fresh" / "results.mmlu_pro.json").read_text())]
    assert fresh["benchmarks"]["mmlu_pro"]["correct"] == report["benchmarks"]["mmlu_pro"]["correct"]

    generated.clear()  # changed generation settings invalidate the cache
    runner.evaluate(llama_dir, "mmlu_pro", out, dataclasses.replace(config, max_new_tokens=2))
    assert len(generated) == 4

    generated.clear()  # and so does another dtype: the report states the dtype its responses come from
    bf16 = dataclasses.replace(config, max_new_tokens=2, dtype="bfloat16")  # as the last run but the dtype
    with pytest.warns(UserWarning, match="another dtype"):
        report = runner.evaluate(llama_dir, "mmlu_pro", out, bf16)
    assert len(generated) == 4 and report["model"]["dtype"] == "bfloat16"


def _counting_generate(monkeypatch):
    """The requests of every `Engine.generate` call from now on."""
    generated = []
    original = Engine.generate

    def counting(self, requests, **kwargs):
        generated.extend(requests)
        return original(self, requests, **kwargs)

    monkeypatch.setattr(Engine, "generate", counting)
    return generated


def test_cached_responses_are_reused_only_for_the_same_image(tmp_path, data_dir, kimi_dir, monkeypatch):
    """The same question about another image (another proxy seed, an updated data file) is generated anew."""
    generated = _counting_generate(monkeypatch)
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    out, config = tmp_path / "out", EvalConfig(data_dir=data, max_new_tokens=2, progress=False)
    runner.evaluate(kimi_dir, "mathvista", out, config)
    assert len(generated) == len(MATHVISTA_PIDS)
    generated.clear()
    runner.evaluate(kimi_dir, "mathvista", out, config)
    assert generated == []
    changed = data / "mathvista" / "images" / f"{MATHVISTA_PIDS[0]}.jpg"
    Image.new("RGB", Image.open(changed).size, (250, 10, 10)).save(changed)
    runner.evaluate(kimi_dir, "mathvista", out, config)
    assert len(generated) == 1 and generated[0].image.getpixel((0, 0))[0] > 200


def _train_again_in_place(model_dir):
    """Other weights of the same architecture saved over `model_dir`'s."""
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaForCausalLM.from_pretrained(model_dir).config).save_pretrained(model_dir)


def test_a_model_trained_again_in_place_is_generated_anew_but_not_its_folder_spelled_otherwise(
        tmp_path, data_dir, llama_dir, monkeypatch):
    generated = _counting_generate(monkeypatch)
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(llama_dir, model)
    config = EvalConfig(data_dir=data_dir, max_new_tokens=2, progress=False)
    runner.evaluate(model, "mmlu_pro", out, config)
    assert len(generated) == len(MMLU_TEST_IDS)
    generated.clear()
    monkeypatch.chdir(tmp_path)  # the same weights through a relative path: every response reused
    report = runner.evaluate("model", "mmlu_pro", "out", config)
    assert generated == [] and report["model"]["weights"][0]["name"] == "model.safetensors"
    _train_again_in_place(model)
    with pytest.warns(UserWarning, match="other weights"):
        runner.evaluate(model, "mmlu_pro", out, config)
    assert len(generated) == len(MMLU_TEST_IDS)


def test_the_report_keeps_the_folders_other_benchmarks_of_the_same_model_only(tmp_path, data_dir, llama_dir,
                                                                               monkeypatch):
    generated = _counting_generate(monkeypatch)
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(llama_dir, model)
    config = EvalConfig(data_dir=data_dir, max_new_tokens=2, mathvista_extractor="rules", progress=False)
    first = runner.evaluate(model, "mmlu_pro,mathvista", out, config)
    generated.clear()
    subset = runner.evaluate(model, "mmlu_pro", out, config)  # a subset: the report still holds both
    assert generated == [] and list(subset["benchmarks"]) == ["mmlu_pro", "mathvista"]
    assert subset["benchmarks"]["mathvista"]["accuracy"] == first["benchmarks"]["mathvista"]["accuracy"]
    assert "MathVista testmini" in _check_outputs(out, subset, ["mmlu_pro", "mathvista"])
    _train_again_in_place(model)  # another model's report is replaced, saying what it leaves out
    with pytest.warns(UserWarning, match="mathvista left out of the report"):
        other = runner.evaluate(model, "mmlu_pro", out, config)
    assert list(other["benchmarks"]) == ["mmlu_pro"]
    assert list(json.loads((out / "report.json").read_text())["benchmarks"]) == ["mmlu_pro"]


def test_cli_entry_points(tmp_path, data_dir, llama_dir, capsys):
    parser = argparse.ArgumentParser()
    runner.add_eval_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--benchmarks", "mathvista", "--out", str(tmp_path / "o"),
                              "--data-dir", str(data_dir), "--limit", "2", "--max-new-tokens", "2", "--no-progress",
                              "--mathvista-extractor", "rules"])
    report = runner.run_eval_from_args(args)
    assert report["benchmarks"]["mathvista"]["total"] == 2
    printed = capsys.readouterr().out
    assert "MathVista testmini:" in printed and "report.md" in printed


def test_proxies_are_labelled(tmp_path, llama_dir):
    pytest.importorskip("kimi_vl.data.world", reason="the synthetic world is not available yet")
    out = tmp_path / "out"
    report = runner.evaluate(llama_dir, "proxies", out,
                             EvalConfig(limit=4, max_new_tokens=2, batch_size=4, progress=False))
    assert set(report["benchmarks"]) == {"mmlu_pro_synth", "mathvista_synth"}
    assert all(e["proxy"] for e in report["benchmarks"].values())
    assert report["benchmarks"]["mmlu_pro_synth"]["lookup_misses"] == 0  # 2 new tokens name no option
    md = (out / "report.md").read_text()
    assert md.count("(synthetic proxy)") >= 4


def test_lookup_misses_count_the_right_value_with_a_wrong_letter():
    """A reply whose last lookup step names the right option's value with another letter is a miss of the lookup;
    a wrong value, a right letter, or no lookup step is not."""
    from kimi_vl.eval.proxies import lookup_misses

    options = ["300", "360", "420"]

    def record(reply):
        return {"options": options, "answer": "B", "model_outputs": reply}

    replies = ["So it is 360. The option 360 is (C). The answer is (C).",  # miss
               "The option 300 is (A). No: 6 * 60 = 360. The option 360 is (A). The answer is (A).",  # miss (last)
               "So it is 360. The option 360 is (B). The answer is (B).",
               "So it is 300. The option 300 is (A). The answer is (A).",
               "The option 360 is (C). Again: 5 * 60 = 300. The option 300 is (A). The answer is (A).",
               "The answer is (C)."]
    assert lookup_misses([record(r) for r in replies]) == 2


def test_readme_eval_commands_pass_local_model_folders():
    """`--model` takes a local folder (a Hub id is refused with how to download it): every `kimi-vl eval` command of
    README's Evaluate section passes a quickstart folder or one an earlier command of the block downloads."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("## Evaluate"):]
    block = block[block.index("```bash") : block.index("```\n", block.index("```bash") + 7)]
    downloaded = set()
    for line in block.splitlines():
        words = line.split()
        if "--local-dir" in words:
            downloaded.add(words[words.index("--local-dir") + 1])
        if words[:2] == ["kimi-vl", "eval"]:
            model = words[words.index("--model") + 1]
            assert model.startswith("runs/") or model in downloaded, line


def test_argument_errors(tmp_path, llama_dir, data_dir):
    selected = parse_benchmarks("mmlu_pro, proxies,mmlu_pro")
    assert [b.name for b in selected] == ["mmlu_pro", "mmlu_pro_synth", "mathvista_synth"]
    with pytest.raises(ConfigError, match="unknown benchmark 'mmlu'"):
        runner.evaluate(llama_dir, "mmlu", tmp_path)
    with pytest.raises(ConfigError, match="mathvista_extractor"):
        EvalConfig(mathvista_extractor="gpt-4")
    with pytest.raises(CheckpointError, match="config.json"):
        runner.evaluate(tmp_path, "mmlu_pro", tmp_path / "o", EvalConfig(data_dir=data_dir))
    with pytest.raises(CheckpointError, match="huggingface-cli download org/model --local-dir DIR"):  # a Hub id
        runner.evaluate("org/model", "mmlu_pro", tmp_path / "o", EvalConfig(data_dir=data_dir))
    with pytest.raises(DataUnavailableError, match="testmini"):  # data is checked before the model is loaded
        runner.evaluate(tmp_path, "mathvista", tmp_path / "o", EvalConfig(data_dir=tmp_path))
    assert cut_at_stop("abc Question: next", ["Question:"]) == "abc "


def test_zero_shot_needs_no_validation_split(tmp_path, data_dir, llama_dir):
    no_val = tmp_path / "data"
    (no_val / "mmlu_pro").mkdir(parents=True)
    shutil.copy(data_dir / "mmlu_pro" / "test-00000-of-00001.parquet", no_val / "mmlu_pro")
    parser = argparse.ArgumentParser()
    runner.add_eval_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--benchmarks", "mmlu_pro", "--out", str(tmp_path / "o"),
                              "--data-dir", str(no_val), "--num-shots", "0", "--max-new-tokens", "2", "--no-progress"])
    report = runner.run_eval_from_args(args)
    assert report["benchmarks"]["mmlu_pro"]["total"] == len(MMLU_TEST_IDS)
    assert {r["shots"] for r in json.loads((tmp_path / "o" / "results.mmlu_pro.json").read_text())} == {0}
    with pytest.raises(DataUnavailableError, match=r"no 'validation' data file .*--num-shots 0"):
        runner.evaluate(llama_dir, "mmlu_pro", tmp_path / "o1", EvalConfig(data_dir=no_val, num_shots=1))
    with pytest.raises(ConfigError, match="num_shots must be >= 0"):
        EvalConfig(data_dir=no_val, num_shots=-1)


def test_output_folder_and_model_path_that_are_files(tmp_path, data_dir, llama_dir, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(ConfigError, match=rf"^--out {re.escape(str(afile))} is a file, not a directory; pass a dir"):
        runner.evaluate(llama_dir, "mmlu_pro", afile, EvalConfig(data_dir=data_dir))
    with pytest.raises(ConfigError, match=rf"^--out \S+/sub lies in {re.escape(str(afile))}, which is a file"):
        runner.evaluate(llama_dir, "mmlu_pro", afile / "sub", EvalConfig(data_dir=data_dir))
    assert main(["eval", "--model", str(llama_dir), "--benchmarks", "mmlu_pro", "--data-dir", str(data_dir),
                 "--out", str(afile)]) == 2
    assert f"kimi-vl: error: --out {afile} is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=rf"^{re.escape(repr(str(afile)))} is a file, not a model directory; "
                                              "pass the folder written by save_pretrained"):
        runner.evaluate(afile, "mmlu_pro", tmp_path / "o", EvalConfig(data_dir=data_dir))
    assert afile.read_text() == "not a folder"


def test_device_is_checked_before_anything_is_read(tmp_path, llama_dir, monkeypatch, capsys):
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ConfigError, match=r"^--device tpu is not a torch device \(cpu, cuda, cuda:N, mps\)\.$"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == "cuda:0" and resolve_device(None) == "cuda"
    with pytest.raises(ConfigError, match=r"^--device cuda:1: this machine has 1 CUDA device \(cuda:0\); pick one"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == "cpu"
    with pytest.raises(ConfigError, match=r"^--device cuda: CUDA is not available on this machine; use --device cpu"):
        resolve_device("cuda")
    # before the data: the empty data folder would otherwise be a DataUnavailableError
    with pytest.raises(ConfigError, match=r"^--device tpu is not a torch device"):
        runner.evaluate(llama_dir, "mmlu_pro", tmp_path / "o", EvalConfig(data_dir=tmp_path, device="tpu"))
    with pytest.raises(ConfigError, match=r"^--device cuda: CUDA is not available"):  # the loader checks it too
        Engine.from_pretrained(llama_dir, device="cuda")
    assert main(["eval", "--model", str(llama_dir), "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    assert "kimi-vl: error: --device cuda: CUDA is not available on this machine; use --device cpu." in (
        capsys.readouterr().err)
