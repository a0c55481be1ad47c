"""A training step with DistributedLion attached against the same step with no communication.

One process, world size 1 on the "lionbit" backend (on CUDA: NCCL
underneath), a GPT-2-small-shaped causal LM (12 layers, width 768, 12 heads,
vocabulary 50257, ~124M parameters, head tied to the embedding) trained in
bf16 autocast on random tokens. Three steps, each forward + backward +
optimizer step:

  floor        the bare model and Lion in torch's foreach ops: no
               communication, no hook (what the same step costs on one GPU
               without lionbit)
  ddp_plain    DistributedDataParallel (its own all-reduce) + the foreach Lion:
               DDP's own share of the step, without lionbit
  ddp          DistributedDataParallel + DistributedLion attached (its comm hook
               votes each bucket's signs during backward)
  ddp_at_step  the same attached with overlap=False: the votes at step(), in
               a few large calls instead of one a bucket
  fsdp2_plain  fully_shard per block and at the root (its own reduce-scatter) +
               the foreach Lion on the local shards: FSDP2's own share
  fsdp2        the same fully_shard + DistributedLion attached

Prints each step's median ms over --steps timed steps (after 3 warm-ups),
the host's ms until the step's last call returned (before the closing
synchronisation: near the step's ms, the step waits on the host) and
within the optimizer's step alone ("opt ms": on the CPU the whole of
lionbit's step, with the vote; on a GPU the host's share), its
ratio to the floor (goal: <= 1.05x), for the lionbit steps the ratio to
the same wrapper without lionbit (what lionbit itself adds) and, on a GPU,
from one profiled step: its device events (kernels, copies, memsets), the
ms the device was busy (their union: a step much longer than that waits on
the host), the host syncs of the calling thread (torch's sync debug mode,
with the Python lines that made them) and cudaMalloc calls a step.
--profile also prints the top operators of one DDP and one FSDP2 step by
device and by host time; --trace-dir writes each kind's profiled step as
a gzipped Chrome trace.

    python bench/gpu_train_step.py [--device cuda] [--batch 8] [--seq 1024] [--json FILE] [--trace-dir DIR]
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lionbit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import trace_summary  # noqa: E402  (tools/: a trace's busy time, the same union as there)
from gpt2_init import gpt2_init  # noqa: E402
from gpu_lion_step import device_allocs, lion_foreach, timed_split  # noqa: E402  (bench/ on the path first)


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        gpt2_init(self, layers)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


#: The steps measured, in order: the floor first (every ratio's denominator).
KINDS = ("floor", "ddp_plain", "ddp", "ddp_at_step", "fsdp2_plain", "fsdp2")


@torch.no_grad()
def lion_step(params, momenta):
    """gpu_lion_step's Lion in torch's foreach ops on the parameters' gradients."""
    lion_foreach(params, [p.grad for p in params], momenta, 1e-4, 0.1, 0.9, 0.99)


def build(kind, shape, device):
    """(model, step function) for one kind of step."""
    torch.manual_seed(0)
    model = GPT(**shape).to(device)
    params = list(model.parameters())
    if kind == "floor":
        momenta = [torch.zeros_like(p) for p in params]
        return model, lambda: lion_step(params, momenta)
    if kind.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        model = fully_shard(model, mesh=mesh)
    if kind.endswith("_plain"):
        # The foreach Lion on what each rank holds: DDP's parameters, FSDP2's local shards.
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        momenta = [torch.zeros_like(x) for x in local]

        @torch.no_grad()
        def plain_step():
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
            lion_foreach(local, grads, momenta, 1e-4, 0.1, 0.9, 0.99)

        return model, plain_step
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-4, weight_decay=0.1)
    opt.attach(model, overlap=kind != "ddp_at_step")
    return model, opt.step


def union_ms(ranges) -> float:
    """The ms covered by the union of (start, end) ranges in microseconds:
    how long the device was busy, however its events overlap."""
    return sum(b - a for a, b in trace_summary.merged(ranges)) / 1e3


def host_syncs(step):
    """The calling thread's host syncs in one step (torch.cuda's sync debug
    mode warns at each), by the Python line that made them: (count, {"file:line": n}).
    Syncs on other threads (lionbit's worker, autograd's device thread) are
    not seen here; the trace shows them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    sites = collections.Counter(f"{_where(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return sum(sites.values()), dict(sites.most_common())


def _where(filename: str) -> str:
    """A source file as a sync site names it: from site-packages or the tree on, else its name."""
    for mark in ("site-packages" + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep):
        if mark in filename:
            return filename.split(mark, 1)[1]
    return os.path.basename(filename)


def profiled(kind, step, device, trace_dir, tables):
    """One profiled step: (device events, device busy ms), None on the CPU;
    its Chrome trace gzipped into trace_dir; with ``tables`` the top
    operators by device and by host time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = busy = None
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        events = len(kernels)
        busy = union_ms((e.time_range.start, e.time_range.end) for e in kernels)
    if trace_dir:
        trace_summary.write_gz(prof, os.path.join(trace_dir, f"train_step_{kind}_{device.type}.trace.json.gz"))
    table = ""
    if tables:
        averages = prof.key_averages()
        for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            table += f"{kind}: top operators by {key}\n"
            table += averages.table(sort_by=key, row_limit=15, max_name_column_width=50) + "\n"
    return events, busy, table


def measure(kind, shape, device, batch, seq, steps, profile, trace_dir=None):
    model, optimizer_step = build(kind, shape, device)
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (batch, seq + 1), device=device, generator=gen)
    dtype = torch.bfloat16

    opt_host = []  # the host's ms in each optimizer step (on a GPU: with its waits for the device)

    def step():
        for p in model.parameters():
            p.grad = None
        with torch.autocast(device.type, dtype=dtype):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, shape["vocab"]), tokens[:, 1:].reshape(-1))
        loss.backward()
        t = time.perf_counter()
        optimizer_step()
        opt_host.append((time.perf_counter() - t) * 1e3)

    ms, host = timed_split(step, device, steps)
    fig = {"ms_per_step": ms, "host_ms_per_step": host, "opt_host_ms_per_step": statistics.median(opt_host[-steps:]),
           "device_events_per_step": None}
    table = ""
    # The diagnostics below run once a kind; one that fails (a GPU run is rare) is reported in
    # the figures and printed, and the timings above stand.
    try:
        if device.type == "cuda" or trace_dir:
            events, busy, table = profiled(kind, step, device, trace_dir, profile)
            fig.update(device_events_per_step=events, device_busy_ms_per_step=busy)
        if device.type == "cuda":
            fig["host_syncs_per_step"], fig["host_sync_sites"] = host_syncs(step)
            fig["device_allocs_per_step"] = device_allocs(step, device)
    except Exception as err:  # any failure of a diagnostic, named in the figures
        fig["diagnostics_error"] = f"{type(err).__name__}: {err}"
        print(f"gpu_train_step: {kind}: a diagnostic failed: {fig['diagnostics_error']}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    return fig, params, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--width", type=int, default=768, help="model width (smaller for a CPU run)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--profile", action="store_true",
                    help="print the top operators of one DDP and one FSDP2 step (device and host time)")
    ap.add_argument("--trace-dir", help="write each kind's profiled step here as a gzipped Chrome trace")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_train_step: no CUDA device; nothing to measure")
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if "floor" not in kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds: {args.kinds!r}: floor plus any of {', '.join(KINDS[1:])}")
    if args.seq > 1024 or args.width % 12:
        ap.error(f"--seq must be <= 1024 (got {args.seq}) and --width a multiple of 12 (got {args.width})")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = dict(vocab=args.vocab, context=1024, width=args.width, layers=args.layers, heads=12)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("lionbit", store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    try:
        for kind in kinds:
            fig, params, table = measure(kind, shape, device, args.batch, args.seq, args.steps,
                                         args.profile and kind in ("ddp", "fsdp2"), args.trace_dir)
            results[kind] = fig
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the model is gone with measure's frame
            events = fig["device_events_per_step"]
            print(f"gpu_train_step: {kind}: {fig['ms_per_step']:.2f} ms/step, {events if events is not None else '-'} "
                  f"device events ({params / 1e6:.1f}M parameters)", flush=True)
            if fig.get("host_sync_sites"):
                print(f"gpu_train_step: {kind}: host syncs of the calling thread: {fig['host_sync_sites']}")
            if table:
                print(table)
    finally:
        dist.destroy_process_group()
    floor = results["floor"]["ms_per_step"]
    for kind, fig in results.items():
        fig["ratio_to_floor"] = fig["ms_per_step"] / floor
        plain = None if kind.endswith("_plain") else results.get(kind.split("_")[0] + "_plain")
        if plain is not None:
            fig["ratio_to_plain"] = fig["ms_per_step"] / plain["ms_per_step"]
    print(f"{'step':12s} {'ms/step':>9s} {'host ms':>8s} {'opt ms':>7s} {'x floor':>8s} {'x plain':>8s} {'events':>7s} "
          f"{'busy ms':>8s} {'syncs':>6s} {'allocs':>7s}")

    def cell(value, width, fmt):
        return f"{'-' if value is None else format(value, fmt):>{width}s}"

    for kind, fig in results.items():
        vs_plain = f"{fig['ratio_to_plain']:7.2f}x" if "ratio_to_plain" in fig else f"{'-':>8s}"
        print(f"{kind:12s} {fig['ms_per_step']:9.2f} {fig['host_ms_per_step']:8.2f} {fig['opt_host_ms_per_step']:7.2f} "
              f"{fig['ratio_to_floor']:7.2f}x "
              f"{vs_plain} {cell(fig['device_events_per_step'], 7, 'd')} "
              f"{cell(fig.get('device_busy_ms_per_step'), 8, '.2f')} {cell(fig.get('host_syncs_per_step'), 6, 'd')} "
              f"{cell(fig.get('device_allocs_per_step'), 7, '.1f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "params": params, "batch": args.batch, "seq": args.seq,
                       "steps": args.steps, "results": results,
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
