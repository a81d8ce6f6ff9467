"""PNG plots of a training run's `metrics.jsonl`: loss (with validation and the unigram baseline), max attention
logit per layer, gradient norm, and expert load imbalance per MoE layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(metrics: list[dict[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """`{name: (steps, values)}` for a metric that maps names to numbers on each step."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for m in metrics:
        for name, value in (m.get(key) or {}).items():
            steps, values = out.setdefault(name, ([], []))
            steps.append(m["step"])
            values.append(value)
    return out


def _short(name: str) -> str:
    """`language_model.model.layers.3.self_attn` -> `layers.3`."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[max(i - 1, 0): i + 1])
    return name


def plot_metrics(metrics: list[dict[str, Any]], out_dir: str | Path, *, title: str = "",
                 baseline: float | None = None) -> list[Path]:
    """Write `loss.png`, `max_logits.png`, `grad_norm.png` and `expert_load.png` (when there is data for them)
    into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    steps = [m["step"] for m in metrics]

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [m["loss"] for m in metrics], label="train loss", lw=1)
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{title} loss".strip())
    ax.legend()
    written.append(_save(fig, out_dir / "loss.png"))

    for key, ylabel, name in (("max_logits", "max pre-softmax logit", "max_logits.png"),
                              ("expert_load", "max / mean expert load", "expert_load.png")):
        series = _series(metrics, key)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer, (s, v) in series.items():
            ax.plot(s, v, lw=1, label=_short(layer))
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title} {ylabel}".strip())
        ax.legend(fontsize="small")
        written.append(_save(fig, out_dir / name))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [m["grad_norm"] for m in metrics], lw=1)
    ax.set(xlabel="step", ylabel="gradient norm (before clipping)", yscale="log", title=f"{title} grad norm".strip())
    written.append(_save(fig, out_dir / "grad_norm.png"))
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_rl_metrics(metrics: list[dict[str, Any]], out_dir: str | Path, *, title: str = "RL") -> list[Path]:
    """Write `rewards.png` (mean reward and reward per task) and `rl_stats.png` (response length, fraction of
    tokens masked, entropy) into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [m["reward_mean"] for m in metrics], lw=2, color="black", label="mean")
    for key in sorted({k for m in metrics for k in m if k.startswith("reward/")}):
        pts = [(m["step"], m[key]) for m in metrics if key in m]
        ax.plot(*zip(*pts), lw=0.8, alpha=0.8, label=key.split("/", 1)[1])
    ax.set(xlabel="step", ylabel="reward", title=f"{title} reward".strip())
    ax.legend(fontsize="x-small", ncol=2)
    written = [_save(fig, out_dir / "rewards.png")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in zip(axes, ("response_length", "masked_fraction", "entropy"),
                              ("response length (tokens)", "fraction of tokens masked", "entropy (nats)")):
        ax.plot(steps, [m.get(key, float("nan")) for m in metrics], lw=1)
        ax.set(xlabel="step", ylabel=label)
    fig.suptitle(title)
    written.append(_save(fig, out_dir / "rl_stats.png"))
    return written
