"""JaggedDIN against tzrec's padded DIN: same weights, same outputs and gradients; user tiling;
torch.export with dynamic sizes; the training fast path (user_index=None) against the general
path, eager and compiled."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.export import Dim

from train.model.din import JaggedDIN, PaddedDIN, SortedPairFeatures, SortedSegmentSoftmaxPool

D = 48
ATTN = [32, 16]  # smaller than the config's [256, 64]: the math is the same, the test is faster


def jagged_batch(
    gen: torch.Generator,
    lengths: list[int],
    user_index: list[int] | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = torch.tensor(lengths, dtype=torch.int64)
    ui = (
        torch.arange(len(lengths))
        if user_index is None
        else torch.tensor(user_index, dtype=torch.int64)
    )
    q = torch.randn(len(ui), D, generator=gen, dtype=dtype)
    s = torch.randn(int(lens.sum()), D, generator=gen, dtype=dtype)
    return q, s, lens, ui


def random_lengths(gen: torch.Generator, n: int, max_len: int = 12) -> list[int]:
    lens = torch.randint(0, max_len + 1, (n,), generator=gen)
    lens[torch.rand(n, generator=gen) < 0.3] = 0  # plenty of empty rows
    return lens.tolist()


def pair(
    dtype: torch.dtype = torch.float64, max_length: int | None = None
) -> tuple[JaggedDIN, PaddedDIN]:
    torch.manual_seed(0)
    jagged = JaggedDIN(D, ATTN).to(dtype)
    padded = PaddedDIN(D, ATTN, max_length=max_length).to(dtype)
    padded.load_state_dict(jagged.state_dict())
    return jagged, padded


def grads(
    module: torch.nn.Module,
    q: torch.Tensor,
    s: torch.Tensor,
    lens: torch.Tensor,
    ui: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    q, s = q.clone().requires_grad_(), s.clone().requires_grad_()
    module.zero_grad()
    out = module(q, s, lens, ui)
    # a loss that weights every output element differently
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weights).sum().backward()
    named = {"query": q.grad, "seq_values": s.grad}
    named.update({n: p.grad for n, p in module.named_parameters()})
    return out.detach(), named


def test_state_dicts_are_interchangeable() -> None:
    jagged, padded = pair()
    assert list(jagged.state_dict()) == list(padded.state_dict())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_length", [None, 20])
def test_jagged_equals_padded_forward_and_gradients(seed: int, max_length: int | None) -> None:
    gen = torch.Generator().manual_seed(seed)
    jagged, padded = pair(max_length=max_length)
    batch = jagged_batch(gen, random_lengths(gen, 16))
    assert (batch[2] == 0).any() and (batch[2] > 0).any()
    out_j, grad_j = grads(jagged, *batch)
    out_p, grad_p = grads(padded, *batch)
    torch.testing.assert_close(out_j, out_p, rtol=1e-10, atol=1e-12)
    assert out_j[batch[2] == 0].abs().max() == 0  # empty rows give zeros
    assert grad_j.keys() == grad_p.keys()
    for name in grad_j:
        torch.testing.assert_close(grad_j[name], grad_p[name], rtol=1e-9, atol=1e-12, msg=name)


def test_jagged_equals_padded_float32_with_user_tiling() -> None:
    gen = torch.Generator().manual_seed(7)
    jagged, padded = pair(torch.float32)
    lens = random_lengths(gen, 5)
    ui = torch.randint(0, 5, (23,), generator=gen).tolist()
    batch = jagged_batch(gen, lens, ui, dtype=torch.float32)
    out_j, grad_j = grads(jagged, *batch)
    out_p, grad_p = grads(padded, *batch)
    torch.testing.assert_close(out_j, out_p, rtol=1e-5, atol=1e-6)
    for name in grad_j:
        torch.testing.assert_close(grad_j[name], grad_p[name], rtol=1e-4, atol=1e-5, msg=name)


def test_all_empty_and_zero_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    jagged, padded = pair()
    for lengths in ([0, 0, 0], []):
        q, s, lens, ui = jagged_batch(gen, lengths)
        for module in (jagged, padded):
            out = module(q, s, lens, ui)
            assert out.shape == (len(lengths), D) and not out.any()


def test_extreme_scores_stay_finite() -> None:
    """The per-row max shift keeps softmax finite for large scores, as the padded one does."""
    gen = torch.Generator().manual_seed(4)
    jagged, padded = pair()
    q, s, lens, ui = jagged_batch(gen, [3, 1, 0, 7])
    q, s = q * 200, s * 200
    out_j, out_p = jagged(q, s, lens, ui), padded(q, s, lens, ui)
    assert torch.isfinite(out_j).all()
    torch.testing.assert_close(out_j, out_p)


@pytest.mark.parametrize("length", [0, 1, 9])
def test_user_tiling_equals_untiled(length: int) -> None:
    """One user with N candidates (U=1, B=N) equals N copies of the user's sequence."""
    n = 37
    gen = torch.Generator().manual_seed(length)
    jagged, _ = pair()
    q, s, lens, _ = jagged_batch(gen, [length])
    q = torch.randn(n, D, generator=gen, dtype=torch.float64)
    tiled_out, tiled_grad = grads(jagged, q, s, lens, torch.zeros(n, dtype=torch.int64))
    s_rep, lens_rep = s.repeat(n, 1), lens.repeat(n)
    untiled_out, untiled_grad = grads(jagged, q, s_rep, lens_rep, torch.arange(n))
    torch.testing.assert_close(tiled_out, untiled_out)
    for name in tiled_grad:
        if name == "seq_values":  # the tiled gradient is the sum over the N copies
            expect = untiled_grad[name].reshape(n, length, D).sum(0)
            torch.testing.assert_close(tiled_grad[name], expect)
        else:
            torch.testing.assert_close(tiled_grad[name], untiled_grad[name], msg=name)


def test_bf16_autocast_runs() -> None:
    gen = torch.Generator().manual_seed(5)
    jagged, _ = pair(torch.float32)
    q, s, lens, ui = jagged_batch(gen, [4, 0, 2], dtype=torch.float32)
    ref = jagged(q, s, lens, ui)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = jagged(q, s, lens, ui)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


def test_rejects_wrong_width() -> None:
    jagged, _ = pair()
    with pytest.raises(ValueError, match="dim 48"):
        jagged(torch.zeros(2, 16), torch.zeros(3, 16), torch.tensor([3, 0]), torch.arange(2))


def _export(jagged: JaggedDIN, example: tuple) -> torch.export.ExportedProgram:
    """The DIN exported as serving loads it: dynamic users, candidates and elements."""
    users, batch, total = Dim("U", min=0), Dim("B", min=0), Dim("T", min=0)
    return torch.export.export(
        jagged, example, dynamic_shapes=({0: batch}, {0: total}, {0: users}, {0: batch})
    )


def test_export_with_dynamic_users_candidates_and_elements() -> None:
    gen = torch.Generator().manual_seed(6)
    jagged, _ = pair(torch.float32)
    jagged.eval()
    example = jagged_batch(gen, [3, 0, 5], [0, 1, 2, 2, 0], dtype=torch.float32)
    program = _export(jagged, example)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "fbgemm" in t]
    run = program.module()
    cases = [
        ([7], [0] * 100),  # user tiling: one user, 100 candidates
        ([0, 0], [0, 1]),  # only empty sequences, T = 0
        ([2, 0, 100, 1], [3, 2, 1, 0, 2, 2]),
        ([1], [0]),
        ([], []),
    ]
    for lengths, ui in cases:
        inputs = jagged_batch(gen, lengths, ui, dtype=torch.float32)
        torch.testing.assert_close(run(*inputs), jagged(*inputs))


def test_split_first_layer_scores_equal_the_concatenated_input() -> None:
    """pair_scores (serving path: the first layer split per candidate / element / pair)."""
    torch.manual_seed(3)
    din = JaggedDIN(8, [16, 4]).double()
    q, sv = torch.randn(5, 8, dtype=torch.float64), torch.randn(7, 8, dtype=torch.float64)
    seg, elem = torch.randint(0, 5, (30,)), torch.randint(0, 7, (30,))
    s = sv[elem]
    torch.testing.assert_close(din.pair_scores(q, sv, seg, elem, s), din.score(q[seg], s))


# --------------------------------------------------------------------------- training fast path


def fast_and_general(
    jagged: JaggedDIN, q: torch.Tensor, s: torch.Tensor, lens: torch.Tensor
) -> tuple[
    tuple[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]
]:
    """(output, gradients) of user_index=None and of user_index=arange(B)."""
    return grads(jagged, q, s, lens, None), grads(jagged, q, s, lens, torch.arange(len(lens)))


def assert_same(
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
    want: tuple[torch.Tensor, dict[str, torch.Tensor]],
    rtol: float = 1e-10,
    atol: float = 1e-12,
) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert got[1][name] is not None, name
        torch.testing.assert_close(got[1][name], want[1][name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fast_path_equals_general_path(seed: int) -> None:
    """user_index=None (one user per row, no sync) = general path with arange: output and
    gradients of every parameter, the query and the sequence."""
    gen = torch.Generator().manual_seed(seed)
    jagged, padded = pair()
    batch = jagged_batch(gen, random_lengths(gen, 24))
    q, s, lens, _ = batch
    assert (lens == 0).any() and (lens > 0).any()
    fast, general = fast_and_general(jagged, q, s, lens)
    assert_same(fast, general)
    assert fast[0][lens == 0].abs().max() == 0
    assert_same(fast, grads(padded, *batch), rtol=1e-9)  # and tzrec's padded DIN


@pytest.mark.parametrize("lengths", [[0, 0, 0], [], [0], [0, 1, 0], [1]])
def test_fast_path_empty_sequences(lengths: list[int]) -> None:
    """All-empty (T = 0), no rows at all (B = 0), single rows: zeros where empty, same grads."""
    gen = torch.Generator().manual_seed(8)
    jagged, _ = pair()
    q, s, lens, _ = jagged_batch(gen, lengths)
    fast, general = fast_and_general(jagged, q, s, lens)
    assert fast[0].shape == (len(lengths), D)
    assert_same(fast, general)
    assert not fast[0][lens == 0].any()


def test_fast_path_long_sequences() -> None:
    """Long sequences (past the 100 cap of the config) next to empty and short ones."""
    gen = torch.Generator().manual_seed(9)
    jagged, _ = pair()
    q, s, lens, _ = jagged_batch(gen, [300, 0, 1, 157, 2, 0, 1000, 5])
    fast, general = fast_and_general(jagged, q, s, lens)
    assert_same(fast, general, rtol=1e-9, atol=1e-12)


def test_fast_path_float32_extreme_scores_and_partial_grads() -> None:
    """Large scores stay finite; only the query (or only the sequence) needing a gradient."""
    gen = torch.Generator().manual_seed(10)
    jagged, _ = pair(torch.float32)
    q, s, lens, _ = jagged_batch(gen, [3, 1, 0, 7, 40], dtype=torch.float32)
    out = jagged(q * 200, s * 200, lens, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, jagged(q * 200, s * 200, lens, torch.arange(5)))
    for needs in ("query", "seq_values"):
        qq = q.clone().requires_grad_(needs == "query")
        ss = s.clone().requires_grad_(needs == "seq_values")
        got = torch.autograd.grad(jagged(qq, ss, lens, None).sum(), qq if needs == "query" else ss)
        want = torch.autograd.grad(
            jagged(qq, ss, lens, torch.arange(5)).sum(), qq if needs == "query" else ss
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fast_path_bf16_autocast() -> None:
    gen = torch.Generator().manual_seed(11)
    jagged, _ = pair(torch.float32)
    q, s, lens, ui = jagged_batch(gen, [4, 0, 2, 9], dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, general = jagged(q, s, lens, None), jagged(q, s, lens, ui)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, general, rtol=0.02, atol=0.02)


def test_fast_path_rejects_more_users_than_rows() -> None:
    jagged, _ = pair()
    q = torch.zeros(2, D, dtype=torch.float64)
    s = torch.zeros(3, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="one user per candidate row"):
        jagged(q, s, torch.tensor([1, 1, 1]), None)


def test_fast_path_custom_functions_gradcheck() -> None:
    """The hand-written backwards of the two autograd nodes against finite differences."""
    gen = torch.Generator().manual_seed(12)
    lens = torch.tensor([2, 0, 3, 1, 0])
    seg = torch.repeat_interleave(lens, output_size=6)
    offsets = torch.tensor([0, 2, 2, 5, 6, 6])
    scores = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    values = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    query = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, v: SortedSegmentSoftmaxPool.apply(a, v, seg, offsets), (scores, values)
    )
    assert torch.autograd.gradcheck(
        lambda qq, v: SortedPairFeatures.apply(qq, v, seg, offsets), (query, values)
    )


def test_fast_path_compiled_equals_general_path() -> None:
    """compile_fast_path (torch.compile, dynamic shapes): same function and gradients; the
    flag leaves the general path and export alone."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(13)
    jagged, _ = pair()
    jagged.compile_fast_path = True
    for lengths in (random_lengths(gen, 9), random_lengths(gen, 17), [0, 0], [200, 0, 3]):
        q, s, lens, _ = jagged_batch(gen, lengths)
        fast, general = fast_and_general(jagged, q, s, lens)
        assert_same(fast, general, rtol=1e-9, atol=1e-12)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile
    jagged.eval()
    example = jagged_batch(gen, [3, 0, 5], [0, 1, 2, 2, 0])
    program = _export(jagged, example)
    inputs = jagged_batch(gen, [7], [0] * 10)
    torch.testing.assert_close(program.module()(*inputs), jagged(*inputs))


def test_export_traces_the_general_path() -> None:
    """The exported program (serving: user_index is data) has no fast-path node in it."""
    gen = torch.Generator().manual_seed(14)
    jagged, _ = pair(torch.float32)
    jagged.eval()
    example = jagged_batch(gen, [3, 0, 5], [0, 1, 2, 2, 0], dtype=torch.float32)
    program = _export(jagged, example)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "segment_reduce" in t]
    assert len(program.graph_signature.user_inputs) == 4  # query, seq_values, lengths, user_index
