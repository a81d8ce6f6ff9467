"""EvalConfig: values checked and converted on construction, and the `kimi-vl eval` options generated from it."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from kimi_vl.cli import main
from kimi_vl.errors import ConfigError
from kimi_vl.eval import EvalConfig, runner
from kimi_vl.eval.config import add_config_options, config_from_args
from kimi_vl.eval.proxies import PROXY_EVAL_CONFIG
from kimi_vl.training.config import attribute_docs


def test_values_are_converted_and_checked(tmp_path):
    config = EvalConfig(data_dir=tmp_path, limit="3", batch_size="2", quick_extract="false", device="none")
    assert (config.data_dir, config.limit, config.batch_size, config.quick_extract, config.device) == (
        str(tmp_path), 3, 2, False, None)
    model = tmp_path / "judge"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert EvalConfig(mathvista_extractor=model).mathvista_extractor == str(model)
    for bad, message in [({"batch_size": 0}, "batch_size must be >= 1"), ({"limit": -1}, "limit must be >= 1"),
                         ({"limit": 0}, "limit must be >= 1, got 0"),
                         ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
                         ({"mmlu_pro_format": "chat-ml"}, "mmlu_pro_format must be one of official, chat"),
                         ({"dtype": "int8"}, "dtype must be one of"), ({"num_shots": "five"}, "not a valid int"),
                         ({"mathvista_extractor": str(tmp_path)}, "neither"), ({"progress": None}, "cannot be none")]:
        with pytest.raises(ConfigError, match=message):
            EvalConfig(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.limit = 4
    with pytest.raises(ConfigError):
        dataclasses.replace(config, num_shots=-1)


def test_changes_and_proxy_settings():
    assert EvalConfig().changes() == {}
    assert PROXY_EVAL_CONFIG.changes() == {"max_new_tokens": 96, "num_shots": 0, "mmlu_pro_format": "chat"}
    assert EvalConfig(limit=2).to_dict()["limit"] == 2 and set(EvalConfig().to_dict()) == {
        f.name for f in dataclasses.fields(EvalConfig)}


def test_cli_options_are_generated_from_the_fields():
    parser = argparse.ArgumentParser()
    add_config_options(parser)
    docs = attribute_docs(EvalConfig)
    options = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(options) == {f.name for f in dataclasses.fields(EvalConfig)} == set(docs)
    for name, action in options.items():
        assert action.help.startswith(docs[name].rstrip(".")[:40]), name
    assert "--no-quick-extract" in options["quick_extract"].option_strings
    assert options["mathvista_format"].choices == ("chat", "raw")
    assert config_from_args(parser.parse_args([])) == EvalConfig()
    args = parser.parse_args(["--num-shots", "0", "--no-quick-extract", "--data-dir", "d", "--mmlu-pro-format", "chat",
                              "--limit", "none", "--no-progress"])
    assert config_from_args(args) == EvalConfig(num_shots=0, quick_extract=False, data_dir=Path("d"),
                                                mmlu_pro_format="chat", progress=False)


def test_bad_option_values_are_user_errors(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path), "--out", str(tmp_path), "--batch-size", "x"]) == 2
    assert "batch_size: 'x' is not a valid int" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not a choice
        main(["eval", "--model", str(tmp_path), "--out", str(tmp_path), "--mathvista-format", "html"])
    # --limit 0 would evaluate nothing and report "0.00% (0/0)": refused before anything is read
    assert main(["eval", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--limit", "0"]) == 2
    assert "kimi-vl: error: limit must be >= 1, got 0." in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    parser = argparse.ArgumentParser()
    runner.add_eval_arguments(parser)
    assert parser.parse_args(["--model", "m", "--out", "o"]).benchmarks == "mmlu_pro,mathvista"
