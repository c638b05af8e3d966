"""JaggedDIN against tzrec's padded DIN: same weights, same outputs and gradients; user tiling;
torch.export with dynamic sizes."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from train.model.din import JaggedDIN, PaddedDIN

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
    module: torch.nn.Module, q: torch.Tensor, s: torch.Tensor, lens: torch.Tensor, ui: torch.Tensor
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


def test_export_with_dynamic_users_candidates_and_elements() -> None:
    gen = torch.Generator().manual_seed(6)
    jagged, _ = pair(torch.float32)
    jagged.eval()
    example = jagged_batch(gen, [3, 0, 5], [0, 1, 2, 2, 0], dtype=torch.float32)
    users, batch, total = Dim("U", min=0), Dim("B", min=0), Dim("T", min=0)
    program = torch.export.export(
        jagged, example, dynamic_shapes=({0: batch}, {0: total}, {0: users}, {0: batch})
    )
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
