"""ProgressLine: plain lines with count, percent and eta off a TTY; tqdm's bar on one."""

from __future__ import annotations

import io

from shared.progress import ProgressLine, format_seconds


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_non_tty_stream_gets_plain_lines_with_count_and_eta() -> None:
    out = io.StringIO()
    progress = ProgressLine("train", total=4, unit="step", every_s=0, stream=out)
    for i in range(4):
        progress.set_status(f"{1000 * (i + 1):,} samples/s, loss 0.5")
        progress.update()
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5  # one per update (every_s=0) and the last one at close
    assert lines[1].startswith("train: step 2/4 (50%) 2,000 samples/s, loss 0.5, eta ")
    assert lines[-1].startswith("train: step 4/4 (100%) 4,000 samples/s, loss 0.5, in ")
    assert "\r" not in out.getvalue()


def test_plain_lines_wait_every_s_and_close_writes_once() -> None:
    out = io.StringIO()
    progress = ProgressLine("train", total=10, every_s=3600, stream=out, initial=2)
    progress.update(3)
    assert out.getvalue() == ""  # the first line waits an hour
    progress.close()
    progress.close()
    assert out.getvalue().splitlines() == [progress.line(final=True)]
    assert out.getvalue().startswith("train: step 5/10 (50%), in ")


def test_unknown_total_and_unit_after_the_count() -> None:
    out = io.StringIO()
    ProgressLine("train", stream=out, every_s=0).update(7)
    assert out.getvalue().splitlines() == ["train: step 7"]
    out = io.StringIO()
    load = ProgressLine("loadtest", total=20, unit="s", label="", stream=out, every_s=0)
    load.set_status("1,234 requests, 0 failures")
    load.update(5)
    assert out.getvalue().startswith("loadtest: 5/20 s (25%) 1,234 requests, 0 failures, eta ")


def test_a_tty_gets_a_tqdm_bar_with_total_and_disable_writes_nothing() -> None:
    tty = _Tty()
    progress = ProgressLine("train", total=8, stream=tty)
    progress.update(2)
    progress.set_status("loss 0.5")
    progress.close()
    assert "2/8" in tty.getvalue() and "\r" in tty.getvalue() and "loss 0.5" in tty.getvalue()
    quiet = io.StringIO()
    off = ProgressLine("train", total=8, stream=quiet, every_s=0, disable=True)
    off.update()
    off.close()
    assert quiet.getvalue() == ""


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (0.4, 12, 185, 3720)] == [
        "0 s",
        "12 s",
        "3 min 05 s",
        "1 h 02 min",
    ]
