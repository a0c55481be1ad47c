"""DistributedLion's local work per step against plain torch Lion (foreach ops).

One process, world size 1 on the "lionbit" backend (on CUDA: NCCL underneath),
so DistributedLion's step is its local work: the direction and its 1-bit pack,
the sign all-reduce's own kernels (count / vote, unpack) on one rank's planes,
the momentum update and the fused apply. The reference is Lion written with
torch's foreach ops (the fastest plain-torch Lion: one kernel per op over all
tensors), momentum in the parameters' dtype. Two parameter lists, bf16,
gradients random:

  stack        4096 x 10240 matrices (--params, default ~1B parameters)
  gpt2-medium  a GPT-2-medium-shaped model's list (~355M parameters, 292
               tensors: embeddings, per-layer qkv / proj / MLP matrices and
               their biases, LayerNorm weights and biases)

Beside each step it reports the list's memory-traffic floor (a fused Lion
step reads parameter, gradient and momentum and writes parameter and
momentum: 10 bytes per bf16 parameter, over this GPU's measured
device-to-device copy bandwidth) and the kernel launches of one step (the
profiler's device events; CUDA only).

    python bench/gpu_lion_step.py [--lists stack,gpt2-medium] [--params 1e9] [--device cuda] [--json FILE]
                                  [--trace-dir DIR] [--chunks 28/26,28/28,...]

Prints one line per method: median ms per step over --steps timed steps
(after 3 warm-ups), the host's ms until step() returned (before the closing
device synchronisation: near the step's own ms, the step waits on the
host), the ratio to torch Lion and to the floor, launches per step and
device allocations (cudaMalloc) per warm step. Goals:
DistributedLion <= 1.0x torch Lion on both lists; stretch <= 1.5x the
floor. --trace-dir writes each method's profiled step on each list as a
gzipped Chrome trace (lion_step_LIST_METHOD_DEVICE.trace.json.gz), which
tools/trace_summary.py reads: where the device waited and on what.

The double_buffer row keeps a second buffer for every momentum (the next
momentum written in the pass that packs the direction: five passes over
memory a parameter, fused Lion's, where one buffer makes seven).

--chunks adds rows of DistributedLion (bf16 momentum) with other chunk
sizes, each V/C: votes of 2^V elements (step_vote.CHUNK_ELEMENTS_GPU, the
step's grouping of tensors into sign all-reduce calls) and the backend's
pipelined chunks of 2^C elements (LIONBIT_CHUNK_ELEMS): how the defaults
were chosen. Every DistributedLion row also gives the device memory a step
holds beyond the optimizer's state (peak MB).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import lionbit
from lionbit import step_vote

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import trace_summary  # noqa: E402  (tools/: the traces' writer)

TORCH = "torch Lion (foreach, bf16 momentum)"


def lion_foreach(params, grads, momenta, lr, wd, b1, b2):
    """Lion (Chen et al. 2023) in foreach ops: x = x(1 - lr wd) - lr sign(b1 m + (1 - b1) g);
    m = b2 m + (1 - b2) g."""
    torch._foreach_mul_(params, 1.0 - lr * wd)
    update = torch._foreach_mul(momenta, b1)
    torch._foreach_add_(update, grads, alpha=1.0 - b1)
    torch._foreach_sign_(update)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_mul_(momenta, b2)
    torch._foreach_add_(momenta, grads, alpha=1.0 - b2)


def timed(step, device, steps):
    """Median wall-clock ms of step() (the device synchronised around each)."""
    return timed_split(step, device, steps)[0]


def timed_split(step, device, steps):
    """Median wall-clock ms of step() (the device synchronised around each),
    and median ms until step() returned, before the closing synchronisation:
    the host's own time to issue the step (with its waits for the device
    inside it). On a GPU, host ms close to the step's means the step waits
    on the host; on the CPU the two are one."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    times, host = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    return statistics.median(times), statistics.median(host)


def device_allocs(step, device, steps=5):
    """cudaMalloc calls a step makes once warm (the caching allocator's count over ``steps`` more
    steps): a step that allocates device memory every time pays for it in host time; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(device).get("num_device_alloc", 0)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.memory_stats(device).get("num_device_alloc", 0) - before) / steps


def peak_mb(step, device):
    """Device memory one warm step allocates beyond what it started with, at its peak (MB); None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


@contextlib.contextmanager
def chunking(device, vote_log2, chunk_log2):
    """Votes of 2^vote_log2 elements on `device` and backend chunks of 2^chunk_log2 (None: the defaults)."""
    if vote_log2 is None:
        yield
        return
    name = "CHUNK_ELEMENTS_GPU" if device.type == "cuda" else "CHUNK_ELEMENTS"
    saved_vote, saved_env = getattr(step_vote, name), os.environ.get("LIONBIT_CHUNK_ELEMS")
    setattr(step_vote, name, 1 << vote_log2)
    os.environ["LIONBIT_CHUNK_ELEMS"] = str(1 << chunk_log2)
    try:
        yield
    finally:
        setattr(step_vote, name, saved_vote)
        if saved_env is None:
            os.environ.pop("LIONBIT_CHUNK_ELEMS", None)
        else:
            os.environ["LIONBIT_CHUNK_ELEMS"] = saved_env


def parse_chunks(text):
    """--chunks: "V/C,..." as [(V, C)], each a power of two's exponent."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        v, _, c = item.partition("/")
        if not (v.isdigit() and c.isdigit() and 10 <= int(v) <= 34 and 10 <= int(c) <= 34):
            raise argparse.ArgumentTypeError(f"--chunks: {item!r} is not V/C (exponents of 2, 10..34), e.g. 28/26")
        if (int(v), int(c)) not in out:  # (a row a pair: the table is keyed by its label)
            out.append((int(v), int(c)))
    return out


def profile_step(step, device):
    """Prints where one step's host and device time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def stack_shapes(params):
    """4096 x 10240 matrices, as many as make ~params (256 x 1024 ones below one big matrix)."""
    rows, cols = (4096, 10240) if params >= 4096 * 10240 else (256, 1024)
    return [(rows, cols)] * max(1, round(params / (rows * cols)))


def gpt2_medium_shapes(width=1024, layers=24, vocab=50257, context=1024):
    """The parameter shapes of a GPT-2-medium-shaped model, in module order (the head tied to
    the token embedding): 2 + 12 per layer + 2 tensors."""
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,),                      # ln_1
                   (3 * width, width), (3 * width,),        # attention qkv
                   (width, width), (width,),                # attention proj
                   (width,), (width,),                      # ln_2
                   (4 * width, width), (4 * width,),        # MLP up
                   (width, 4 * width), (width,)]            # MLP down
    return shapes + [(width,), (width,)]                    # ln_f


def copy_bandwidth(device, elements=256 << 20):
    """Bytes read + written per second by a device-to-device copy of `elements` bf16."""
    if device.type != "cuda":
        elements = min(elements, 16 << 20)
    src = torch.ones(elements, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, 10)
    return 2 * 2 * elements / (ms / 1e3)


def launches(step, device, trace=None):
    """Device events (kernels, memcpys, memsets) of one step, from torch.profiler; None on CPU.
    With ``trace`` (a path) that step's Chrome trace is written there, gzipped (on CPU too)."""
    cuda = device.type == "cuda"
    if not cuda and trace is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        trace_summary.write_gz(prof, trace)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else None


#: Each method's name in its trace's file name.
DOUBLE = "DistributedLion (bf16 momentum, double_buffer)"
TRACE_NAMES = {TORCH: "torch", "DistributedLion (bf16 momentum)": "distlion_bf16", DOUBLE: "distlion_bf16_db",
               "DistributedLion (fp32 momentum, default)": "distlion_fp32",
               "DistributedLion fused=False (bf16 momentum)": "distlion_unfused"}


def run_list(name, shapes, device, steps, profile, trace_dir=None, chunks=()):
    """The methods' ms per step and launches on one parameter list (with trace_dir, the
    profiled step of each method written there as a gzipped Chrome trace; chunks: the
    --chunks rows)."""
    def trace(label):
        if trace_dir is None or label not in TRACE_NAMES:
            return None
        return os.path.join(trace_dir, f"lion_step_{name}_{TRACE_NAMES[label]}_{device.type}.trace.json.gz")

    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, dtype=dtype, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
    n = sum(p.numel() for p in params)
    lr, wd, betas = 1e-4, 0.1, (0.9, 0.99)
    print(f"gpu_lion_step: {name}: {n / 1e9:.3f}B parameters in {len(shapes)} tensors (bf16) on {device}, "
          f"lionbit kernels {lionbit.kernels(device)}", flush=True)
    ms, host, launched, peak = {}, {}, {}, {}
    momenta = [torch.zeros_like(p) for p in params]
    torch_step = lambda: lion_foreach(params, grads, momenta, lr, wd, *betas)  # noqa: E731
    ms[TORCH], host[TORCH] = timed_split(torch_step, device, steps)
    launched[TORCH] = launches(torch_step, device, trace(TORCH))
    allocs = {TORCH: device_allocs(torch_step, device)}
    peak[TORCH] = peak_mb(torch_step, device)
    momenta.clear()
    bf16 = {"momentum_dtype": torch.bfloat16}
    methods = [("DistributedLion (bf16 momentum)", bf16, (None, None)),
               (DOUBLE, {**bf16, "double_buffer": True}, (None, None)),
               ("DistributedLion (fp32 momentum, default)", {}, (None, None)),
               ("DistributedLion fused=False (bf16 momentum)", {**bf16, "fused": False}, (None, None))]
    methods += [(f"DistributedLion (bf16) votes 2^{v} chunks 2^{c}", bf16, (v, c)) for v, c in chunks]
    for label, kwargs, sizes in methods:
        leaves = [torch.nn.Parameter(p) for p in params]
        for leaf, g in zip(leaves, grads):
            leaf.grad = g
        opt = lionbit.DistributedLion(leaves, lr=lr, betas=betas, weight_decay=wd, **kwargs)
        with chunking(device, *sizes):
            ms[label], host[label] = timed_split(opt.step, device, steps)
            launched[label] = launches(opt.step, device, trace(label))
            allocs[label] = device_allocs(opt.step, device)
            peak[label] = peak_mb(opt.step, device)
        if profile and label == "DistributedLion (bf16 momentum)":
            profile_step(opt.step, device)
        del opt, leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return n, len(shapes), ms, host, launched, allocs, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lists", default="stack,gpt2-medium", help="parameter lists, comma-separated "
                    "(stack, gpt2-medium; default both)")
    ap.add_argument("--params", type=float, default=1e9, help="the stack's parameters in all (default 1e9)")
    ap.add_argument("--gpt2-width", type=int, default=1024, help="gpt2-medium's width (smaller for a CPU run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top operators of one DistributedLion step")
    ap.add_argument("--trace-dir", help="write each method's profiled step here as a gzipped Chrome trace")
    ap.add_argument("--chunks", type=parse_chunks, default=[],
                    help="extra rows: V/C,... votes of 2^V elements, backend chunks of 2^C (e.g. 28/26,29/29)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_lion_step: no CUDA device; nothing to measure")
        return 0
    makers = {"stack": lambda: stack_shapes(args.params),
              "gpt2-medium": lambda: gpt2_medium_shapes(args.gpt2_width, vocab=50257 * args.gpt2_width // 1024)}
    names = [n.strip() for n in args.lists.split(",") if n.strip()]
    unknown = [n for n in names if n not in makers]
    if unknown or not names:
        ap.error(f"--lists: unknown list(s) {unknown}; choose from {sorted(makers)}")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("lionbit", store=dist.HashStore(), rank=0, world_size=1)
    lists = {}
    try:
        bandwidth = copy_bandwidth(device)
        print(f"gpu_lion_step: device-to-device copy {bandwidth / 1e9:.0f} GB/s (read + written)")
        for name in names:
            n, tensors, ms, host, launched, allocs, peak = run_list(name, makers[name](), device, args.steps,
                                                                    args.profile, args.trace_dir, args.chunks)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the list's tensors are gone with run_list's frame
            floor = 10 * n / bandwidth * 1e3
            base = ms[TORCH]
            print(f"{name}: floor {floor:.2f} ms (10 B/parameter at {bandwidth / 1e9:.0f} GB/s)")
            print(f"{'method':46s} {'ms/step':>9s} {'host ms':>8s} {'x torch':>8s} {'x floor':>8s} {'launches':>9s} "
                  f"{'allocs':>7s} {'peak MB':>8s}")
            for label, t in ms.items():
                a = "-" if allocs[label] is None else f"{allocs[label]:.1f}"
                pk = "-" if peak[label] is None else f"{peak[label]:.0f}"
                print(f"{label:46s} {t:9.2f} {host[label]:8.2f} {t / base:7.2f}x {t / floor:7.2f}x "
                      f"{launched[label] or '-':>9} {a:>7} {pk:>8}")
            lists[name] = {"params": n, "tensors": tensors, "ms_per_step": ms, "host_ms_per_step": host,
                           "floor_ms": floor,
                           "ratio_to_torch": {k: v / base for k, v in ms.items()},
                           "ratio_to_floor": {k: v / floor for k, v in ms.items()},
                           "launches_per_step": launched, "device_allocs_per_step": allocs,
                           "peak_MB_per_step": peak}
    finally:
        dist.destroy_process_group()

    if args.json:
        first = lists[names[0]]  # the first list's figures also at the top (older readers)
        with open(args.json, "w") as f:
            json.dump({**first, "device": str(device), "dtype": "bfloat16", "steps": args.steps,
                       "copy_GBps": bandwidth / 1e9, "lists": lists,
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
