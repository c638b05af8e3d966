"""Metrics of a run: one JSON object per line in ``metrics.jsonl`` and a PNG of the curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class MetricsLog:
    """Appends records to a JSON-lines file (flushed per record, so a crash loses nothing).

    ``path=None`` keeps the records in memory only (ranks other than 0 of a distributed run).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = None if path is None else Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def plot(self, out: Path) -> Path:
        """Train loss and eval AUC against step (:func:`curves_figure`), written to ``out``."""
        fig = curves_figure(self.records)  # selects the Agg backend before pyplot is imported
        import matplotlib.pyplot as plt

        tmp = out.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        tmp.replace(out)
        return out


def curves_figure(records: list[dict[str, Any]]) -> Figure:
    """Train loss (left) and eval AUC with the oracle's (right) against step. The oracle AUC is
    a dashed line through its eval points, or a horizontal line when there is only one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], marker=".")
    ax1.set(xlabel="step", ylabel="train loss (BCE)", title="training loss")
    ax2.plot([r["step"] for r in evals], [r["auc"] for r in evals], marker="o", label="model")
    oracle = [r for r in evals if r.get("oracle_auc")]
    if len(oracle) == 1:  # a one-point line draws nothing
        ax2.axhline(oracle[0]["oracle_auc"], linestyle="--", color="C1", label="oracle")
    elif oracle:
        ax2.plot(
            [r["step"] for r in oracle], [r["oracle_auc"] for r in oracle], "--", label="oracle"
        )
    ax2.set(xlabel="step", ylabel="eval AUC", title="eval AUC")
    ax2.legend()
    fig.tight_layout()
    return fig
