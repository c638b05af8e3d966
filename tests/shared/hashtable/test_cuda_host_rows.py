"""Host rows read and written by the device through UVA (cuda/host_rows.cu): gathers, scatters
and swaps equal ``index_select`` / ``index_copy_`` on the host, float4 and scalar widths,
masked and negative rows skipped, empty input, and a gather replayed from a CUDA graph (GPU
tests: ``python3 -m pytest -q -m gpu tests/shared/hashtable/test_cuda_host_rows.py``); the
launch signatures and the layout check run on CPU too."""

from __future__ import annotations

import pytest
import torch

from shared.hashtable.cuda import host_rows
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.host_store import TensorHostStore

from .conftest import NEEDS_CUDA_KERNELS, run_on_cuda
from .test_cuda_keyed import _kernel_params, _signature

WIDTHS = [32, 6, 256]  # float4 rows (dim 16), scalar rows (dim 3), wide rows (dim 128)


def test_signatures_match_the_source() -> None:
    params = _kernel_params(rt.SOURCE.with_name(host_rows.SOURCE[0]))
    assert set(params) == set(host_rows.SIGNATURES)
    for name, sig in host_rows.SIGNATURES.items():
        assert _signature(params[name]) == sig, name


def test_rows_off_the_device_are_refused_with_the_layout_wanted() -> None:
    with pytest.raises(ValueError, match=r"contiguous int64 \[n\] on a CUDA device"):
        host_rows.gather(0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"contiguous int64 \[n\] on a CUDA device"):
        host_rows.scatter(0, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4))


def _store(width: int, rows: int = 1000, seed: int = 0) -> tuple[TensorHostStore, torch.Tensor]:
    """A mapped store of ``rows`` random rows (width = 2 * dim) and a copy of its values."""
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    store = TensorHostStore(width // 2, capacity=rows, pin=True, mapped=True)
    store.write(torch.arange(rows), values)  # row ids on the CPU: the CPU's index_copy_
    return store, values


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gather_equals_index_select(width: int, graph: bool) -> None:
    store, values = _store(width)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(-1, values.shape[0], (4096,), generator=gen)  # -1: a zero row
    want = torch.where((idx >= 0).unsqueeze(1), values[idx.clamp(min=0)], 0.0)
    dev = torch.device("cuda")
    rows = idx.to(dev)
    out = torch.full((idx.numel(), width), float("nan"), device=dev)
    pointer = store.device_pointer()

    def run() -> None:
        host_rows.gather(pointer, rows, out)

    run_on_cuda(run, graph=graph, out=out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_scatter_equals_index_copy(width: int, masked: bool) -> None:
    store, values = _store(width)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randperm(values.shape[0], generator=gen)[:300]  # distinct rows
    idx[::7] = -1  # skipped
    payload = torch.randn(idx.numel(), width, generator=gen)
    mask = torch.rand(idx.numel(), generator=gen) < 0.5
    written = (idx >= 0) & mask if masked else idx >= 0
    want = values.clone()
    want.index_copy_(0, idx[written], payload[written])
    dev = torch.device("cuda")
    host_rows.scatter(
        store.device_pointer(),
        idx.to(dev),
        payload.to(dev),
        mask.to(dev) if masked else None,
    )
    torch.cuda.synchronize()  # the writes have landed in host memory
    assert torch.equal(store.rows, want)


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("k", [1, 2])
def test_scatter_int64_keeps_every_bit(k: int) -> None:
    """int64 numbers (ids, counts: -1 and values past float32's range among them) scattered into
    pinned int64 rows through float32 pairs: the same numbers, bit for bit."""
    host = torch.zeros(8, k, dtype=torch.int64, pin_memory=True)
    values = torch.tensor([[-1, 2**40 + 3], [7, -(2**62)], [123456789012, 0]])[:, :k]
    rows = torch.tensor([5, -1, 0])  # -1: skipped
    dev = torch.device("cuda")
    host_rows.scatter_int64(host.data_ptr(), rows.to(dev), values.to(dev).squeeze(1))
    torch.cuda.synchronize()
    want = torch.zeros(8, k, dtype=torch.int64)
    want[5], want[0] = values[0], values[2]
    assert torch.equal(host, want)


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("width", WIDTHS)
def test_swap_equals_index_copy_then_index_select(width: int) -> None:
    """Write-backs (some skipped) and reads of other rows in one kernel, through a mapped store
    and bare; equal to the CPU store doing the write, then the read."""
    mapped, values = _store(width)
    plain = TensorHostStore(width // 2, capacity=values.shape[0], pin=False)
    plain.write(torch.arange(values.shape[0]), values)
    gen = torch.Generator().manual_seed(4)
    perm = torch.randperm(values.shape[0], generator=gen)
    written, read = perm[:300].clone(), perm[300:600]  # disjoint, as a cache's are
    written[::5] = -1  # clean lines: nothing written
    payload = torch.randn(300, width, generator=gen)
    want = plain.swap(written, payload, read)
    dev = torch.device("cuda")
    got = mapped.swap(written.to(dev), payload.to(dev), read.to(dev))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    assert torch.equal(mapped.rows, plain.rows)  # the writes landed
    into = torch.full((300, width), float("nan"), device=dev)
    host_rows.swap(mapped.device_pointer(), read.to(dev), got, written.to(dev), into)
    torch.cuda.synchronize()
    back = torch.where((written >= 0).unsqueeze(1), plain.rows[written.clamp(min=0)], 0.0)
    assert torch.equal(into.cpu(), back)  # -1 reads: zero rows


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
def test_empty_input_launches_nothing_and_a_bad_mask_is_refused() -> None:
    store, values = _store(32)
    dev = torch.device("cuda")
    none = torch.zeros(0, dtype=torch.int64, device=dev)
    out = torch.zeros(0, 32, device=dev)
    host_rows.gather(store.device_pointer(), none, out)
    host_rows.swap(store.device_pointer(), none, out, none, out)
    host_rows.scatter(
        store.device_pointer(), none, out, torch.zeros(0, dtype=torch.bool, device=dev)
    )
    torch.cuda.synchronize()
    assert torch.equal(store.rows, values)
    rows = torch.tensor([1, 2], device=dev)
    with pytest.raises(ValueError, match="mask must be bool"):
        host_rows.scatter(store.device_pointer(), rows, torch.zeros(2, 32, device=dev), rows)


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("width", [32, 6])
def test_a_mapped_store_moves_device_rows_on_the_device(width: int) -> None:
    """read gives device rows, write takes them, growth moves the rows (a new device address)
    and every CPU-side read sees the device's writes; equal to a CPU store doing the same."""
    mapped, values = _store(width)
    plain = TensorHostStore(width // 2, capacity=values.shape[0], pin=False)
    plain.write(torch.arange(values.shape[0]), values)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    idx = torch.randperm(values.shape[0], generator=gen)[:200]
    got = mapped.read(idx.to(dev))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), plain.read(idx))
    payload = torch.randn(200, width, generator=gen)
    mapped.write(idx.to(dev), payload.to(dev))
    plain.write(idx, payload)
    assert torch.equal(mapped.read(idx), plain.read(idx))  # CPU ids after device writes
    before = mapped.device_pointer()
    old, new = idx[:150], torch.randperm(4000, generator=gen)[:150]
    mapped.permute(4000, old.to(dev), new.to(dev))
    plain.permute(4000, old, new)
    assert mapped.capacity == 4000 and mapped.device_pointer() != before
    assert torch.equal(mapped.rows, plain.rows)
    assert torch.equal(mapped.read(new.to(dev)).cpu(), plain.read(new))


@pytest.mark.gpu
@NEEDS_CUDA_KERNELS
@pytest.mark.parametrize("dim", [16, 3, 128])  # float4 halves, scalar halves, wide rows
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("write_only", [False, True], ids=["fill", "write_only"])
@pytest.mark.parametrize("ordered", [False, True], ids=["in_turn", "ordered"])
def test_fill_slots_writes_back_then_fills_the_slots_in_place(
    dim: int, graph: bool, write_only: bool, ordered: bool
) -> None:
    """A cache's slots take their payload in one kernel (the static resolve's fill): the old
    payload written back where asked, then a host row or a new row (with the initial
    accumulator) in place; positions without a slot touch nothing; with no rows to read and
    no new rows, the slots are only written back (a bypassed row's staging slot). Equal to
    index_copy_ / index_select on CPU tensors. With an ``order`` (the positions in any order:
    the static cache passes them in its host rows' order) the same."""
    n, lines, initial = 400, 350, 0.25  # 2n distinct host rows of 1000
    mapped, host = _store(2 * dim)
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(lines + 1, dim, generator=gen)  # the lines and a sink
    accum = torch.rand(lines + 1, dim, generator=gen)
    init = torch.randn(n, dim, generator=gen)
    slots = torch.full((n,), -1, dtype=torch.int64)
    at = torch.randperm(n, generator=gen)[:300]  # positions with a slot
    slots[at] = torch.randperm(lines, generator=gen)[:300]
    perm = torch.randperm(host.shape[0], generator=gen)
    back = torch.where(torch.rand(n, generator=gen) < 0.5, perm[:n], -1)  # dirty lines
    read = torch.where(torch.rand(n, generator=gen) < 0.7, perm[n : 2 * n], -1)
    fresh = torch.rand(n, generator=gen) < 0.3
    want_host, want_v, want_a = host.clone(), values.clone(), accum.clone()
    sel = slots >= 0
    wb = sel & (back >= 0)
    want_host[back[wb]] = torch.cat([values[slots[wb]], accum[slots[wb]]], 1)
    if not write_only:
        rd = sel & ~fresh & (read >= 0)
        want_v[slots[rd]], want_a[slots[rd]] = host[read[rd], :dim], host[read[rd], dim:]
        fr = sel & fresh
        want_v[slots[fr]], want_a[slots[fr]] = init[fr], initial
    dev = torch.device("cuda")
    v, a = values.to(dev), accum.to(dev)
    b, r, s, f, i = (t.to(dev) for t in (back, read, slots, fresh, init))
    if write_only:
        r = f = i = None

    order = torch.randperm(n, generator=gen).to(dev) if ordered else None

    def run() -> None:
        host_rows.fill_slots(mapped.device_pointer(), b, r, s, f, i, initial, v, a, order=order)

    # a run writes the slots and the host rows: the graph's warm-up only compiles
    run_on_cuda(
        run, graph=graph, out=None, warm=lambda: rt.compile_modules(dev, [host_rows.SOURCE])
    )
    assert torch.equal(v.cpu(), want_v) and torch.equal(a.cpu(), want_a)
    assert torch.equal(mapped.rows, want_host)


def test_fill_slots_refuses_tensors_off_the_layout() -> None:
    rows = torch.zeros(2, dtype=torch.int64)
    v = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"contiguous int64 \[n\] on a CUDA device"):
        host_rows.fill_slots(0, rows, rows, rows, rows > 0, torch.zeros(2, 4), 0.1, v, v)
    with pytest.raises(ValueError, match=r"row ids must be contiguous int64 \[2\] on a CUDA"):
        host_rows.fill_slots(0, rows, None, rows, None, None, 0.1, v, v)
    with pytest.raises(ValueError, match="pass fresh and init together"):
        host_rows.fill_slots(0, rows, None, rows, rows > 0, None, 0.1, v, v)
