"""bench.bench_host_pages runs on CPU at a small scale and writes its JSON (no timing checks):
each way of making the host tier's memory is measured, its CPU gather holds the rows asked for,
and the run says what the kernel's huge page setting was and what each allocation added."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import bench_host_pages


def test_bench_host_pages_on_cpu_gathers_the_rows_of_every_allocation(tmp_path: Path) -> None:
    out = tmp_path / "pages.json"
    argv = ["--out", str(out), "--rows", "5000", "--dims", "4", "130", "--ns", "300",
            "--repeats", "2"]  # fmt: skip
    assert bench_host_pages.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and set(result["thp"]) == {"enabled", "defrag"}
    for dim, entry in result["dims"].items():
        assert entry["rows"] == 5000 and entry["row_bytes"] == 2 * int(dim) * 4
        assert set(entry["allocations"]) == set(bench_host_pages.ALLOCATIONS)
        for how, a in entry["allocations"].items():
            assert isinstance(a["anon_huge_pages_kib_added"], int), how
            got = a["n"]["300"]
            assert set(got) == {"cpu_gather"}, (dim, how)  # the UVA gathers need a device
            assert got["cpu_gather"]["rows_equal"] and got["cpu_gather"]["ms"] > 0, (dim, how)


def test_an_allocation_holds_each_rows_id_in_its_first_column() -> None:
    """The check's reference: row i's first column holds i's bits, the rest zeros, however the
    memory was made (the huge-page one from an aligned anonymous mapping)."""
    for how in bench_host_pages.ALLOCATIONS:
        t, keep = bench_host_pages.allocate(how, 1000, 6, cuda=False)
        assert t.shape == (1000, 6) and t.is_contiguous(), how
        assert t.view(torch.int32)[:, 0].tolist() == list(range(1000)), how
        assert float(t[:, 1:].abs().sum()) == 0.0, how
        if how == "register_thp":
            assert t.data_ptr() % bench_host_pages.HUGE == 0
        del t, keep


def test_more_rows_a_call_than_the_matrix_holds_is_refused(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "x.json"), "--rows", "100", "--ns", "200"]
    with pytest.raises(ValueError, match="at most the rows"):
        bench_host_pages.main(argv)


def test_the_drivers_host_memory_is_refused_on_the_cpu(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path / "x.json"), "--rows", "100", "--ns", "10",
            "--allocations", "vmm_host"]  # fmt: skip
    with pytest.raises(ValueError, match="vmm_host needs --device cuda"):
        bench_host_pages.main(argv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CUDA driver's memory)")
def test_the_drivers_host_memory_holds_the_rows_for_the_cpu_and_the_device(tmp_path: Path) -> None:
    """``cuMemCreate`` host memory: the CPU writes the rows and the device's UVA gather reads
    the same rows at the same address, random and sorted."""
    out = tmp_path / "vmm.json"
    argv = ["--out", str(out), "--device", "cuda", "--rows", "50000", "--dims", "16",
            "--ns", "1000", "--repeats", "2", "--allocations", "vmm_host", "register_4k"]  # fmt: skip
    assert bench_host_pages.main(argv) == 0
    entry = json.loads(out.read_text())["dims"]["16"]["allocations"]
    assert entry["vmm_host"]["vmm"]["granularity"] >= 4096
    for how in ("vmm_host", "register_4k"):
        got = entry[how]["n"]["1000"]
        assert set(got) == {"cpu_gather", "uva_gather", "uva_gather_sorted"}, how
        assert all(v["rows_equal"] for v in got.values()), (how, got)
