"""Evaluation reports: `report.json` (everything), `report.md` (overall + per-category tables, settings,
deviations from the official protocols) and one `<benchmark>_categories.png` bar plot per benchmark.

A benchmark entry (as built by `kimi_vl.eval.runner`) holds at least `benchmark`, `title`, `proxy`, `accuracy`
(fraction), `correct`, `total` and `categories` (`{name: {"accuracy", "correct", "total"}}`, with the part's own
`chance`, `constant` and `constant_answer` where the benchmark gives them: the Markdown shows them beside each part's
score, "-" where missing); proxies are labelled "(synthetic proxy)" everywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..options import check_output_dir

PROXY_LABEL = "(synthetic proxy)"


def make_output_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Create the output folder `path` (and its parents) if missing; `option` names it in errors (`--out`, `-o`).

    Raises:
        ConfigError: `path` is a file, or the folder cannot be created (a parent is a file, no permission).
    """
    out = Path(path)
    check_output_dir(out, option)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the output directory {str(out)!r} ({exc}); pass a writable {option} DIR."
                          ) from exc
    return out


def benchmark_title(entry: dict[str, Any]) -> str:
    """The benchmark's display title, with the proxy label for proxies."""
    title = entry.get("title", entry.get("benchmark", "benchmark"))
    return f"{title} {PROXY_LABEL}" if entry.get("proxy") and PROXY_LABEL not in title else title


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _constant(entry: dict[str, Any]) -> str:
    """The constant answer's accuracy and what it is, "-" for an entry without baselines."""
    if "constant" not in entry:
        return "-"
    return _pct(entry["constant"]) + (f" ({entry['constant_answer']})" if entry.get("constant_answer") else "")


def render_markdown(report: dict[str, Any]) -> str:
    """The Markdown report."""
    model = report.get("model", {})
    lines = ["# Evaluation report", "", f"Model: `{model.get('name', '?')}` ({model.get('class', '?')}, "
             f"{model.get('device', '?')}, {model.get('dtype', '?')})", ""]
    lines += ["| benchmark | accuracy | correct | total | chance | constant answer |", "|---|---|---|---|---|---|"]
    for entry in report["benchmarks"].values():
        lines.append(f"| {benchmark_title(entry)} | {_pct(entry['accuracy'])} | {entry['correct']} | "
                     f"{entry['total']} | {_pct(entry['chance'])} | {_pct(entry['constant'])} |")
    for name, entry in report["benchmarks"].items():
        lines += ["", f"## {benchmark_title(entry)}", ""]
        if entry.get("proxy"):
            lines += ["Built from the synthetic world: a proxy in the benchmark's format, not the benchmark.", ""]
        lines.append(f"Accuracy {_pct(entry['accuracy'])} ({entry['correct']}/{entry['total']}); uniform guessing "
                     f"{_pct(entry['chance'])}, the constant answer ({entry['constant_answer']}) "
                     f"{_pct(entry['constant'])}.")
        if "random_guesses" in entry:
            lines.append(f"Questions scored by the official random guess (no answer extracted): "
                         f"{entry['random_guesses']}.")
        if "leaderboard" in entry:
            cols = entry["leaderboard"]
            lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
                      "| " + " | ".join(f"{v:.2f}" for v in cols.values()) + " |"]
        lines += ["", f"| {entry.get('category_label', 'category')} | accuracy | correct | total | chance | "
                  "constant answer |", "|---|---|---|---|---|---|"]
        for cat, c in entry["categories"].items():
            lines.append(f"| {cat} | {_pct(c['accuracy'])} | {c['correct']} | {c['total']} | "
                         f"{_pct(c['chance']) if 'chance' in c else '-'} | {_constant(c)} |")
        if entry.get("plot"):
            lines += ["", f"![{name}]({entry['plot']})"]
        if entry.get("settings"):
            lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in entry["settings"].items()) + "."]
        if entry.get("deviations"):
            lines += ["", "Deviations from the official protocol:"] + [f"- {d}" for d in entry["deviations"]]
    return "\n".join(lines) + "\n"


def plot_categories(entry: dict[str, Any], path: str | os.PathLike) -> Path:
    """A horizontal bar plot of the per-category accuracies of one benchmark (overall accuracy as a dashed line)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    cats = entry["categories"]
    names = list(cats)
    values = [100 * cats[n]["accuracy"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.35 * max(len(names), 3) + 1.2))
    try:
        ax.barh(range(len(names)), values, color="#4C72B0")
        for i, v in enumerate(values):
            ax.text(min(v + 1, 88), i, f"{v:.1f}", va="center", fontsize=7)
        ax.set_yticks(range(len(names)), [f"{n} ({cats[n]['total']})" for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(100 * entry["accuracy"], color="#C44E52", linestyle="--", label=f"overall {_pct(entry['accuracy'])}")
        ax.set_xlim(0, 100)
        ax.set_xlabel("accuracy (%)")
        ax.set_title(benchmark_title(entry), fontsize=10)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return Path(path)


def write_reports(report: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the plots, `report.json` and `report.md` under `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, entry in report["benchmarks"].items():
        if entry["categories"]:
            plot = plot_categories(entry, out / f"{name}_categories.png")
            entry["plot"] = plot.name
            paths[f"{name}_plot"] = plot
    paths["json"] = out / "report.json"
    paths["json"].write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    paths["md"] = out / "report.md"
    paths["md"].write_text(render_markdown(report), encoding="utf-8")
    return paths


__all__ = ["PROXY_LABEL", "plot_categories", "render_markdown", "benchmark_title", "write_reports"]
