"""The keyed-initializer, row-expansion and fingerprint kernels (cuda/keyed.cu) against torch.

The GPU tests run the CUDA backend's kernels and the torch code (``KeyedInitializer``,
``hashing.fingerprint``, the torch backend's ``keyed_rows`` and ``expand_rows``) on the same
CUDA tensors and ask for bitwise equal results (``torch.equal``). Run on the GPU machine:
``python3 -m pytest -q -m gpu tests/shared/hashtable/test_cuda_keyed.py``. The CPU tests check
the kernel source's constants, signatures and the parameter arrays.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from shared.features import InitializerSpec, InitMode
from shared.hashtable import initializers
from shared.hashtable.adagrad import AdagradConfig
from shared.hashtable.cuda import keyed, sparse_update, unique
from shared.hashtable.cuda import runtime as rt
from shared.hashtable.cuda.backend import CudaBackend
from shared.hashtable.hashing import fingerprint, to_signed
from shared.hashtable.initializers import KeyedInitializer
from shared.hashtable.storage import FusedStorage
from shared.hashtable.torch_backend import TorchBackend

from .conftest import NEEDS_CUDA_KERNELS, dyn_table

gpu = pytest.mark.gpu
needs_cuda = NEEDS_CUDA_KERNELS
DEVICE = "cuda"
DIMS = [1, 16, 17, 64]
TORCH = TorchBackend()

N, T, U, C = InitMode.NORMAL, InitMode.TRUNCATED_NORMAL, InitMode.UNIFORM, InitMode.CONSTANT
SPECS = {
    "normal": InitializerSpec(N, mean=0.1, std_dev=0.05),
    "normal_wide": InitializerSpec(N, mean=-1.5, std_dev=3.0),
    "normal_std": InitializerSpec(N, std_dev=1.0),
    "normal_zero_std": InitializerSpec(N, mean=0.25, std_dev=0.0),
    "trunc": InitializerSpec(T, mean=0.2, std_dev=0.7, lower=-0.5, upper=1.1),
    "trunc_std": InitializerSpec(T, std_dev=1.0, lower=-1.0, upper=1.0),
    "trunc_narrow": InitializerSpec(T, mean=1.0, std_dev=1e-3, lower=0.999, upper=1.0),
    "trunc_near_tail": InitializerSpec(T, std_dev=1.0, lower=6.5, upper=9.0),  # t near 5
    "trunc_far_tail": InitializerSpec(T, std_dev=1.0, lower=8.0, upper=40.0),  # 1 - p < 1e-15
    "trunc_far_low": InitializerSpec(T, std_dev=1.0, lower=-40.0, upper=-8.0),  # p < 1e-15
    "trunc_clamped_p": InitializerSpec(T, std_dev=1.0, lower=-50.0, upper=-39.0),  # p -> 1e-300
    "trunc_zero_std_clamped": InitializerSpec(T, mean=0.3, std_dev=0.0, lower=-0.1, upper=0.2),
    "trunc_zero_std": InitializerSpec(T, mean=0.3, std_dev=0.0, lower=-0.1, upper=0.7),
    "uniform": InitializerSpec(U, lower=-0.2, upper=0.4),
    "uniform_wide": InitializerSpec(U, lower=-1e-3, upper=5.0),
    "uniform_point": InitializerSpec(U, lower=3.0, upper=3.0),
    "constant": InitializerSpec(C, value=0.1),
    "constant_subnormal": InitializerSpec(C, value=-3.7e-41),
}


def _keys(n: int, seed: int) -> torch.Tensor:
    """Random int64 keys over the whole range, small keys (with repeats) and edge cases."""
    g = torch.Generator().manual_seed(seed)
    special = [0, 1, 2, 3, 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**62 - 1, 2**62, 2**62 + 1]
    special += [2**63 - 1 - i for i in range(8)] + [-(2**63) + i for i in range(4)] + [-1, -2]
    return torch.cat(
        [
            torch.tensor(special, dtype=torch.int64),
            torch.randint(0, 2**63 - 1, (n,), generator=g),
            torch.randint(-(2**63), 2**63 - 1, (n // 4,), generator=g),
            torch.randint(0, 100, (n // 8,), generator=g),
        ]
    )


# ---------------------------------------------------------------- CPU


def test_kernel_constants_are_the_python_floats():
    src = rt.SOURCE.with_name(keyed.SOURCE[0]).read_text()

    def array(name: str) -> list[float]:
        m = re.search(rf"__constant__ double {name}\[(\d+)\] = \{{([^}}]*)\}};", src)
        assert m, name
        values = [float.fromhex(v) for v in m.group(2).replace("\n", " ").split(",")]
        assert len(values) == int(m.group(1)), name
        return values

    def define(name: str) -> float:
        m = re.search(rf"#define {name} (\S+)", src)
        assert m, name
        return float.fromhex(m.group(1))

    mod = initializers
    for name, py in [("A", mod._A), ("B", mod._B), ("C", mod._C), ("D", mod._D)]:
        assert array(f"KD_{name}") == py, name
    for name, py in [("E", mod._E), ("F", mod._F), ("LOG", mod._LOG_SERIES)]:
        assert array(f"KD_{name}") == py, name
    assert define("KD_LN2") == mod._LN2
    assert define("KD_SQRT_HALF") == mod._SQRT_HALF
    assert define("KD_R0") == 0.180625
    assert define("KD_SPLIT") == 0.425
    assert define("KD_NEAR") == 1.6
    assert define("KD_P_MIN") == 1e-300
    assert define("KD_P_MAX") == 1.0 - 2.0**-53


def test_init_params_layout():
    inits = [KeyedInitializer(s, seed=1, table=n) for n, s in SPECS.items()] + [None]
    p = keyed.init_params(inits, "cpu")
    assert p.prm.shape == (len(inits), keyed.NPARAMS) and p.prm.dtype == torch.float64
    assert p.iprm.shape == (len(inits), 2) and p.num_tables == len(inits)
    modes = p.iprm[:, 1].tolist()
    assert modes[-1] == keyed.MODE_NONE
    names = list(SPECS)
    i = names.index("trunc_zero_std_clamped")  # a constant: the mean clamped to [lower, upper]
    value_bits = struct.unpack("<I", struct.pack("<f", 0.2))[0]  # the constant's float32 bits
    assert modes[i] == keyed.MODE_CONSTANT and p.prm[i, 4].item() == value_bits
    i = names.index("trunc")
    lo, hi = inits[i].cdf_bounds()
    assert modes[i] == keyed.MODE_TRUNCATED_NORMAL
    assert p.prm[i, 6:].tolist() == [lo, hi - lo]
    assert p.iprm[0, 0].item() == to_signed(inits[0].salt)


def _kernel_params(path) -> dict[str, list[str]]:
    """The parameter declarations of every ``__global__`` function of a .cu file (macro
    kernels such as ``ht_ins2_stage_w##W`` under ``ht_ins2_stage_w``; templates by name)."""
    src = path.read_text().replace("\\\n", "\n")
    found = {}
    for m in re.finditer(r"__global__ void (\w+?)(?:##\w+)?\s*\(([^)]*)\)", src):
        found[m.group(1).removesuffix("_w")] = [p.strip() for p in m.group(2).split(",")]
    return found


def _signature(params: list[str]) -> str:
    kinds = {"i64": "q", "u64": "q", "int": "i", "float": "f"}
    return "".join(
        "p" if "*" in p else kinds[p.rsplit(" ", 1)[0].replace("const", "").strip()] for p in params
    )


def test_kernel_signatures_match_the_source():
    """The parameter types of every launch (runtime.Kernel: insert, find, build and keyed
    SIGNATURES) against kernels.cu, keyed.cu, sparse_update.cu and unique.cu."""
    from shared.hashtable.cuda import build, find, insert

    main = _kernel_params(rt.SOURCE)
    sigs = {**insert.SIGNATURES, **find.SIGNATURES, **build.SIGNATURES}
    assert set(main) == set(sigs)  # every kernel of kernels.cu is launched with a signature
    for family, sig in sigs.items():
        assert _signature(main[family]) == sig, family
    for name in ("ht_ins2_stage_w4", "ht_ins2_place0", "ht_ins2_place1", "ht_erase_mark_w0"):
        assert insert._family(name) in insert.SIGNATURES
    for module in (keyed, sparse_update, unique):
        kd = _kernel_params(rt.SOURCE.with_name(module.SOURCE[0]))
        assert set(module.SIGNATURES) <= set(kd)
        for name, sig in module.SIGNATURES.items():
            assert _signature(kd[name]) == sig, name


def test_kernel_arguments_fill_the_parameter_slots():
    """runtime.arg_values: pointers (None: 0), int64, int32 and float32 in signature order."""
    t = torch.zeros(3, dtype=torch.int64)
    values = rt.arg_values("pqipf", (t, rt.i64(1 << 40), True, None, 0.5))
    assert values == [t.data_ptr(), 1 << 40, 1, 0, 0.5]
    with pytest.raises(TypeError):
        rt.arg_values("pq", (t,))


# ---------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", list(SPECS))
def test_initializer_kernel_matches_torch(name: str, dim: int):
    init = KeyedInitializer(SPECS[name], seed=11, table=f"{name}_emb")
    keys = _keys(20_000, seed=dim).to(DEVICE)
    want = init(keys, dim)  # the torch code (CONSTANT: torch.full)
    direct = keyed.initial_rows(keyed.init_params([init], keys.device), keys, None, dim)
    got = CudaBackend().keyed_rows([init], keys.device)(keys, None, dim)
    assert want.dtype == got.dtype == direct.dtype == torch.float32
    assert torch.equal(direct, want), name
    assert torch.equal(got, want), name


@gpu
@needs_cuda
def test_initializer_kernel_covers_every_branch():
    """Values of each AS241 branch and of the clamps appear in the compared outputs."""
    keys = _keys(20_000, seed=3).to(DEVICE)
    kernels = CudaBackend()
    for name, lo, hi in [
        ("normal_std", -0.5, 0.5),  # central
        ("normal_std", 1.5, 5.0),  # near tail (|q| > 0.425)
        ("trunc_far_tail", 8.0, 10.0),  # far tail (t > 5)
        ("trunc_clamped_p", -39.0, -39.0),  # p clamped to 1e-300, then x to upper
    ]:
        init = KeyedInitializer(SPECS[name], seed=11, table=f"{name}_emb")
        x = kernels.keyed_rows([init], keys.device)(keys, None, 16)
        assert bool(((x >= lo) & (x <= hi)).any()), name


@gpu
@needs_cuda
def test_initializer_kernel_without_keys_and_without_initializer():
    init = KeyedInitializer(SPECS["normal"], seed=1, table="a")
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert CudaBackend().keyed_rows([init], empty.device)(empty, None, 8).shape == (0, 8)
    p = keyed.init_params([init, None], empty.device)
    keys = torch.tensor([5, 6], device=DEVICE)
    out = keyed.initial_rows(p, keys, torch.tensor([1, 0], device=DEVICE), 4)
    assert bool(out[0].isnan().all()) and not bool(out[1].isnan().any())


def _storage(dim: int) -> FusedStorage:
    names = list(SPECS)
    specs = [
        dyn_table(
            f"{n}_emb",
            dim=dim,
            initializer=SPECS[n],
            eval_initializer=SPECS[names[(i + 5) % len(names)]],
            threshold=2 if i % 3 == 0 else None,
            admission_initializer=SPECS[names[(i + 9) % len(names)]],
        )
        for i, n in enumerate(names)
    ]
    return FusedStorage(
        "group",
        specs,
        adagrad=AdagradConfig(lr=0.1),
        seed=5,
        device=torch.device(DEVICE),
    )


def _recorded_launches(monkeypatch) -> list[str]:
    """The names of the kernels launched from now on (``rt.launch`` wrapped)."""
    launches: list[str] = []
    real_launch = rt.launch

    def launch(name: str, *args, **kwargs) -> None:
        launches.append(name)
        real_launch(name, *args, **kwargs)

    monkeypatch.setattr(rt, "launch", launch)
    return launches


@gpu
@needs_cuda
@pytest.mark.parametrize("dim", DIMS)
def test_fused_fill_is_one_launch_with_the_torch_rows(dim: int, monkeypatch):
    """The CUDA backend's new rows of a list of initializers: one launch for all its tables,
    the torch backend's rows; a CUDA storage uses them (its backend is the CUDA one)."""
    s = _storage(dim)
    assert s.backend.name == "cuda" and "backend=cuda" in repr(s)
    dev = torch.device(DEVICE)
    nt = len(s.specs)
    keys = _keys(30_000, seed=dim).to(DEVICE)
    g = torch.Generator().manual_seed(dim)
    tids = torch.randint(0, nt, (keys.numel(),), generator=g).to(DEVICE)
    with_adm = [t for t in range(nt) if s.admission_init[t] is not None]
    pick = torch.randint(0, len(with_adm), (keys.numel(),), generator=g)
    adm_tids = torch.tensor(with_adm)[pick].to(DEVICE)
    both = [*s.init, *s.admission_init]  # table t + nt: admission value of table t
    both_tids = torch.where(keys % 2 == 0, tids, adm_tids + nt)
    cases = [
        (s.init, tids, s._init_rows),
        (s.eval_init, tids, s._eval_rows),
        (s.admission_init, adm_tids, None),
        (both, both_tids, s._train_rows),
        (s.init, tids[:1], s._init_rows),
    ]
    launches = _recorded_launches(monkeypatch)
    for inits, t, storage_rows in cases:
        k = keys[: t.numel()]
        want = TORCH.keyed_rows(inits, dev)(k, t, s.dim)
        assert launches == []  # the torch code launches nothing
        rows = s.backend.keyed_rows(inits, dev)
        got = rows(k, t, s.dim)
        assert launches == ["kd_initial_rows"]
        assert torch.equal(got, want)
        assert torch.equal(rows(k, t, s.dim), want)  # the parameters are kept
        if storage_rows is not None:
            assert torch.equal(storage_rows(k, t, s.dim), want)
        launches.clear()


def _runs(dim: int, n_runs: int, n_occ: int, seed: int, stored: float):
    """(values, rows, inverse, keys, which) of a lookup's runs on the GPU: a share ``stored``
    of the runs with a row (else -1), occurrences drawn with repeats, a NaN payload in
    ``values`` (its bits must survive the copy), ``which`` over every initializer of SPECS."""
    g = torch.Generator().manual_seed(seed)
    cap = 3000
    values = torch.randn(cap, dim, generator=g)
    values.view(torch.int32)[:, 0] = 0x7FC00123  # a NaN payload in every row's first column
    rows = torch.randint(0, cap, (n_runs,), generator=g)
    rows = torch.where(torch.rand(n_runs, generator=g) < stored, rows, -1)
    inverse = torch.randint(0, max(n_runs, 1), (n_occ,), generator=g)
    keys = _keys(n_runs, seed)[:n_runs]
    which = torch.randint(0, len(SPECS), (n_runs,), generator=g)
    return tuple(x.to(DEVICE) for x in (values, rows, inverse, keys, which))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # NaN == NaN, bit for bit


def _spec_inits() -> list[KeyedInitializer | None]:
    return [KeyedInitializer(s, seed=11, table=f"{n}_emb") for n, s in SPECS.items()]


@gpu
@needs_cuda
@pytest.mark.parametrize("dim", [4, 16, 17])
@pytest.mark.parametrize(
    "n_runs, n_occ, stored",
    [(5000, 12_000, 0.6), (5000, 12_000, 0.0), (5000, 12_000, 1.0), (1, 7, 0.0), (0, 0, 0.5)],
)
def test_expand_rows_kernel_matches_torch(
    dim: int, n_runs: int, n_occ: int, stored: float, monkeypatch
):
    """kd_expand_rows (one launch) against the torch backend's gather, initializer over every
    run and gather per occurrence: every init mode of SPECS, rows of -1, repeated
    occurrences, float4 (dim % 4 == 0) and per-column copies, no occurrences."""
    values, rows, inverse, keys, which = _runs(dim, n_runs, n_occ, dim + n_runs, stored)
    dev = values.device
    inits = _spec_inits()
    want_out, want_stored = TORCH.expand_rows(
        values, rows, inverse, keys, which, TORCH.keyed_rows(inits, dev)
    )
    kernels = CudaBackend()
    new_rows = kernels.keyed_rows(inits, dev)
    launches = _recorded_launches(monkeypatch)
    got_out, got_stored = kernels.expand_rows(values, rows, inverse, keys, which, new_rows)
    assert launches == ([] if n_occ == 0 else ["kd_expand_rows"])
    assert got_out.shape == want_out.shape == (n_occ, dim) and got_out.dtype == torch.float32
    assert got_stored.dtype == want_stored.dtype == torch.bool
    assert torch.equal(_bits(got_out), _bits(want_out))
    assert torch.equal(got_stored, want_stored)
    if n_occ and 0 < stored < 1:  # both kinds of occurrence were compared
        assert bool(got_stored.any()) and not bool(got_stored.all())


@gpu
@needs_cuda
def test_expand_rows_kernel_misaligned_values_and_fallbacks(monkeypatch):
    """Values not 16-byte aligned take the per-column copies; new rows that are not the
    kernel's (the torch backend's) or values that are not contiguous float32 take the torch
    algorithms; a table without an initializer gives NaN rows, as kd_initial_rows."""
    values, rows, inverse, keys, which = _runs(16, 2000, 5000, 1, 0.5)
    dev = values.device
    inits = _spec_inits()
    want = TORCH.expand_rows(values, rows, inverse, keys, which, TORCH.keyed_rows(inits, dev))
    kernels = CudaBackend()
    new_rows = kernels.keyed_rows(inits, dev)
    shifted = torch.empty(values.numel() + 1, device=dev)[1:].view(values.shape)
    shifted.copy_(values)  # contiguous, 4 bytes past a 16-byte boundary
    launches = _recorded_launches(monkeypatch)
    for vals, rows_fn, launched in [
        (shifted, new_rows, ["kd_expand_rows"]),
        (values, TORCH.keyed_rows(inits, dev), []),
        (values.t().contiguous().t(), new_rows, ["kd_initial_rows"]),  # not contiguous
    ]:
        out, stored = kernels.expand_rows(vals, rows, inverse, keys, which, rows_fn)
        assert launches == launched
        assert torch.equal(_bits(out), _bits(want[0])) and torch.equal(stored, want[1])
        launches.clear()
    # a table without an initializer (index len(SPECS)): NaN where there is no row
    p = keyed.init_params([*inits, None], dev)
    none = torch.full_like(which, len(SPECS))
    out, stored = keyed.expand_rows(p, values, rows, inverse, keys, none)
    missing = ~stored
    assert bool(out[missing].isnan().all()) and bool(missing.any())
    assert torch.equal(_bits(out[stored]), _bits(values[rows[inverse[stored]]]))


@gpu
@needs_cuda
@pytest.mark.parametrize("tids", ["none", "zero", "small", "large", "int32"])
def test_fingerprint_kernel_matches_torch(tids: str):
    keys = _keys(50_000, seed=7).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    n = keys.numel()
    t = {
        "none": None,
        "zero": torch.zeros(n, dtype=torch.int64),
        "small": torch.randint(0, 12, (n,), generator=g),
        "large": torch.randint(0, 2**31, (n,), generator=g),
        "int32": torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int32),
    }[tids]
    t = None if t is None else t.to(DEVICE)
    kernels = CudaBackend()
    want = fingerprint(keys, t)  # the torch code
    direct = keyed.fingerprint(keys, t)
    got = kernels.fingerprint(keys, t)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(direct, want) and torch.equal(got, want)
    # 2-D and non-contiguous inputs, and no keys
    k2 = keys[: 2 * 1000].view(1000, 2).t()
    t2 = None if t is None else t[: 2 * 1000].view(1000, 2).t()
    assert torch.equal(kernels.fingerprint(k2, t2), fingerprint(k2, t2))
    assert kernels.fingerprint(keys[:0], None if t is None else t[:0]).shape == (0,)
