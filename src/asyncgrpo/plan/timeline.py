"""Draw a predicted timeline: one lane per engine (busy, paused) and the trainer's
train and sync spans, like the run's own `plots/timeline.png`."""

from __future__ import annotations

from pathlib import Path

COLORS = {"engine": "tab:blue", "pause": "tab:red", "train": "tab:green", "sync": "tab:orange"}


def draw_timeline(spans: list[tuple[str, float, float]], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted({_lane(name) for name, _, _ in spans}, key=lambda n: (n == "trainer", n))
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(lanes) + 1.5))
    for name, start, end in spans:
        kind = name.rstrip("0123456789")
        ax.barh(lanes.index(_lane(name)), end - start, left=start, color=COLORS[kind], height=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds (predicted)")
    ax.set_title(title.strip(), fontsize=8, family="monospace")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lane(name: str) -> str:
    if name.startswith("pause"):
        return "engine" + name[len("pause") :]
    return "trainer" if name in ("train", "sync") else name
