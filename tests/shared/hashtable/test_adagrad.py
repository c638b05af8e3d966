"""Sparse Adagrad equals torch.optim.Adagrad bit for bit."""

from __future__ import annotations

import torch

from shared.hashtable.adagrad import AdagradConfig, adagrad_update, fma_f32


def test_fma_is_correctly_rounded():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32768, generator=g) * 3
    c = torch.rand(32768, generator=g) * 2
    # torch's vectorized CPU addcmul is a true FMA on this path
    assert torch.equal(fma_f32(a, a, c), c.clone().addcmul_(a, a, value=1))
    # many exact float32 midpoints: products of small dyadic numbers
    a = torch.randint(-(2**12), 2**12, (32768,), generator=g).float() * 2**-6
    c = torch.randint(0, 2**24, (32768,), generator=g).float() * 2**-10
    exact = (c.double() + a.double() * a.double()).float()  # exact sum, one rounding
    assert torch.equal(fma_f32(a, a, c), exact)


def test_matches_torch_adagrad_over_steps():
    g = torch.Generator().manual_seed(1)
    rows, dim = 64, 16
    init = torch.randn(rows, dim, generator=g)
    grads = [torch.randn(rows, dim, generator=g) * (s + 1) for s in range(4)]
    param = torch.nn.Parameter(init.clone())
    opt = torch.optim.Adagrad(
        [param], lr=0.05, eps=1e-10, initial_accumulator_value=0.1, foreach=False
    )
    values, accum = init.clone(), torch.full((rows, dim), 0.1)
    cfg = AdagradConfig(lr=0.05, eps=1e-10, initial_accumulator_value=0.1)
    touched = torch.arange(0, rows, 2)  # a sparse subset of rows per step
    for grad in grads:
        dense = torch.zeros(rows, dim)
        dense[touched] = grad[touched]
        param.grad = dense
        opt.step()
        adagrad_update(values, accum, touched, grad[touched], cfg)
    assert torch.equal(values, param.detach())
    assert torch.equal(accum, opt.state[param]["sum"])
