"""The kernel sets of the sign collectives (backend/kernel_set.hpp).

- The ATen set against the SIMD set through the self-check of
  backend/kernel_check.hpp (both ways, several seeds, every ISA of this CPU),
  and the check itself against a planted fault in each kernel.
- The ATen set's pack, count_code, vote and unpack against references written
  here with plain torch ops on values (not bit patterns), at sizes past the
  check's.
- LIONBIT_KERNELS picks the set, and refuses what it does not know.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

import lionbit
from lionbit import _C, _test_hooks

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

KERNELS = [
    "pack",
    "pack_levels",
    "clean",
    "count_bits",
    "zero_codes",
    "encode_zeros",
    "decode_zeros",
    "count_code",
    "vote",
    "vote_levels",
    "all_zero",
    "break_ties",
    "encode_trits",
    "decode_trits",
    "encode_zero_counts",
    "apply_zero_counts",
    "unpack",
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]
HAVE_GPU = torch.cuda.is_available() and _C.built_with_cuda


# --- the check ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 12345])
def test_aten_set_equals_simd_set(seed):
    assert _C.check_kernel_sets("aten", "simd", seed=seed) == []
    assert _C.check_kernel_sets("simd", "aten", "cpu", seed) == []


def test_check_is_quick_on_cpu():
    _C.check_kernel_sets("aten", "simd")
    t = time.perf_counter()
    _C.check_kernel_sets("aten", "simd", seed=7)
    # Well under a second on an idle core; generous for a loaded CI box.
    assert time.perf_counter() - t < 5.0


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_aten_set_equals_each_simd_isa(isa):
    # The ISA is picked once per process (LIONBIT_ISA): a child per ISA.
    code = (
        "from lionbit import _C; import sys; "
        f"sys.exit(3) if _C.cpu_isa() != {isa!r} else None; "
        "print(_C.check_kernel_sets('aten', 'simd', seed=3))"
    )
    env = {**os.environ, "LIONBIT_ISA": isa}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if r.returncode == 3:
        pytest.skip(f"this CPU has no {isa}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("kernel", KERNELS)
def test_check_catches_a_wrong_kernel(kernel):
    found = _test_hooks.check_kernel_sets_with_fault(kernel)
    assert [name for name, _ in found] == [kernel]
    assert "[seed 0, case " in found[0][1], found


def test_test_hooks_stay_out_of_the_product_module():
    """The planted faults and single-kernel entry points live in lionbit._test_hooks only."""
    hooks = [n for n in dir(_test_hooks) if not n.startswith("__")]
    assert sorted(hooks) == ["check_kernel_sets_with_fault", "kernel_count_code", "kernel_pack", "kernel_unpack",
                             "kernel_vote"], hooks
    leaked = [n for n in dir(_C) if "fault" in n or n.startswith("_kernel_")]
    assert leaked == [], f"test hooks in lionbit._C: {leaked}"


def test_check_names_the_sets():
    with pytest.raises(ValueError, match="'simd', 'aten' or \\(CUDA builds\\) 'cuda', got 'avx'"):
        _C.check_kernel_sets("avx", "simd")
    if lionbit.built_with_cuda:  # the custom CUDA set, unchecked (tools/kernel_verdicts.py), on CUDA only
        with pytest.raises(ValueError, match="cuda set runs on CUDA devices only, not on cpu"):
            _C.check_kernel_sets("cuda", "aten", "cpu")
    with pytest.raises(ValueError, match="simd set runs on the CPU only"):
        _C.check_kernel_sets("aten", "simd", "meta")
    with pytest.raises(ValueError, match="no kernel 'packing'"):
        _test_hooks.check_kernel_sets_with_fault("packing")


# --- LIONBIT_KERNELS ----------------------------------------------------------


def test_kernels_env(monkeypatch):
    monkeypatch.delenv("LIONBIT_KERNELS", raising=False)
    assert _C.kernel_set_name("cpu") == f"simd ({_C.cpu_isa()})"
    for choice, want in [("auto", "simd"), ("custom", "simd"), ("aten", "aten")]:
        monkeypatch.setenv("LIONBIT_KERNELS", choice)
        assert _C.kernel_set_name("cpu").startswith(want), choice
    # Any other device gets the ATen set.
    monkeypatch.setenv("LIONBIT_KERNELS", "auto")
    assert _C.kernel_set_name("meta") == "aten"


def test_bogus_kernels_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("LIONBIT_KERNELS", "bogus")
    with pytest.raises(ValueError, match=r"LIONBIT_KERNELS must be auto, custom or aten, got 'bogus'"):
        _C.kernel_set_name("cpu")


# --- the ATen kernels against references written here ---------------------


def _planes_to_bits(plane):
    """uint8 plane -> bool per bit (bit i: bit i % 8 of byte i // 8)."""
    return ((plane.unsqueeze(1).to(torch.int64) >> torch.arange(8)) & 1).flatten().bool()


def _bits_to_plane(bits):
    """bool per bit (a multiple of 64) -> uint8 plane."""
    return (bits.view(-1, 8).to(torch.int64) << torch.arange(8)).sum(1).to(torch.uint8)


def _random_plane(gen, words):
    return torch.randint(0, 256, (words * 8,), dtype=torch.uint8, generator=gen)


def _special(n, dtype, gen):
    """Values with +-0, denormals, +-Inf and NaN mixed in."""
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    pick = torch.rand(n, generator=gen)
    x[pick < 0.10] = 0.0
    x[(pick >= 0.10) & (pick < 0.15)] = -0.0
    x[(pick >= 0.15) & (pick < 0.18)] = float("inf")
    x[(pick >= 0.18) & (pick < 0.21)] = -float("inf")
    x[(pick >= 0.21) & (pick < 0.24)] = float("nan")
    if dtype == torch.int8:
        return (x.nan_to_num(0.0).clamp(-3, 3) * 40).to(torch.int8)
    x = x.to(dtype)
    # Denormals of the dtype itself, both signs.
    tiny = torch.full((n,), torch.finfo(dtype).smallest_normal / 4, dtype=dtype)
    tiny[torch.rand(n, generator=gen) < 0.5] *= -1
    den = (pick >= 0.24) & (pick < 0.30)
    x[den] = tiny[den]
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,offset", [(1, 0), (65, 3), (1000, 64), ((1 << 16) + 13, 61)])
def test_aten_pack_against_values(dtype, n, offset):
    gen = torch.Generator().manual_seed(n + offset)
    x = _special(n, dtype, gen)
    # The reference compares values in float64 (exact for every dtype here).
    v = x.to(torch.float64)
    want_pos, want_zero = v > 0, v == 0
    words = (offset + n + 63) // 64 + 1
    sign0, zero0 = _random_plane(gen, words), _random_plane(gen, words)
    want_sign, want_zeroplane = _planes_to_bits(sign0), _planes_to_bits(zero0)
    want_sign[offset : offset + n] = want_pos
    want_zeroplane[offset : offset + n] = want_zero

    sign, zero = sign0.clone(), zero0.clone()
    # Flush-to-zero must not turn a denormal into a zero: the sets test bit patterns.
    torch.set_flush_denormal(True)
    try:
        zeros, nans = _test_hooks.kernel_pack("aten", x, sign, zero, offset)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(sign, _bits_to_plane(want_sign))
    assert torch.equal(zero, _bits_to_plane(want_zeroplane))
    assert zeros == int(want_zero.sum())
    assert nans == int(v.isnan().sum())


def _contributions(gen, N, words, zero_ranks):
    """N ranks' sign values (+1, 0, -1 per element) and their planes."""
    values, signs, zeros = [], [], []
    for r in range(N):
        v = torch.randint(-1, 2, (words * 64,), generator=gen)
        if r not in zero_ranks:
            v[v == 0] = 1
        values.append(v)
        signs.append(_bits_to_plane(v > 0))
        zeros.append(_bits_to_plane(v == 0) if r in zero_ranks else None)
    return torch.stack(values), signs, zeros


@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("zero_ranks", ["none", "some"])
def test_aten_vote_and_count_code_against_sums(N, zero_ranks):
    gen = torch.Generator().manual_seed(N)
    words = 129
    ranks = set() if zero_ranks == "none" else set(range(0, N, 2))
    values, signs, zeros = _contributions(gen, N, words, ranks)
    total = values.sum(0)

    sign = torch.empty(words * 8, dtype=torch.uint8)
    tie = torch.empty_like(sign)
    _test_hooks.kernel_vote("aten", signs, zeros, sign, tie)
    assert torch.equal(_planes_to_bits(sign), total > 0)
    assert torch.equal(_planes_to_bits(tie), total == 0)

    # The code: #positive, or 2 #positive + #zero with a zero plane anywhere.
    positive = (values > 0).sum(0)
    code = positive if not ranks else 2 * positive + (values == 0).sum(0)
    planes = (N if not ranks else 2 * N).bit_length()
    out = torch.empty(planes * words * 8, dtype=torch.uint8)
    _test_hooks.kernel_count_code("aten", signs, zeros, out)
    for b in range(planes):
        got = _planes_to_bits(out[b * words * 8 : (b + 1) * words * 8])
        assert torch.equal(got, (code >> b) & 1 == 1), b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nplanes", [0, 1, 2, 3, 6, 11])
def test_aten_unpack_against_lookup(dtype, nplanes):
    gen = torch.Generator().manual_seed(nplanes)
    n = 5000 + nplanes
    words = (n + 63) // 64
    planes = [_random_plane(gen, words) for _ in range(nplanes)]
    # Any bit patterns: a NaN's payload must come through.
    lut_bytes = torch.randint(0, 256, ((1 << nplanes) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    lut = lut_bytes.view(dtype)
    code = torch.zeros(words * 64, dtype=torch.int64)
    for b, p in enumerate(planes):
        code |= _planes_to_bits(p).to(torch.int64) << b
    want = lut_bytes.view(-1, dtype.itemsize)[code[:n]].flatten()

    dst = torch.empty(n, dtype=dtype)
    _test_hooks.kernel_unpack("aten", planes, lut, dst)
    assert torch.equal(dst.view(torch.uint8), want)


# --- on a GPU ---------------------------------------------------------------


@pytest.mark.gpu
def test_aten_set_on_cuda_equals_simd_on_cpu():
    if not HAVE_GPU:
        pytest.skip("no CUDA device, or lionbit built without the CUDA path")
    # The check between the ATen set and itself runs every ATen kernel on the GPU.
    assert _C.check_kernel_sets("aten", "aten", "cuda") == []
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        x = _special(100_003, dtype, gen)
        planes = {}
        for name, dev in [("simd", "cpu"), ("aten", "cuda")]:
            s = torch.zeros(12_600, dtype=torch.uint8, device=dev)
            z = torch.zeros_like(s)
            counts = _test_hooks.kernel_pack(name, x.to(dev), s, z, 5)
            planes[name] = (s.cpu(), z.cpu(), counts)
        assert torch.equal(planes["simd"][0], planes["aten"][0]), dtype
        assert torch.equal(planes["simd"][1], planes["aten"][1]), dtype
        assert planes["simd"][2] == planes["aten"][2], dtype
    _, signs, zeros = _contributions(gen, 5, 33, {1, 3})
    out = {}
    for name, dev in [("simd", "cpu"), ("aten", "cuda")]:
        s = torch.empty(33 * 8, dtype=torch.uint8, device=dev)
        t = torch.empty_like(s)
        _test_hooks.kernel_vote(name, [p.to(dev) for p in signs], [p if p is None else p.to(dev) for p in zeros], s, t)
        out[name] = (s.cpu(), t.cpu())
    assert torch.equal(out["simd"][0], out["aten"][0]) and torch.equal(out["simd"][1], out["aten"][1])
