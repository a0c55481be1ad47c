"""The CUDA path: GPU kernels against the CPU kernels, the sign all-reduce on
CUDA tensors (NCCL at world size 1, several ranks on one GPU over Gloo),
standard collectives routed by device, DistributedLion + DDP on CUDA
tensors against the same run on CPU tensors, FSDP2 and FSDP1 on CUDA
parameters against DDP on CUDA parameters, and LIONBIT_KERNELS=custom
against aten.

Marked ``gpu``: ``make test-gpu`` runs them; without a GPU (or without the
CUDA build) each test is skipped with the reason. The tests that need no GPU
(the build facts, the transport setting) run everywhere.
"""

import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

import lionbit
from harness import run_ranks, values
from lionbit import _C, kernel_choice, lion_math

HAVE_GPU = torch.cuda.is_available()
if not lionbit.built_with_cuda:
    SKIP_REASON = "lionbit was built without the CUDA path (no nvcc or a CPU-only torch at build time)"
elif not HAVE_GPU:
    SKIP_REASON = "no CUDA device: torch.cuda.is_available() is False on this machine"
else:
    SKIP_REASON = ""
GLOO = {"LIONBIT_CUDA_TRANSPORT": "gloo"}  # several ranks on one GPU: NCCL refuses


# --- everywhere -------------------------------------------------------------


def test_built_with_cuda_where_nvcc_and_cuda_torch_are():
    """`make test` here compiles the CUDA path whenever it can."""
    can = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")
    if os.environ.get("LIONBIT_EXPECT_CUDA") == "0":
        pytest.skip("LIONBIT_EXPECT_CUDA=0")
    if can and torch.version.cuda:
        assert lionbit.built_with_cuda, "nvcc and a CUDA build of torch are present, but the CUDA path was not built"
        for name in ("lion_direction_into_device", "lion_apply_device"):
            assert hasattr(_C, name)
    else:
        assert not lionbit.built_with_cuda or torch.version.cuda


def test_cuda_transport_setting(monkeypatch):
    from lionbit._backend import cuda_transport

    monkeypatch.setenv("LIONBIT_CUDA_TRANSPORT", "gloo")
    assert cuda_transport() == "gloo"
    monkeypatch.setenv("LIONBIT_CUDA_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="LIONBIT_CUDA_TRANSPORT"):
        cuda_transport()
    monkeypatch.delenv("LIONBIT_CUDA_TRANSPORT")
    assert cuda_transport() == ("nccl" if dist.is_nccl_available() else "gloo")


def _cuda_tensor_without_gpu(rank, world_size):
    # A CPU-only machine cannot make a CUDA tensor; a meta tensor stands in
    # for "a device the sign path does not take" and must fail clearly.
    x = torch.empty(8, device="meta")
    try:
        lionbit.all_reduce_sign(x)
    except (RuntimeError, ValueError) as err:
        return str(err)
    return "no error"


def test_unsupported_device_is_a_clear_error():
    msgs = values(run_ranks("test_cuda:_cuda_tensor_without_gpu", 2))
    for m in msgs:
        assert "lionbit" in m and "meta" in m, m


# --- on a GPU ---------------------------------------------------------------


def _skip_without_gpu():
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]
SIZES = [0, 1, 7, 63, 64, 65, 1000, 4099, (1 << 20) + 13]


def _special(n, dtype, gen):
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    if n:
        x[torch.rand(n, generator=gen) < 0.1] = 0.0
        x[torch.rand(n, generator=gen) < 0.05] = -0.0
        x[torch.rand(n, generator=gen) < 0.02] = float("inf")
        x[torch.rand(n, generator=gen) < 0.02] = -float("inf")
        x[torch.rand(n, generator=gen) < 0.02] = 1e-310  # subnormal in float64
        x[torch.rand(n, generator=gen) < 0.01] = float("nan")
    if dtype == torch.int8:
        return (x.nan_to_num(0.0).clamp(-3, 3) * 40).to(torch.int8)
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_kernel_equals_cpu(dtype):
    _skip_without_gpu()
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        for off in (0, 1, 37, 64, 130):
            x = _special(n, dtype, gen)
            nbytes = (off + n + 63) // 64 * 8 + 8
            s_cpu = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
            z_cpu = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
            s_gpu, z_gpu = s_cpu.cuda(), z_cpu.cuda()
            zeros, nans = _C.pack_signs_into(x, s_cpu, z_cpu, off)
            counts = _C.pack_signs_into(x.cuda(), s_gpu, z_gpu, off)  # the kernel set of the GPU, host counts
            assert torch.equal(s_gpu.cpu(), s_cpu), (dtype, n, off)
            assert torch.equal(z_gpu.cpu(), z_cpu), (dtype, n, off)
            assert counts == (zeros, nans), (dtype, n, off)


@pytest.mark.gpu
def test_pack_levels_on_cuda_equals_cpu():
    _skip_without_gpu()
    gen = torch.Generator().manual_seed(4)
    for bits in (2, 4, 8):
        for n in SIZES:
            for off in (0, 3, 64):
                c = _special(n, torch.float32, gen)
                plane = (off + n + 63) // 64 * 8 + 8
                cpu = torch.randint(0, 256, (bits * plane,), generator=gen, dtype=torch.uint8)
                gpu = cpu.cuda()
                want = _C.pack_levels_into(c, 0.37, bits, cpu, off)
                got = _C.pack_levels_into(c.cuda(), 0.37, bits, gpu, off)
                assert got == want and torch.equal(gpu.cpu(), cpu), (bits, n, off)


@pytest.mark.gpu
def test_packers_refuse_planes_on_another_device():
    _skip_without_gpu()
    cpu = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="argument 'sign' is on cpu but argument 't' is on cuda"):
        _C.pack_signs_into(torch.ones(5, device="cuda"), cpu, cpu.cuda(), 0)
    with pytest.raises(ValueError, match="argument 'planes' is on cuda:0 but argument 'c' is on cpu"):
        _C.pack_levels_into(torch.ones(5), 1.0, 2, cpu.cuda(), 0)


@pytest.mark.gpu
def test_fused_apply_passes_its_first_use_check():
    _skip_without_gpu()
    assert kernel_choice.check_apply(_C.lion_apply_device, "cuda") is None
    if kernel_choice.requested() == "auto":
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert lionbit.kernels("cuda")["lion"] == "fused"


@pytest.mark.gpu
def test_the_direction_list_takes_spans_on_cuda_as_on_cpu():
    """FSDP's chunks of a parameter as (tensor, start, length) on the device: the bits,
    tallies and momenta of the CPU's list call over the same spans (bf16 gradients, whose
    spans start off a 16-byte boundary, and float32, one span of each tensor empty)."""
    _skip_without_gpu()
    gen = torch.Generator().manual_seed(11)
    args = (0.9, 0.1, 0.99, 0.01)
    for gdt, mdt in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        gs = [torch.randn(n, generator=gen).to(gdt) for n in (1000, 4099)]
        ms = [torch.randn(n, generator=gen).to(mdt) for n in (1000, 4099)]
        cuts = [(0, 3, 500), (0, 503, 0), (1, 0, 4099), (0, 503, 497), (1, 17, 2000)]
        offsets, off = [], 5
        for *_, n in cuts:
            offsets.append(off)
            off += n + 3
        nbytes = lion_math.plane_bytes(off)
        starts, lengths = [a for _, a, _ in cuts], [n for *_, n in cuts]
        want = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
        want_bad = _C.lion_direction_list([gs[i] for i, _, _ in cuts], [ms[i].clone() for i, _, _ in cuts], *args,
                                          *want, offsets, False, starts=starts, lengths=lengths)
        got = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        counts = torch.zeros(2, dtype=torch.int64, device="cuda")
        dev_ms = [m.cuda() for m in ms]
        _C.lion_direction_list_device([gs[i].cuda() for i, _, _ in cuts], [dev_ms[i] for i, _, _ in cuts], *args,
                                      *got, counts, offsets, False, starts=starts, lengths=lengths)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (gdt, mdt)
        assert int(counts[1]) == want_bad
        # the momentum update of non-overlapping spans: those elements only
        spans = [(1, 0, 17), (1, 2017, 2082)]
        want_ms = [m.clone() for m in ms]
        _C.lion_direction_list([gs[i] for i, _, _ in spans], [want_ms[i] for i, _, _ in spans], *args, None, None,
                               [0, 0], True, starts=[a for _, a, _ in spans], lengths=[n for *_, n in spans])
        _C.lion_direction_list_device([gs[i].cuda() for i, _, _ in spans], [dev_ms[i] for i, _, _ in spans], *args,
                                      None, None, None, [0, 0], True, starts=[a for _, a, _ in spans],
                                      lengths=[n for *_, n in spans])
        for a, b in zip(dev_ms, want_ms):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)), (gdt, mdt)


@pytest.mark.gpu
def test_list_kernels_pass_their_checks_and_a_step_equals_cpu():
    """The fused kernels of many tensors in one launch: their first-use
    checks, then a user's single-process loop (two parameter groups, tensors
    from one element to a matrix, bf16 and fp32 parameters, a frozen one,
    weight decay) on CUDA bit for bit the same as on CPU."""
    _skip_without_gpu()
    assert kernel_choice.check_direction_list(_C.lion_direction_list_device, "cuda") is None
    assert kernel_choice.check_apply_list(_C.lion_apply_list_device, "cuda") is None
    assert kernel_choice.check_apply_planes_list(_C.lion_apply_planes_list_device, "cuda") is None
    shapes = [(1,), (7,), (64,), (65,), (300, 129), (1024,), (3, 5), (4096, 33)]

    def run(device):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(
            torch.bfloat16 if i % 3 == 0 else torch.float32).to(device)) for i, s in enumerate(shapes)]
        frozen = params[5]
        opt = lionbit.DistributedLion([{"params": params[:4], "lr": 1e-2},
                                       {"params": params[4:], "lr": 3e-3, "weight_decay": 0.1}],
                                      momentum_dtype=torch.float32)
        for step in range(4):
            for p in params:
                p.grad = None if p is frozen and step % 2 else (torch.randn(p.shape, generator=gen) * 0.5).to(
                    p.dtype).to(device)
            opt.step()
        return [p.detach().cpu() for p in params]

    for a, b in zip(run("cuda"), run("cpu")):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
def test_fused_lion_kernels_equal_cpu(gdt, mdt):
    _skip_without_gpu()
    gen = torch.Generator().manual_seed(2)
    for n in SIZES:
        for off in (0, 5, 64):
            g = _special(n, torch.float32, gen).nan_to_num(0.0).to(gdt)
            m = (torch.randn(n, generator=gen) * 1e-3).to(mdt)
            m0 = m.clone()
            nbytes = (off + n + 63) // 64 * 8 + 8
            s, z = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
            sg, zg = s.cuda(), z.cuda()
            mg = m.cuda()
            # c = fl(fl(0.9 m) + fl(0.1 g)) in float32, each operation rounded on its own (torch
            # on CPU): its non-finite count is what both kernels return (a bfloat16 / float16 g
            # holds +-Inf: float32's max rounds up).
            b1, omb1 = torch.tensor(0.9, dtype=torch.float32), torch.tensor(0.1, dtype=torch.float32)
            c = m.float() * b1 + g.float() * omb1
            nonfinite = _C.lion_direction_into(g, m, 0.9, 0.1, 0.99, 0.01, s, z, off)
            assert nonfinite == int((~torch.isfinite(c)).sum()), (n, off)
            counts = torch.zeros(2, dtype=torch.int64, device="cuda")
            # The momentum only read first (the step's vote): the same bits, m untouched.
            s_ro, z_ro, c_ro = sg.clone(), zg.clone(), counts.clone()
            _C.lion_direction_into_device(g.cuda(), mg, 0.9, 0.1, 0.99, 0.01, s_ro, z_ro, c_ro, off,
                                          update_momentum=False)
            assert torch.equal(mg.cpu().view(torch.int16 if mdt != torch.float32 else torch.int32),
                               m0.view(torch.int16 if mdt != torch.float32 else torch.int32)), (n, off)
            _C.lion_direction_into_device(g.cuda(), mg, 0.9, 0.1, 0.99, 0.01, sg, zg, counts, off)
            assert torch.equal(s_ro, sg) and torch.equal(z_ro, zg) and torch.equal(c_ro, counts), (n, off)
            assert torch.equal(mg.cpu().view(torch.int16 if mdt != torch.float32 else torch.int32),
                               m.view(torch.int16 if mdt != torch.float32 else torch.int32)), (n, off)
            assert torch.equal(sg.cpu(), s) and torch.equal(zg.cpu(), z), (n, off)
            assert int(counts[1]) == nonfinite, (n, off)
            assert int(counts[0]) == int((c == 0).sum()), (n, off)
            for pdt in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(n, generator=gen)).to(pdt)
                d = torch.randint(-1, 2, (n,), generator=gen).to(torch.bfloat16)
                xg = x.cuda()
                _C.lion_apply(x, d, 3e-4, 1 - 3e-4 * 0.1)
                _C.lion_apply_device(xg, d.cuda(), 3e-4, 1 - 3e-4 * 0.1)
                view = torch.int32 if pdt == torch.float32 else torch.int16
                assert torch.equal(xg.cpu().view(view), x.view(view)), (n, pdt)


# --- collectives on CUDA tensors (run on every rank) ---------------------------


def _device(rank):
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _sign_cuda(rank, world_size, seed):
    from test_sign_allreduce import OPS, _bits, _make, _reference, _shapes

    dev = _device(rank)
    bad = []
    shapes = _shapes(world_size) + [((1 << 20) + 13,)]
    for dtype in DTYPES:
        for op in OPS:
            if dtype == torch.int8 and op == "avg":
                continue
            for shape in shapes:
                for kind in ("random", "zeros", "stray", "tie", "shared"):
                    x = _make(rank, world_size, shape, dtype, kind, seed)
                    ref = _reference(x, op, world_size)
                    y = x.to(dev)
                    if len(shape) == 2:  # a non-contiguous view
                        y = y.t()
                        ref = ref.t()
                    work = lionbit.all_reduce_sign(y, op, async_op=True)
                    work.wait()
                    cpu = x.clone() if len(shape) != 2 else x.clone().t()
                    lionbit.all_reduce_sign(cpu, op)
                    if not torch.equal(_bits(y.cpu()), _bits(ref)) or not torch.equal(_bits(cpu), _bits(ref)):
                        bad.append(f"{dtype} {op} {shape} {kind}")
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nccl", "copy"])
def test_sign_allreduce_cuda_world_size_1_nccl(transport):
    """World size 1: through the inner NCCL communicator
    (LIONBIT_ONE_RANK_COPY=0, the one test of the NCCL transport where one
    GPU is all there is), and as a one-rank group's copies (the default)."""
    _skip_without_gpu()
    env = {"LIONBIT_ONE_RANK_COPY": "0"} if transport == "nccl" else None
    assert values(run_ranks("test_cuda:_sign_cuda", 1, kwargs={"seed": 3}, timeout=600, env=env)) == [[]]


def _wait_with_timeout_orders_streams(rank, world_size):
    """A user's ``work.wait(timeout)`` then a read on the current stream: the
    read must see the whole result, as after ``work.wait()``."""
    from datetime import timedelta

    dev = _device(rank)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1 << 26, generator=gen)
    want = x.clone()
    lionbit.all_reduce_sign(want, "vote")
    bad = 0
    for _ in range(3):
        y = x.to(dev)
        torch.cuda._sleep(50_000_000)  # the caller's stream busy: the worker's kernels start late
        work = lionbit.all_reduce_sign(y, "vote", async_op=True)
        work.wait(timedelta(seconds=120))
        got = y.clone()  # queued on the current stream at once
        bad += int(not torch.equal(got.cpu(), want))
    return bad


@pytest.mark.gpu
def test_wait_with_a_timeout_orders_the_callers_stream():
    _skip_without_gpu()
    assert values(run_ranks("test_cuda:_wait_with_timeout_orders_streams", 1, timeout=300)) == [0]


def _one_large_chunk(rank, world_size, device="cuda", log2_n=29, log2_chunk=30):
    """Chunks past 2^31 bytes of input: a sign all-reduce of 2^29 + 4099 float32
    elements (2 GiB) and DistributedLion's step on as many bfloat16 parameters,
    each as one chunk of 2^30 elements (LIONBIT_CHUNK_ELEMS, votes of 2^30)
    against the default chunks. At world size 1 the vote is the input's sign.
    (device="cpu" and smaller sizes: the same checks on the CPU path.)"""
    from lionbit import step_vote

    dev = _device(rank) if device == "cuda" else torch.device(device)
    votes = "CHUNK_ELEMENTS_GPU" if dev.type == "cuda" else "CHUNK_ELEMENTS"
    n = (1 << log2_n) + 4099
    gen = torch.Generator(device=dev).manual_seed(11)
    x = torch.randn(n, device=dev, generator=gen)
    x[:: 1 << 20] = 0.0
    x[-4099:] = -x[-4099:]
    bad = []

    def step(vote_elements):
        p = torch.nn.Parameter(x.to(torch.bfloat16) * 0.01)
        p.grad = torch.roll(x, 12345).to(torch.bfloat16)
        opt = lionbit.DistributedLion([p], lr=1e-3, weight_decay=0.1, momentum_dtype=torch.bfloat16)
        saved = getattr(step_vote, votes)
        setattr(step_vote, votes, vote_elements)
        try:
            for _ in range(2):
                opt.step()
        finally:
            setattr(step_vote, votes, saved)
        return p.detach(), opt.state[p]["exp_avg"]

    os.environ["LIONBIT_CHUNK_ELEMS"] = str(1 << log2_chunk)
    try:  # (a pooled rank runs later cases: the setting must not outlive this one)
        y = x.clone()
        lionbit.all_reduce_sign(y, "vote")
        if not torch.equal(y, torch.sign(x) + 0.0):  # (+ 0.0: a zero votes +0.0, never -0.0)
            bad.append(f"sign all-reduce of one 2^{log2_chunk} chunk != sign(x)")
        del y
        big = step(1 << log2_chunk)
    finally:
        del os.environ["LIONBIT_CHUNK_ELEMS"]
    default = step(getattr(step_vote, votes))
    if not (torch.equal(big[0], default[0]) and torch.equal(big[1], default[1])):
        bad.append(f"DistributedLion with one 2^{log2_chunk} chunk != with the default chunks")
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("log2_n,log2_chunk", [(29, 30), (30, 31)])
def test_one_chunk_past_two_gib_equals_the_default_chunks(log2_n, log2_chunk):
    """(2^30 + 4099 elements: element indices past 2^30, float32 byte offsets
    past 2^32, in one chunk of 2^31.)"""
    _skip_without_gpu()
    kwargs = {"log2_n": log2_n, "log2_chunk": log2_chunk}
    assert values(run_ranks("test_cuda:_one_large_chunk", 1, kwargs=kwargs, timeout=600)) == [[]]


def _lists_past_two_to_the_31(device):
    """The direction and apply-from-planes lists with a second tensor at bit
    2^31 + 37 of the planes (a vote of 2^30 elements and more puts a step's
    tensors there), against the CPU's lists: what differs, as text."""
    off, n = [5, (1 << 31) + 37], [1000, 4099]
    gen = torch.Generator().manual_seed(7)
    gs = [torch.randn(k, generator=gen).to(torch.bfloat16) for k in n]
    ms = [torch.randn(k, generator=gen) for k in n]
    xs = [torch.randn(k, generator=gen).to(torch.bfloat16) for k in n]
    coefs = (0.9, 0.1, 0.99, 0.01)

    def planes(dev):
        return [torch.zeros(lion_math.plane_bytes(off[1] + n[1]), dtype=torch.uint8, device=dev) for _ in range(2)]

    cs, cz = planes("cpu")
    bad = _C.lion_direction_list(gs, [m.clone() for m in ms], *coefs, cs, cz, off, False)
    cx = [x.clone() for x in xs]
    _C.lion_apply_planes_list(cx, cs, cz, off, 1e-3, 0.999)
    ds, dz = planes(device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    _C.lion_direction_list_device([g.to(device) for g in gs], [m.to(device) for m in ms], *coefs, ds, dz, counts,
                                  off, False)
    dx = [x.to(device) for x in xs]
    _C.lion_apply_planes_list_device(dx, ds, dz, off, 1e-3, 0.999)
    diff = []
    if not (torch.equal(ds.cpu(), cs) and torch.equal(dz.cpu(), cz)):
        diff.append("the direction list's planes")
    if int(counts[1]) != bad:
        diff.append(f"non-finite count {int(counts[1])} != {bad}")
    diff += [f"parameter {i} after the apply" for i, (a, b) in enumerate(zip(dx, cx))
             if not torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))]
    return diff


@pytest.mark.gpu
def test_the_list_kernels_take_bit_offsets_past_two_to_the_31():
    _skip_without_gpu()
    assert _lists_past_two_to_the_31("cuda") == []


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3, 4])
def test_sign_allreduce_cuda_several_ranks_one_gpu_gloo(n):
    _skip_without_gpu()
    got = values(run_ranks("test_cuda:_sign_cuda", n, kwargs={"seed": n}, env=GLOO, timeout=900))
    assert got == [[]] * n


def _ties_cuda(rank, world_size):
    """The CUDA vote with each tie rule against the CPU path (whose bits
    tests/python/test_lion_cub.py checks against a numpy reference)."""
    from test_lion_cub import _inputs

    dev = _device(rank)
    bad = []
    for rule in ("alternate", "random"):
        for numel, seed in ((10_000, 4), ((1 << 20) + 13, 7)):
            x = _inputs(rank, world_size, numel, seed)
            # Every rule keeps 0 exactly where every rank votes 0 (a still element).
            still = torch.stack([_inputs(r, world_size, numel, seed) == 0 for r in range(world_size)]).all(0)
            cpu, gpu = x.clone(), x.to(dev)
            lionbit.all_reduce_sign(cpu, "vote", tie_break=rule, tie_seed=seed)
            lionbit.all_reduce_sign(gpu, "vote", tie_break=rule, tie_seed=seed)
            differ = int((gpu.cpu() != cpu).sum())
            zeros_off = int(((cpu == 0) != still).sum())
            if differ or zeros_off:
                bad.append(f"{rule} {numel}: {differ} elements differ, {zeros_off} zeros not still")
    return bad


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_tie_rules_on_cuda_equal_cpu_gloo(n):
    _skip_without_gpu()
    assert values(run_ranks("test_cuda:_ties_cuda", n, env=GLOO, timeout=600)) == [[]] * n


@pytest.mark.gpu
def test_sign_allreduce_cuda_nccl_several_gpus():
    _skip_without_gpu()
    k = torch.cuda.device_count()
    if k < 2:
        pytest.skip(f"NCCL needs one GPU per rank; this machine has {k}")
    n = min(k, 4)
    assert values(run_ranks("test_cuda:_sign_cuda", n, kwargs={"seed": 5}, timeout=900)) == [[]] * n


def _hierarchy_cuda(rank, world_size):
    """hierarchy="node" on CUDA tensors (the same orchestration, the device's
    kernels and ATen's bit-sliced sums) against the flat vote on the CPU."""
    from test_hierarchy import OPS, _bits, _data

    dev = _device(rank)
    topo = lionbit.Topology((0, 0, 1, 1))
    bad = []
    for n in (1000, (1 << 20) + 13):
        for op, tie in OPS:
            for zeros in ("none", "dense", "still"):
                x = _data(7, rank, n, torch.float32, zeros)
                cpu = x.clone()
                lionbit.all_reduce_sign(cpu, op, tie_break=tie, tie_seed=3)
                gpu = x.to(dev)
                lionbit.all_reduce_sign(gpu, op, tie_break=tie, tie_seed=3, hierarchy="node", topology=topo)
                s = n // world_size
                rs_cpu = torch.empty(s)
                lionbit.reduce_scatter_sign(rs_cpu, x[: s * world_size], op, tie_break=tie, tie_seed=3)
                rs_gpu = torch.empty(s, device=dev)
                lionbit.reduce_scatter_sign(rs_gpu, x[: s * world_size].to(dev), op, tie_break=tie, tie_seed=3,
                                            hierarchy="node")
                ar, rs = int((gpu.cpu() != cpu).sum()), int((rs_gpu.cpu() != rs_cpu).sum())
                if _bits(gpu.cpu()) != _bits(cpu) or _bits(rs_gpu.cpu()) != _bits(rs_cpu):
                    bad.append(f"{n} {op}/{tie} {zeros}: all-reduce {ar}, reduce-scatter {rs} elements differ")
    return bad


@pytest.mark.gpu
def test_hierarchy_on_cuda_equals_flat_cpu_gloo():
    _skip_without_gpu()
    assert values(run_ranks("test_cuda:_hierarchy_cuda", 4, env=GLOO, timeout=900)) == [[]] * 4


def _mixed_devices(rank, world_size):
    dev = _device(rank)
    out = {}
    a = torch.full((5,), float(rank + 1))
    b = torch.full((5,), float(rank + 1), device=dev)
    dist.all_reduce(a)
    dist.all_reduce(b)
    want = float(sum(range(1, world_size + 1)))
    out["cpu"] = a.tolist() == [want] * 5
    out["cuda"] = b.cpu().tolist() == [want] * 5 and b.is_cuda
    parts = [torch.empty(3, device=dev) for _ in range(world_size)]
    dist.all_gather(parts, torch.full((3,), float(rank), device=dev))
    out["all_gather"] = [p.cpu().tolist() for p in parts] == [[float(r)] * 3 for r in range(world_size)]
    s_cpu = torch.tensor([1.0, -1.0, 0.0, 2.0])
    s_gpu = s_cpu.to(dev)
    lionbit.all_reduce_sign(s_cpu)
    lionbit.all_reduce_sign(s_gpu)
    out["sign"] = s_cpu.tolist() == s_gpu.cpu().tolist() == [1.0, -1.0, 0.0, 1.0]
    dist.barrier()
    be = dist.distributed_c10d._get_default_group()._get_backend(dev)
    out["transport"] = be.cuda_transport
    return out


@pytest.mark.gpu
def test_cpu_and_cuda_tensors_go_to_their_transports_gloo():
    _skip_without_gpu()
    for v in values(run_ranks("test_cuda:_mixed_devices", 2, env=GLOO)):
        assert v == {"cpu": True, "cuda": True, "all_gather": True, "sign": True, "transport": "gloo"}


@pytest.mark.gpu
def test_cpu_and_cuda_tensors_go_to_their_transports_nccl_one_rank():
    _skip_without_gpu()
    (v,) = values(run_ranks("test_cuda:_mixed_devices", 1))
    assert v == {"cpu": True, "cuda": True, "all_gather": True, "sign": True, "transport": "nccl"}


def _coalesced_gathers(rank, world_size, device_type):
    """The all-gathers Gloo runs as host code on any pointer (its coalesced
    ones: torch's functional all_gather_into_tensor, DTensor.full_tensor()),
    on CUDA tensors through the Gloo transport: exact, no crash."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = _device(rank) if device_type == "cuda" else torch.device("cpu")
    pg = dist.group.WORLD
    out = {}
    a = torch.arange(6, dtype=torch.float32, device=dev).reshape(2, 3) + 10 * rank
    want_a = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(world_size)])
    got = funcol.all_gather_tensor(a, 0, pg)
    out["funcol"] = bool(torch.equal(got.wait() if hasattr(got, "wait") else got, want_a.to(dev)))
    b = torch.full((5,), rank - 0.5, dtype=torch.bfloat16, device=dev)
    outs = [torch.empty(world_size * 2, 3, device=dev), torch.empty(world_size * 5, dtype=torch.bfloat16, device=dev)]
    pg.allgather_into_tensor_coalesced(outs, [a, b]).wait()
    want_b = torch.cat([torch.full((5,), r - 0.5, dtype=torch.bfloat16) for r in range(world_size)])
    out["into_tensor_coalesced"] = bool(torch.equal(outs[0].cpu(), want_a) and torch.equal(outs[1].cpu(), want_b))
    lists = [[torch.empty_like(a), torch.empty_like(b)] for _ in range(world_size)]
    pg.allgather_coalesced(lists, [a, b]).wait()
    out["coalesced"] = all(
        torch.equal(lists[r][0].cpu(), want_a[2 * r : 2 * r + 2])
        and torch.equal(lists[r][1].cpu(), want_b[5 * r : 5 * r + 5])
        for r in range(world_size)
    )
    full = torch.arange(4 * world_size * 3, dtype=torch.float32).reshape(4 * world_size, 3)
    mesh = init_device_mesh(device_type, (world_size,))
    dt = distribute_tensor(full.to(dev), mesh, [Shard(0)])
    out["full_tensor"] = bool(torch.equal(dt.full_tensor().cpu(), full))
    return out


ALL_GATHERED = {"funcol": True, "into_tensor_coalesced": True, "coalesced": True, "full_tensor": True}


def test_coalesced_all_gathers_on_cpu():
    for v in values(run_ranks("test_cuda:_coalesced_gathers", 2, kwargs={"device_type": "cpu"})):
        assert v == ALL_GATHERED, v


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_coalesced_all_gathers_on_cuda_through_gloo(n):
    _skip_without_gpu()
    got = run_ranks("test_cuda:_coalesced_gathers", n, kwargs={"device_type": "cuda"}, env=GLOO, timeout=300)
    for v in values(got):
        assert v == ALL_GATHERED, v


def _split_backends(rank, world_size):
    dev = _device(rank)
    pg = dist.distributed_c10d._get_default_group()
    x = torch.tensor([1.0, -1.0, 2.0], device=dev) * (1 if rank == 0 else -1)
    lionbit.all_reduce_sign(x, "sum")
    calls = lionbit.stats()["sign_allreduce_calls"]
    return {"cpu": pg._get_backend(torch.device("cpu")).name(), "sum": x.cpu().tolist(), "calls": calls}


@pytest.mark.gpu
def test_cpu_gloo_cuda_lionbit():
    _skip_without_gpu()
    for v in values(run_ranks("test_cuda:_split_backends", 2, backend="cpu:gloo,cuda:lionbit", env=GLOO)):
        assert v == {"cpu": "gloo", "sum": [0.0, 0.0, 0.0], "calls": 1}


def _device_mismatch(rank, world_size):
    dev = _device(rank)
    x = torch.ones(100, device=dev if rank == 0 else "cpu")
    try:
        lionbit.all_reduce_sign(x)
    except Exception as err:  # noqa: BLE001
        return str(err)
    return "no error"


@pytest.mark.gpu
def test_cuda_on_one_rank_cpu_on_another_is_a_clear_error():
    _skip_without_gpu()
    for m in values(run_ranks("test_cuda:_device_mismatch", 2, env=GLOO, timeout=120)):
        assert "device type differs across ranks" in m, m


class _FourDLinear(torch.nn.Module):
    """torch.nn.Linear(96, 7) whose weight is a (7, 4, 3, 8) channels_last
    parameter (a convolution weight's shape and layout), used as (7, 96): DDP
    keeps its gradient in the bucket in that layout."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().reshape(7, 4, 3, 8).contiguous(memory_format=torch.channels_last)
        self.weight, self.bias = torch.nn.Parameter(w), linear.bias

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.reshape(7, 96), self.bias)


def _ddp_linear(rank, world_size, device, steps, aggregation, fused, channels_last=False, double_buffer=False):
    """A linear model with a linear loss and small-integer inputs: every
    gradient is an exact integer whatever the summation order, so a CPU and a
    CUDA run see the same gradients and must end bitwise equal (and a run
    with the weight in a channels_last 4-D layout, the same as one without)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _device(rank) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Linear(96, 7)
    model = (_FourDLinear(model) if channels_last else model).to(dev)
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = lionbit.DistributedLion(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 3e-3, "weight_decay": 0.0}],
        lr=2**-10,
        weight_decay=0.5,
        aggregation=aggregation,
        fused=fused,
        double_buffer=double_buffer,
    )
    opt.attach(ddp)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(-2, 3, (16, 96), generator=gen).float().to(dev)
        t = torch.randint(-1, 2, (16, 7), generator=gen).float().to(dev)
        opt.zero_grad()
        loss = (ddp(x) * t).sum()  # dloss/dW = t^T x: exact integers
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in model.parameters()])
    return flat.view(torch.int32).tolist()


def _ddp_both(rank, world_size, steps, aggregation, fused, channels_last=False, double_buffer=False):
    cpu = _ddp_linear(rank, world_size, "cpu", steps, aggregation, fused)
    gpu = _ddp_linear(rank, world_size, "cuda", steps, aggregation, fused, channels_last, double_buffer)
    return {"equal": cpu == gpu, "hash": hash(tuple(gpu))}


def _ddp_layouts(rank, world_size, steps):
    """The CPU run with the weight contiguous and channels_last."""
    return [_ddp_linear(rank, world_size, "cpu", steps, "vote", None, cl) for cl in (False, True)]


def test_a_channels_last_weight_steps_as_a_contiguous_one():
    """The exact-gradient DDP run, its weight a channels_last 4-D parameter:
    bitwise the contiguous run (the GPU twin below)."""
    for contiguous, channels_last in values(run_ranks("test_cuda:_ddp_layouts", 2, kwargs={"steps": 6})):
        assert contiguous == channels_last


@pytest.mark.gpu
@pytest.mark.parametrize("aggregation", ["vote", "avg"])
@pytest.mark.parametrize("fused", [True, False])
def test_distributed_lion_ddp_cuda_matches_cpu(aggregation, fused):
    _skip_without_gpu()
    got = values(run_ranks("test_cuda:_ddp_both", 3, kwargs={"steps": 25, "aggregation": aggregation, "fused": fused},
                           env=GLOO, timeout=600))
    assert all(v["equal"] for v in got), got
    assert len({v["hash"] for v in got}) == 1, "replicas differ across ranks"


@pytest.mark.gpu
def test_distributed_lion_ddp_double_buffer_cuda_matches_cpu():
    """double_buffer=True on the GPU (the hook's list kernels write the next
    momenta into the second buffers, swapped in at step()): the CPU run with
    one buffer, bitwise."""
    _skip_without_gpu()
    got = values(run_ranks("test_cuda:_ddp_both", 3, kwargs={"steps": 25, "aggregation": "vote", "fused": None,
                                                             "double_buffer": True}, env=GLOO, timeout=600))
    assert all(v["equal"] for v in got), got
    assert len({v["hash"] for v in got}) == 1, "replicas differ across ranks"


@pytest.mark.gpu
def test_distributed_lion_ddp_channels_last_cuda_matches_cpu():
    """The weight a channels_last 4-D parameter on the GPU (DDP's bucket holds
    its gradient in that layout): the contiguous CPU run, bitwise."""
    _skip_without_gpu()
    got = values(run_ranks("test_cuda:_ddp_both", 2, kwargs={"steps": 12, "aggregation": "vote", "fused": None,
                                                             "channels_last": True}, env=GLOO, timeout=600))
    assert all(v["equal"] for v in got), got


# --- FSDP2 and FSDP1 on CUDA parameters; the kernel choice ------------------------------

# Several ranks on one GPU, and cuBLAS deterministic for a given shape: DDP
# and FSDP compute the same gradients bit for bit.
GLOO_DETERMINISTIC = {**GLOO, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _fsdp_cuda_vs_ddp(rank, world_size, kind, configs, steps):
    """FSDP2 (kind "fsdp2") or FSDP1 on CUDA parameters against DDP +
    DistributedLion on CUDA parameters: the same model, seeds and batches as
    tests/python/test_fsdp.py's CPU parity tests. configs: (accumulate,
    aggregation, FSDP1 (strategy, use_orig_params); FSDP2: None, or
    "double_buffer" for DistributedLion(double_buffer=True))."""
    from test_fsdp import _digest, _full_params, _net, _train_ddp, _train_fsdp
    from test_fsdp1 import _params, _train_fsdp1, _wrap

    dev = _device(rank)
    out = []
    for accumulate, aggregation, fsdp1 in configs:
        ddp = _train_ddp(rank, steps, accumulate, aggregation, device=dev)
        if kind == "fsdp2":
            model, _, _ = _train_fsdp(rank, steps, accumulate, aggregation, device=dev,
                                      double_buffer=fsdp1 == "double_buffer")
            full = _full_params(model)
        else:
            strategy, use_orig = fsdp1
            model = _wrap(_net(), strategy, use_orig, device=dev)
            model, _ = _train_fsdp1(rank, steps, accumulate, aggregation, strategy, use_orig, model=model)
            full = _params(model)
        out.append(
            {
                "same": [bool(torch.equal(a, b)) for a, b in zip(ddp, full)],
                "cuda": all(t.is_cuda for t in full),
                "digest": _digest(full),
            }
        )
    return out


FSDP2_CUDA = [(1, "vote", None), (2, "avg", None), (1, "l1:4+alternate", None), (1, "vote+random", None),
              (2, "vote", "double_buffer")]
FSDP1_CUDA = [
    (1, "vote", ("FULL_SHARD", False)),
    (2, "avg", ("SHARD_GRAD_OP", True)),
    (1, "vote", ("NO_SHARD", False)),
    (1, "l1:4", ("FULL_SHARD", True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,configs", [("fsdp2", FSDP2_CUDA), ("fsdp1", FSDP1_CUDA)])
def test_fsdp_on_cuda_parameters_equals_ddp_bitwise(kind, configs):
    _skip_without_gpu()
    got = values(
        run_ranks(
            "test_cuda:_fsdp_cuda_vs_ddp",
            3,
            kwargs={"kind": kind, "configs": configs, "steps": 8},
            env=GLOO_DETERMINISTIC,
            timeout=600,
        )
    )
    failures = []
    for i, cfg in enumerate(configs):
        for rank, r in enumerate(got):
            if not (r[i]["cuda"] and all(r[i]["same"])):
                failures.append((kind, cfg, f"rank {rank}", r[i]))
        if len({r[i]["digest"] for r in got}) != 1:
            failures.append((kind, cfg, "ranks' parameters differ"))
    assert not failures, failures


def _kernels_ddp(rank, world_size, steps):
    dev = _device(rank)
    runs = {agg: _ddp_linear(rank, world_size, "cuda", steps, agg, None) for agg in ("vote", "avg")}
    return {"params": runs, "kernels": lionbit.kernels(dev)}


@pytest.mark.gpu
def test_custom_and_aten_kernels_give_the_same_ddp_run_on_cuda():
    _skip_without_gpu()
    runs = {
        choice: values(
            run_ranks(
                "test_cuda:_kernels_ddp",
                2,
                kwargs={"steps": 10},
                env={**GLOO, "LIONBIT_KERNELS": choice},
                timeout=600,
            )
        )
        for choice in ("custom", "aten")
    }
    assert [r["kernels"] for r in runs["aten"]] == [{"sign": "aten", "lion": "torch"}] * 2
    assert all(r["kernels"]["lion"] == "fused" and r["kernels"]["sign"] != "aten" for r in runs["custom"])
    for custom, aten in zip(runs["custom"], runs["aten"]):
        assert custom["params"] == aten["params"]
