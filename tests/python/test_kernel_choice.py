"""LIONBIT_KERNELS and the first-use check of the fused Lion kernels
(lionbit.kernel_choice), on CPU: a wrong candidate kernel is caught, warned
about once and replaced by the torch path; ``aten`` turns the fused kernels
off and changes no bit of a run; the packers' device checks."""

import hashlib
import warnings

import numpy as np
import pytest
import torch

import lionbit
from harness import run_ranks, values
from lionbit import _C, kernel_choice, lion_math

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

# -- candidates for the check ------------------------------------------------------


def _right(x, delta, lr, decay):
    _C.lion_apply(x, delta, lr, decay)


def _off_by_one_ulp_in_float16(x, delta, lr, decay):
    """Right except for the last element of float16 parameters of more than a vector."""
    _C.lion_apply(x, delta, lr, decay)
    if x.dtype == torch.float16 and x.numel() > 64:
        x.view(torch.int16)[-1] += 1


def _one_rounding(x, delta, lr, decay):
    """x * decay - lr * delta rounded once (what an FMA gives), not per operation."""
    x.copy_((x.double() * decay - lr * delta.double()).to(x.dtype))


def _ignores_weight_decay(x, delta, lr, decay):
    _C.lion_apply(x, delta, lr, 1.0)


def _drops_the_tail(x, delta, lr, decay):
    """A vector kernel that forgets the elements past the last whole vector of 8."""
    whole = x.numel() // 8 * 8
    if whole:
        _C.lion_apply(x[:whole], delta[:whole], lr, decay)


WRONG = [_off_by_one_ulp_in_float16, _one_rounding, _ignores_weight_decay, _drops_the_tail]


def test_the_right_kernel_passes():
    assert kernel_choice.check_apply(_right, "cpu") is None
    check = kernel_choice.FirstUseCheck("lion_apply", _right)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check.ok("cpu") and check.ok(torch.device("cpu"))


@pytest.mark.parametrize("candidate", WRONG, ids=lambda f: f.__name__)
def test_a_wrong_kernel_is_caught_and_named(candidate):
    case = kernel_choice.check_apply(candidate, "cpu")
    assert case is not None and "parameter" in case and "n=" in case
    check = kernel_choice.FirstUseCheck(candidate.__name__, candidate)
    with pytest.warns(RuntimeWarning, match=f"fused Lion kernel {candidate.__name__} on cpu .*{case}") as got:
        assert not check.ok("cpu")
    assert len(got) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the verdict is remembered
        assert not check.ok("cpu")


# -- the fused direction's check ----------------------------------------------------


def _zero_bits(plane) -> int:
    return int(sum(bin(b).count("1") for b in plane.tolist()))


def _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    """The CPU fused direction, with the counts the CUDA kernel's interface adds."""
    before = _zero_bits(zero)
    counts[1] += _C.lion_direction_into(g, m, b1, omb1, b2, omb2, sign, zero, off, update_momentum=update,
                                        m_out=m_out)
    counts[0] += _zero_bits(zero) - before


def _writes_momentum_always(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, True, m_out)


def _counts_nan_only(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    """Right bits, but Inf directions not counted (they would be applied)."""
    c = lion_math_direction(g, m, b1, omb1)
    _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out)
    counts[1] -= int(torch.isinf(c).sum())


def _offset_ignored(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, 0, update, m_out)


def _m_out_ignored(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    """The new momentum written in place where a second buffer was given."""
    _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update)


def _m_out_and_m_written(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out=None):
    """The new momentum in the second buffer, and in m as well."""
    _right_direction(g, m if m_out is None else m.clone(), b1, omb1, b2, omb2, sign, zero, counts, off, update, m_out)
    if m_out is not None:
        m.copy_(m_out)


def lion_math_direction(g, m, b1, omb1):
    return torch.add(torch.mul(m.float(), torch.tensor(b1, dtype=torch.float32)),
                     torch.mul(g.float(), torch.tensor(omb1, dtype=torch.float32)))


def test_the_direction_check_passes_the_right_kernel_and_names_wrong_ones():
    assert kernel_choice.check_direction(_right_direction, "cpu") is None
    for wrong, what in ((_writes_momentum_always, "update_momentum=False: momentum"),
                        (_counts_nan_only, ": counts"), (_offset_ignored, ": direction bits"),
                        (_m_out_ignored, "update_momentum=m_out: momentum written"),
                        (_m_out_and_m_written, "update_momentum=m_out: momentum written")):
        case = kernel_choice.check_direction(wrong, "cpu")
        assert case is not None and what in case and "n=" in case, (wrong.__name__, case)
    check = kernel_choice.FirstUseCheck("broken_direction", _offset_ignored, kernel_choice.check_direction)
    with pytest.warns(RuntimeWarning, match="fused Lion kernel broken_direction on cpu"):
        assert not check.ok("cpu")


# -- the list kernels' checks (a launch for many tensors) -----------------------------


def _spans(gs, ms, starts, lengths):
    """The pairs of a list call as the views its spans stand for."""
    if starts is None:
        return gs, ms
    return ([g.view(-1)[a : a + k] for g, a, k in zip(gs, starts, lengths)],
            [m.view(-1)[a : a + k] for m, a, k in zip(ms, starts, lengths)])


def _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts=None, lengths=None,
                          m_outs=None):
    """The CPU fused direction tensor by tensor: what a list kernel must give."""
    outs = [None] * len(gs) if m_outs is None else _spans(m_outs, m_outs, starts, lengths)[0]
    gs, ms = _spans(gs, ms, starts, lengths)
    for g, m, off, out in zip(gs, ms, offsets, outs):
        if sign is None:
            scratch = torch.zeros(lion_math_plane_bytes(g.numel()) + 8, dtype=torch.uint8)
            _C.lion_direction_into(g, m, b1, omb1, b2, omb2, scratch, scratch.clone(), 0, update_momentum=True,
                                   m_out=out)
        else:
            _right_direction(g, m, b1, omb1, b2, omb2, sign, zero, counts, off, update, out)


def _neighbours_overwritten(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, **spans):
    """Each tensor packed into fresh planes whose whole words are stored: a
    tensor's edge word loses its neighbour's bits (a plain store where an
    atomic was needed)."""
    if sign is None:
        return _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, **spans)
    for g, m, off in zip(*_spans(gs, ms, spans.get("starts"), spans.get("lengths")), offsets):
        s, z = torch.zeros_like(sign), torch.zeros_like(zero)
        _right_direction(g, m, b1, omb1, b2, omb2, s, z, counts, off, update)
        first, end = off // 8, (off + g.numel() + 7) // 8
        sign[first:end], zero[first:end] = s[first:end], z[first:end]


def _momentum_update_skips_the_last(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, **spans):
    n = len(gs) - 1 if sign is None else len(gs)
    spans = {key: v[:n] for key, v in spans.items()}
    _right_direction_list(gs[:n], ms[:n], b1, omb1, b2, omb2, sign, zero, counts, offsets[:n], update, **spans)


def _cpu_list_kernel(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts=None, lengths=None,
                     m_outs=None):
    """The CPU's list kernel (which returns the non-finite count and counts no
    zeros) in the device list kernels' form."""
    if sign is None:
        _C.lion_direction_list(gs, ms, b1, omb1, b2, omb2, None, None, offsets, update_momentum=update,
                               starts=starts, lengths=lengths, m_outs=m_outs)
        return
    before = int(np.unpackbits(zero.numpy()).sum())
    counts[1] += _C.lion_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, offsets, update_momentum=update,
                                        starts=starts, lengths=lengths, m_outs=m_outs)
    counts[0] += int(np.unpackbits(zero.numpy()).sum()) - before


def _starts_ignored(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts=None, lengths=None,
                    m_outs=None):
    """Each span read from its tensor's first element (a table whose data
    pointers were not moved by the span's start)."""
    starts = None if starts is None else [0] * len(starts)
    _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts, lengths, m_outs)


def _m_outs_ignored(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, **spans):
    """The new momenta written in place where second buffers were given."""
    spans.pop("m_outs", None)
    _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, **spans)


def _spans_updated_whole(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts=None, lengths=None,
                         m_outs=None):
    """The momentum update of whole tensors where spans were asked for."""
    if m_outs is not None:
        return _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts,
                                     lengths, m_outs)
    if sign is None:
        starts = lengths = None
        seen = {id(m): (g, m) for g, m in zip(gs, ms)}
        gs, ms = [g for g, _ in seen.values()], [m for _, m in seen.values()]
        offsets = [0] * len(gs)
    _right_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update, starts, lengths)


def lion_math_plane_bytes(n):
    return (n + 63) // 64 * 8


def _right_apply_list(xs, deltas, lr, decay):
    for x, d in zip(xs, deltas):
        _C.lion_apply(x, d, lr, decay)


def _apply_list_misses_the_second(xs, deltas, lr, decay):
    _right_apply_list(xs[:1] + xs[2:], deltas[:1] + deltas[2:], lr, decay)


def test_the_list_checks_pass_right_kernels_and_name_wrong_ones():
    assert kernel_choice.check_direction_list(_right_direction_list, "cpu") is None
    assert kernel_choice.check_apply_list(_right_apply_list, "cpu") is None
    assert kernel_choice.check_direction_list(_cpu_list_kernel, "cpu") is None
    whole = f"{kernel_choice.CHECK_SIZES}: "
    for wrong, layout, what in ((_neighbours_overwritten, whole, "direction bits"),
                                (_momentum_update_skips_the_last, whole, "momentum"),
                                (_starts_ignored, ", spans: ", "direction bits"),
                                (_spans_updated_whole, ", spans: ", "momentum"),
                                (_m_outs_ignored, whole, "momentum written")):
        case = kernel_choice.check_direction_list(wrong, "cpu")
        assert case is not None and case.endswith(layout + what), (wrong.__name__, case)
    case = kernel_choice.check_apply_list(_apply_list_misses_the_second, "cpu")
    assert case is not None and "deltas, sizes" in case
    check = kernel_choice.FirstUseCheck("broken_list", _neighbours_overwritten, kernel_choice.check_direction_list,
                                        "the fused kernels tensor by tensor")
    with pytest.warns(RuntimeWarning, match="broken_list on cpu .*uses the fused kernels tensor by tensor"):
        assert not check.ok("cpu")


def _planes_apply_reads_one_bit_late(xs, sign, zero, offsets, lr, decay, **spans):
    _C.lion_apply_planes_list(xs, sign, zero, [o + 1 for o in offsets], lr, decay, **spans)


def _planes_apply_as_values(xs, sign, zero, offsets, lr, decay, starts=None, lengths=None):
    starts = starts or [0] * len(xs)
    lengths = lengths or [x.numel() for x in xs]
    for x, off, a, k in zip(xs, offsets, starts, lengths):
        _C.lion_apply(x[a : a + k], lion_math.VotedPlanes(sign, zero, off, k).values(), lr, decay)


def _planes_apply_starts_ignored(xs, sign, zero, offsets, lr, decay, starts=None, lengths=None):
    """Each span written from its tensor's first element (a table whose data
    pointers were not moved by the span's start)."""
    starts = None if starts is None else [0] * len(starts)
    _C.lion_apply_planes_list(xs, sign, zero, offsets, lr, decay, starts=starts, lengths=lengths)


def test_the_planes_apply_check_passes_right_kernels_and_names_wrong_ones():
    assert kernel_choice.check_apply_planes_list(_C.lion_apply_planes_list, "cpu") is None
    assert kernel_choice.check_apply_planes_list(_planes_apply_as_values, "cpu") is None
    case = kernel_choice.check_apply_planes_list(_planes_apply_reads_one_bit_late, "cpu")
    assert case is not None and case.startswith("float32 parameters, sizes") and "from bit 5" in case, case
    case = kernel_choice.check_apply_planes_list(_planes_apply_starts_ignored, "cpu")
    assert case is not None and case.startswith("float32 parameters, sizes") and "from bit 5, spans" in case, case


def test_the_planes_apply_list_names_a_span_out_of_range():
    x, sign = torch.zeros(10), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"lion_apply_planes_list: elements \[4, 4 \+ 7\) of xs\[0\] \(10 elements\)"):
        _C.lion_apply_planes_list([x], sign, sign.clone(), [0], 1e-3, 0.9, starts=[4], lengths=[7])
    with pytest.raises(ValueError, match="lion_apply_planes_list: 1 entries of 'xs', 2 starts and 2 lengths"):
        _C.lion_apply_planes_list([x], sign, sign.clone(), [0], 1e-3, 0.9, starts=[0, 1], lengths=[1, 1])
    assert torch.equal(x, torch.zeros(10))  # nothing written


def test_the_check_leaves_the_global_random_state_alone():
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    kernel_choice.check_apply(_right, "cpu")
    assert torch.equal(torch.rand(3), want)


# -- DistributedLion (single process: no process group) ----------------------------


def _lion_run(steps=5, dtype=torch.float32, momentum_dtype=None):
    """A small model's parameters' bits after ``steps`` single-process steps
    (weight decay on), and whether the fused kernels served its parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 67), torch.nn.Tanh(), torch.nn.Linear(67, 5)).to(dtype)
    opt = lionbit.DistributedLion(model.parameters(), lr=0.01, weight_decay=0.1, momentum_dtype=momentum_dtype)
    gen = torch.Generator().manual_seed(1)
    fused = []
    for _ in range(steps):
        x = torch.randn(16, 13, generator=gen).to(dtype)
        y = torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        fused = [opt.fused_for(p, p.grad) for p in model.parameters()]
        opt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().view(torch.int16 if dtype != torch.float32 else torch.int32).numpy().tobytes())
    return h.hexdigest(), fused


@pytest.mark.parametrize("dtype,momentum_dtype", [(torch.float32, None), (torch.bfloat16, torch.bfloat16)])
def test_aten_uses_the_torch_path_and_changes_no_bit(monkeypatch, dtype, momentum_dtype):
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    assert lionbit.kernels() == {"sign": _C.kernel_set_name("cpu"), "lion": "fused"}
    assert lionbit.kernels()["sign"].startswith("simd")
    fused, used = _lion_run(dtype=dtype, momentum_dtype=momentum_dtype)
    assert all(used)
    monkeypatch.setenv(kernel_choice.ENV, "aten")
    assert lionbit.kernels("cpu") == {"sign": "aten", "lion": "torch"}
    plain, used = _lion_run(dtype=dtype, momentum_dtype=momentum_dtype)
    assert not any(used)
    assert plain == fused
    monkeypatch.setenv(kernel_choice.ENV, "custom")
    assert lionbit.kernels(torch.device("cpu"))["lion"] == "fused"


def test_a_failed_check_falls_back_to_the_torch_path(monkeypatch):
    """``auto`` with a (deliberately wrong) first-use check on the CPU: the
    first fused call warns once, names the kernel, and from then on the
    device runs the torch path, bitwise as the fused run; ``custom`` skips
    the check."""
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    want, _ = _lion_run()
    check = kernel_choice.FirstUseCheck("broken_apply", _drops_the_tail)
    monkeypatch.setitem(kernel_choice.CHECKS, "cpu", check)
    monkeypatch.setenv(kernel_choice.ENV, "custom")
    assert lionbit.kernels()["lion"] == "fused" and check.verdicts == {}
    monkeypatch.setenv(kernel_choice.ENV, "auto")
    with pytest.warns(RuntimeWarning, match="broken_apply on cpu") as got:
        digest, used = _lion_run()
    assert len(got) == 1, [str(w.message) for w in got]
    assert not any(used) and digest == want
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lionbit.kernels() == {"sign": _C.kernel_set_name("cpu"), "lion": "torch"}
    # fused=True asks for the fused kernels; a failed check still wins
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10))
    assert not lionbit.DistributedLion([p], fused=True).fused_for(p, p)


def test_a_passed_check_keeps_the_fused_kernels(monkeypatch):
    monkeypatch.delenv(kernel_choice.ENV, raising=False)
    monkeypatch.setitem(kernel_choice.CHECKS, "cpu", kernel_choice.FirstUseCheck("lion_apply", _right))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, used = _lion_run(steps=2)
    assert all(used)
    assert kernel_choice.CHECKS["cpu"].verdicts == {torch.device("cpu"): True}


def test_an_invalid_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(kernel_choice.ENV, "fastest")
    with pytest.raises(ValueError, match="LIONBIT_KERNELS.*'fastest'"):
        lionbit.kernels()
    with pytest.raises(ValueError, match="LIONBIT_KERNELS"):
        kernel_choice.requested()
    with pytest.raises(ValueError, match="LIONBIT_KERNELS"):
        _lion_run(steps=1)


def test_kernels_is_exported():
    assert "kernels" in lionbit.__all__ and lionbit.kernels is kernel_choice.kernels


# -- DDP on 2 ranks: aten against the default ----------------------------------------


def _ddp_digest(rank, world_size, aggregation):
    from test_fsdp import _digest, _train_ddp

    params = _train_ddp(rank, 6, 1, aggregation)
    return {"digest": _digest(params), "kernels": lionbit.kernels()}


@pytest.mark.parametrize("aggregation", ["vote", "avg", "l1:4+random"])
def test_aten_ddp_run_is_bitwise_the_fused_run(aggregation):
    runs = {
        choice: values(
            run_ranks(
                "test_kernel_choice:_ddp_digest",
                2,
                kwargs={"aggregation": aggregation},
                env={kernel_choice.ENV: choice},
            )
        )
        for choice in ("auto", "aten")
    }
    assert [r["kernels"]["lion"] for r in runs["auto"]] == ["fused", "fused"]
    assert [r["kernels"] for r in runs["aten"]] == [{"sign": "aten", "lion": "torch"}] * 2
    assert [r["digest"] for r in runs["auto"]] == [r["digest"] for r in runs["aten"]]
    assert len({r["digest"] for r in runs["auto"]}) == 1


# -- the packers: one device per call ------------------------------------------------


def test_packers_name_the_argument_on_another_device():
    meta = torch.empty(16, dtype=torch.uint8, device="meta")
    cpu = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pack_signs_into: argument 'sign' is on meta but argument 't' is on cpu"):
        _C.pack_signs_into(torch.ones(5), meta, cpu, 0)
    with pytest.raises(ValueError, match="pack_signs_into: argument 'zero' is on meta"):
        _C.pack_signs_into(torch.ones(5), cpu, meta, 0)
    with pytest.raises(ValueError, match="pack_levels_into: argument 'planes' is on meta but argument 'c' is on cpu"):
        _C.pack_levels_into(torch.ones(5), 1.0, 4, torch.empty(32, dtype=torch.uint8, device="meta"), 0)
    with pytest.raises(ValueError, match="argument 't' must be a contiguous tensor of float32"):
        _C.pack_signs_into(torch.ones(4, 4).t(), cpu, cpu, 0)


def test_packers_keep_the_other_bits_and_count():
    gen = torch.Generator().manual_seed(3)
    for n, off in ((1, 0), (70, 3), (130, 64), (5, 123)):
        x = torch.randn(n, generator=gen)
        x[::7] = 0.0
        x[1::11] = float("nan")
        sign = torch.randint(0, 256, (32,), generator=gen, dtype=torch.uint8)
        zero = torch.randint(0, 256, (32,), generator=gen, dtype=torch.uint8)
        s0, z0 = sign.clone(), zero.clone()
        zeros, nans = _C.pack_signs_into(x, sign, zero, off)
        assert (zeros, nans) == (int((x == 0).sum()), int(x.isnan().sum()))
        bits = lambda t: ((t.view(torch.int64).unsqueeze(1) >> torch.arange(64)) & 1).reshape(-1)
        inside = torch.zeros(256, dtype=torch.bool)
        inside[off : off + n] = True
        assert torch.equal(bits(sign)[~inside], bits(s0)[~inside])
        assert torch.equal(bits(zero)[~inside], bits(z0)[~inside])
        assert torch.equal(bits(sign)[inside].bool(), x > 0) and torch.equal(bits(zero)[inside].bool(), x == 0)
