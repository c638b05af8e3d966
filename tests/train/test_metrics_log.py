"""MetricsLog's curves: the oracle AUC is drawn even with a single eval point."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from train.metrics_log import MetricsLog, curves_figure


def _records(evals: int) -> list[dict]:
    train = [{"kind": "train", "step": s, "loss": 0.7 - s / 100} for s in (2, 4)]
    ev = [
        {"kind": "eval", "step": 4 * (i + 1), "auc": 0.6, "oracle_auc": 0.8} for i in range(evals)
    ]
    return train + ev


def _oracle_lines(records: list[dict]) -> list:
    fig = curves_figure(records)
    try:
        return [line for line in fig.axes[1].lines if line.get_label() == "oracle"]
    finally:
        plt.close(fig)


def test_one_eval_point_draws_the_oracle_line() -> None:
    (line,) = _oracle_lines(_records(1))
    assert list(line.get_ydata()) == [0.8, 0.8]  # axhline: across the whole axis


def test_several_eval_points_draw_the_oracle_through_them() -> None:
    (line,) = _oracle_lines(_records(3))
    assert list(line.get_xdata()) == [4, 8, 12]


def test_plot_writes_the_png(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path / "metrics.jsonl")
    for r in _records(1):
        metrics.write(r)
    assert metrics.plot(tmp_path / "curves.png").stat().st_size > 0
