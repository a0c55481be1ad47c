"""Suite 1: lionbit's sign all-reduce against the alternatives on emulated links.

    python bench/collectives.py --quick                 # make bench: N 2,4; d 1M,16M; 1 and 10 Gbit/s
    python bench/collectives.py                          # full: N 2,4,8; d 1M,16M,64M
    python bench/collectives.py --ranks 4 --numel 16M --links 1gbit --repeats 5
    python bench/collectives.py --loopback               # no namespaces (also the fallback without root)

Needs root for the emulated cluster (bench/netns.py: one network namespace per
rank, veth into a bridge, tbf at the link rate on both ends, offloads off);
without it, it says so and runs on loopback, where there is no link rate.

Implementations, all computing a per-element result from every rank's
tensor of d float32 values:

    lionbit_vote     lionbit.all_reduce_sign(t, "vote")   sign of the sum of signs (1-bit two-phase)
    lionbit_vote_tiefree  the same on input whose signs agree on every rank (zero-free, no
                     ties: the condition of the 1.05x bytes goal; at even N real data has ties,
                     whose positions lionbit sends as an extra bit-plane)
    lionbit_vote_alternate  all_reduce_sign(t, "vote", tie_break="alternate"): ties answered +1 / -1
                     by the call's number, so phase 2 is 1 bit an element (Lion Cub's rule)
    lionbit_vote_random     the same with tie_break="random" (a pseudo-random sign per element)
    lionbit_avg      lionbit.all_reduce_sign(t, "avg")    sum of signs / N (bit-planes of counts)
    gloo_fp32        dist.all_reduce(float32)             what DDP does
    gloo_bf16        dist.all_reduce(bfloat16)            the bf16 compression hook's collective
    allgather_bits   all_gather of signs packed 8 per byte, unpack, count, sign (the public
                     Distributed Lion code's approach); pack/count in torch
    int8_counts      dist.all_reduce(int8 signs), sign    (what the Distributed Lion authors used)

Per case: median seconds of the repeats (the slowest rank's median; each
repeat starts after a barrier, the input copied in before the barrier),
payload bytes per rank (lionbit.stats() for lionbit; the algorithm's formula
for Gloo: ring all-reduce 2(N-1)/N * bytes, all-gather (N-1) * bytes), bytes
per rank on the wire (the rank's veth tx_bytes over all repeats, minus the
same number of bare barriers, divided by the repeats), and bus bandwidth.
Also, for the baselines that do work in torch around the collective, the
median of the collective alone (comm_s).

Output: JSON (the stable schema: suite, impl, world_size, numel, link,
median_s, bytes_per_rank, plus extras), a Markdown table, PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import rank_fork  # noqa: E402  (bench/ on the path first)

IMPLS = ["lionbit_vote", "lionbit_vote_tiefree", "lionbit_vote_alternate", "lionbit_vote_random", "lionbit_avg",
         "gloo_fp32", "gloo_bf16", "allgather_bits", "int8_counts"]


def parse_numel(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def numel_label(d: int) -> str:
    return f"{d >> 20}M" if d % (1 << 20) == 0 else (f"{d >> 10}K" if d % 1024 == 0 else str(d))


def tx_bytes(ifname: str) -> int:
    """This namespace's tx_bytes counter of ifname (LIONBIT_BENCH_IF), or -1 when none is set."""
    if not ifname:
        return -1
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def busy_seconds():
    """(busy, steal, interrupts): CPU seconds all cores have run something (user, nice,
    system, irq, softirq in /proc/stat), seconds the hypervisor gave them to someone else
    (steal), and the part of busy spent in irq and softirq (the emulated links' veth and
    tbf work, which the kernel charges to no process)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, v[7] / hz, (v[5] + v[6]) / hz


def load_columns(busy_s: float, steal_s: float, ranks_cpu_s: float, wall_s: float) -> dict:
    """Cores busy over a timed window (the whole machine, /proc/stat), the share not
    charged to the rank processes ("not ranks": other users' jobs, plus the emulated
    links' softirq work, which the kernel charges to no process) and steal."""
    return {"cpu_busy_cores": busy_s / wall_s, "cpu_other_cores": (busy_s - ranks_cpu_s) / wall_s,
            "cpu_steal_cores": steal_s / wall_s}


# A sign all-reduce's timeline from its LIONBIT_TRACE line (ms): packing the
# whole tensor; the header round (with the wait for the slowest rank); the
# chunks' pipeline, from the header until the last chunk's phase 2 (and tie
# round) arrived, the unpack of all but the last chunk overlapped with it;
# the tail after it (the last chunk's unpack); the whole call.
TIMELINE = ("pack", "header", "pipeline", "tail", "total")


def timeline_medians(calls: list) -> dict:
    rows = []
    for c in calls:
        at = {}
        for name, _, t in c["events"]:
            at[name] = max(at.get(name, 0.0), t)  # per name, its last chunk
        last = max(at.get("ag_done", at["header"]), at.get("ties_done", 0.0))
        rows.append({"pack": at["packed"], "header": at["header"] - at["packed"],
                     "pipeline": last - at["header"], "tail": at["end"] - last, "total": at["end"]})
    if not rows:
        return {k: float("nan") for k in TIMELINE}
    return {k: statistics.median(r[k] for r in rows) for k in TIMELINE}


def gather_rows(mine):
    """all_gather of each rank's 1-D float64 tensor: an (N, k) tensor, row r from rank r."""
    import torch
    import torch.distributed as dist
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every)


# ---------------------------------------------------------------------------
# worker: one rank (run inside its namespace, or as a plain process on loopback)
# ---------------------------------------------------------------------------

def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import lionbit

    torch.set_num_threads(1)          # N ranks share few cores; no oversubscription
    # lionbit's per-call timelines (LIONBIT_TRACE), read back after each case.
    trace_dir = tempfile.mkdtemp(prefix="lionbit-bench-trace-")
    os.environ["LIONBIT_TRACE"] = os.path.join(trace_dir, "t")
    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    trace_file = os.path.join(trace_dir, f"t.rank{os.environ.get('RANK', rank)}.jsonl")

    def trace_calls() -> list:
        try:
            with open(trace_file) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []
    ifname = os.environ.get("LIONBIT_BENCH_IF", "")
    wire_bytes = lambda: tx_bytes(ifname)

    shifts = torch.arange(8, dtype=torch.uint8)
    weights = (torch.ones(8, dtype=torch.uint8) << shifts)
    CH = 1 << 22  # elements per chunk in the torch pack/count (bounded temporaries)

    def pack_bits(x: torch.Tensor, out: torch.Tensor) -> None:
        for s in range(0, x.numel(), CH):
            b = (x[s:s + CH] > 0).view(-1, 8).to(torch.uint8)
            out[s // 8:(s + CH) // 8] = (b * weights).sum(1, dtype=torch.uint8)

    def count_bits_vote(gathered: torch.Tensor, out: torch.Tensor) -> None:
        # gathered: (N, d/8) uint8; out[i] = sign(2 * #ones - N)
        for s in range(0, out.numel(), CH):
            g = gathered[:, s // 8:(s + CH) // 8]
            ones = ((g.unsqueeze(-1) >> shifts) & 1).to(torch.int16).sum(0).view(-1)
            out[s:s + CH] = torch.sign(2 * ones - n).to(out.dtype)

    results = []
    # The machine's load over this (link, N) run, every case together (/proc/stat
    # counts in ticks: one case's few calls are too short to measure).
    c0, u0, t_0 = time.process_time(), busy_seconds(), time.perf_counter()
    for d in args.numels:
        assert d % 8 == 0
        g = torch.Generator().manual_seed(1000 + rank)
        shared = torch.randn(d, generator=torch.Generator().manual_seed(12345))
        # Training-like signs: a shared signal plus each rank's own noise
        # (momentum directions mostly agree across data-parallel ranks).
        x = shared.add_(torch.randn(d, generator=g), alpha=0.5)
        del shared
        buf = torch.empty_like(x)
        bf = torch.empty(d, dtype=torch.bfloat16)
        i8 = torch.empty(d, dtype=torch.int8)
        packed = torch.empty(d // 8, dtype=torch.uint8)
        gathered = None
        same = None

        for impl in args.impls:
            comm_times = []

            if impl in ("lionbit_vote", "lionbit_avg"):
                op = impl.split("_")[1]
                prep = lambda: buf.copy_(x)
                run = lambda: lionbit.all_reduce_sign(buf, op)
            elif impl in ("lionbit_vote_alternate", "lionbit_vote_random"):
                rule = impl.rsplit("_", 1)[1]
                prep = lambda: buf.copy_(x)
                run = lambda: lionbit.all_reduce_sign(buf, "vote", tie_break=rule)
            elif impl == "lionbit_vote_tiefree":
                same = torch.randn(d, generator=torch.Generator().manual_seed(777))
                prep = lambda: buf.copy_(same)
                run = lambda: lionbit.all_reduce_sign(buf, "vote")
            elif impl == "gloo_fp32":
                prep = lambda: buf.copy_(x)
                run = lambda: dist.all_reduce(buf)
            elif impl == "gloo_bf16":
                prep = lambda: bf.copy_(x)
                run = lambda: dist.all_reduce(bf)
            elif impl == "int8_counts":
                prep = lambda: None

                def run():
                    torch.sign(x, out=buf)
                    i8.copy_(buf)
                    t0 = time.perf_counter()
                    dist.all_reduce(i8)
                    comm_times.append(time.perf_counter() - t0)
                    torch.sign(i8, out=i8)
                    buf.copy_(i8)
            elif impl == "allgather_bits":
                if gathered is None:
                    gathered = torch.empty(n * (d // 8), dtype=torch.uint8)
                prep = lambda: None

                def run():
                    pack_bits(x, packed)
                    t0 = time.perf_counter()
                    dist.all_gather_into_tensor(gathered, packed)
                    comm_times.append(time.perf_counter() - t0)
                    count_bits_vote(gathered.view(n, d // 8), buf)
            else:
                raise ValueError(impl)

            # warm-up (connections, allocations)
            prep()
            run()
            traced_before = len(trace_calls())
            comm_times.clear()
            lionbit.reset_stats()
            times = []
            dist.barrier()
            w0 = wire_bytes()
            for _ in range(args.repeats):
                prep()
                dist.barrier()
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            dist.barrier()
            w1 = wire_bytes()
            # The same number of bare barriers: their bytes are subtracted.
            for _ in range(args.repeats + 1):
                dist.barrier()
            w2 = wire_bytes()
            st = lionbit.stats()

            mine = torch.tensor([statistics.median(times),
                                 statistics.median(comm_times) if comm_times else 0.0,
                                 (w1 - w0) - (w2 - w1) if w0 >= 0 else -1.0,
                                 float(st["bytes_sent"])], dtype=torch.float64)
            every = gather_rows(mine)

            if impl.startswith("lionbit"):
                payload = every[:, 3].max().item() / args.repeats
            elif impl == "gloo_fp32":
                payload = 2 * (n - 1) / n * 4 * d
            elif impl == "gloo_bf16":
                payload = 2 * (n - 1) / n * 2 * d
            elif impl == "int8_counts":
                payload = 2 * (n - 1) / n * d
            else:  # allgather_bits
                payload = (n - 1) * d / 8
            wire = every[:, 2].max().item() / args.repeats if every[0, 2] >= 0 else None
            if wire is not None and ifname == "lo":
                wire /= n   # loopback: one counter carries every rank's traffic
            med = every[:, 0].max().item()
            one_bit = 2 * (n - 1) / n * d / 8
            rec = {
                "suite": "collectives", "impl": impl, "world_size": n, "numel": d, "link": args.link,
                "median_s": med, "bytes_per_rank": payload,
                "wire_bytes_per_rank": wire,
                "payload_over_1bit": payload / one_bit,
                "wire_over_1bit": (wire / one_bit) if wire is not None else None,
                "busbw_fp32_equiv_gbps": 2 * (n - 1) / n * 4 * d * 8 / med / 1e9,
                "wire_gbps": (wire * 8 / med / 1e9) if wire is not None else None,
                "comm_s": every[:, 1].max().item() if comm_times else None,
                "repeats": args.repeats,
                "per_rank_median_s": every[:, 0].tolist(),
            }
            if impl.startswith("lionbit"):
                c = max(st["sign_allreduce_calls"], 1)
                rec["lionbit_split_s"] = {k: st[f"{k}_seconds"] / c for k in ("pack", "comm", "vote", "unpack")}
                # The slowest rank's timeline (medians over the timed calls).
                phases = timeline_medians(trace_calls()[traced_before:])
                rows = gather_rows(torch.tensor([phases[k] for k in TIMELINE], dtype=torch.float64))
                slow = int(rows[:, -1].argmax())
                rec["lionbit_timeline_ms"] = dict(zip(TIMELINE, rows[slow].tolist()))
            results.append(rec)
            same = None
            if rank == 0:
                print(f"  {args.link:>9} N={n} d={numel_label(d):>4} {impl:<15} {med * 1e3:9.1f} ms  "
                      f"payload {payload / 1e6:9.3f} MB  "
                      f"wire {wire / 1e6 if wire is not None else float('nan'):9.3f} MB",
                      flush=True)
        # Rebound, not deleted: the prep/run closures above refer to these names.
        x = buf = bf = i8 = packed = gathered = None

    dist.barrier()
    c1, u1, t_1 = time.process_time(), busy_seconds(), time.perf_counter()
    every = gather_rows(torch.tensor([c1 - c0, u1[0] - u0[0], t_1 - t_0, u1[1] - u0[1]], dtype=torch.float64))
    load = load_columns(every[0, 1].item(), every[0, 3].item(), every[:, 0].sum().item(), every[0, 2].item())
    for rec in results:
        rec.update(load)
    if rank == 0:
        print(f"  {args.link:>9} N={n}: cores busy {load['cpu_busy_cores']:.2f} over the run (not ranks "
              f"{load['cpu_other_cores']:.2f}: other jobs and the link's softirq; steal "
              f"{load['cpu_steal_cores']:.2f})", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(trace_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------

def run_ranks(cluster, n: int, link: str, numels, impls, repeats, out: str, timeout: float) -> list:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--link", link,
            "--numel", ",".join(map(str, numels)), "--impls", ",".join(impls),
            "--repeats", str(repeats), "--out", out]
    return launch(cluster, n, argv, out, timeout)


def launch(cluster, n: int, argv: list, out: str, timeout: float) -> list:
    """Runs argv as N ranks (in the cluster's namespaces, or on loopback when
    cluster is None), waits up to timeout seconds, and returns the JSON list
    rank 0 wrote to out."""
    procs = []
    try:
        if cluster is not None:
            for r in range(n):
                env_extra = {"LIONBIT_BENCH_IF": cluster.ifname}
                os.environ.update(env_extra)
                procs.append(cluster.popen(r, argv))
        else:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            for r in range(n):
                env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(n),
                           LIONBIT_BENCH_IF="lo" if r == 0 else "")
                procs.append(rank_fork.start(argv, env))  # forked where it can be: torch is imported already
        deadline = time.time() + timeout
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"worker(s) failed: exit codes {[p.returncode for p in procs]}")
    finally:
        for p in procs:
            if p.poll() is None:
                rank_fork.kill(p)
    with open(out) as f:
        return json.load(f)


def check_link(c, link: str, suite: str) -> dict:
    """iperf3 rank 1 -> rank 0 on a fresh cluster; prints the set-up and the rate, returns the record."""
    ip = c.iperf3(seconds=1.0)
    rate = (f"{ip['received_bps'] / 1e9:.3f} Gbit/s, {ip['retransmits']} retransmits"
            if ip and "received_bps" in ip else f"n/a ({ip})")
    print(f"{suite}: {c.describe()}\n{suite}: iperf3 check rank1->rank0: {rate}", flush=True)
    return {"link": link, "world_size": c.n, "iperf3": ip, "setup": c.describe()}


def machine() -> dict:
    import torch

    import lionbit
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "lionbit": lionbit.__version__, "cpu_isa": lionbit._C.cpu_isa(),
            "loadavg_at_start": os.getloadavg()}


def choose_mode(suite: str, loopback: bool) -> bool:
    """True: the emulated cluster; False: loopback (asked, or no namespaces here: says why)."""
    import netns
    use_ns, why = (False, "--loopback asked") if loopback else netns.can_make_namespaces()
    if not use_ns:
        print(f"{suite}: LOOPBACK MODE ({why}): no link emulation, no rate limit; "
              f"wire bytes are loopback's counter (all ranks) / N")
    return use_ns


def new_meta(use_ns: bool) -> dict:
    return {"machine": machine(), "command": " ".join(["python"] + sys.argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "netns" if use_ns else "loopback"}


def run_cases(suite: str, use_ns: bool, links, ranks, json_path: str, meta: dict, run_one, per_node: int = 1) -> list:
    """For each link and N: run_one(cluster, n, link, tmp) -> results, on a fresh
    cluster after its iperf3 check (cluster None and link "loopback" without
    namespaces). The JSON {meta, iperf3, results} is rewritten after each, and
    at the end with meta["finished"]. Returns the results."""
    import netns
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    tmp = os.path.abspath(json_path) + ".part"
    results, checks = [], []
    t0 = time.time()

    def write():
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "iperf3": checks, "results": results}, f, indent=1)

    for link in (links if use_ns else ["loopback"]):
        for n in ranks:
            if use_ns:
                with netns.Cluster(n, netns.parse_rate(link), per_node=per_node) as c:
                    checks.append(check_link(c, link, suite))
                    results += run_one(c, n, link, tmp)
            else:
                results += run_one(None, n, "loopback", tmp)
            print(f"{suite}: {link} N={n} done, {time.time() - t0:.0f} s so far", flush=True)
            write()                           # keep what is done so far
    if os.path.exists(tmp):
        os.remove(tmp)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["elapsed_s"] = time.time() - t0
    write()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="N 2,4; d 1M,16M; 3 repeats")
    p.add_argument("--ranks", default=None, help="comma list of N (default 2,4,8; quick 2,4)")
    p.add_argument("--numel", default=None, help="comma list of d, e.g. 1M,16M,64M")
    p.add_argument("--links", default="1gbit,10gbit")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--loopback", action="store_true", help="no namespaces: plain processes on 127.0.0.1")
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--json", default="bench/results/collectives.json", help="results file")
    p.add_argument("--timeout", type=float, default=900, help="seconds per (link, N) run")
    a = p.parse_args()

    if a.worker:
        a.numels = [int(v) for v in a.numel.split(",")]
        a.impls = a.impls.split(",")
        worker(a)
        return

    ranks = [int(v) for v in (a.ranks or ("2,4" if a.quick else "2,4,8")).split(",")]
    numels = [parse_numel(v) for v in (a.numel or ("1M,16M" if a.quick else "1M,16M,64M")).split(",")]
    repeats = a.repeats or (3 if a.quick else 5)
    impls = a.impls.split(",")
    links = a.links.split(",")

    use_ns = choose_mode("collectives", a.loopback)
    if not use_ns:
        links = ["loopback"]
    meta = new_meta(use_ns)
    print(f"collectives: {meta['machine']['cores']} cores ({meta['machine']['cpu']}), "
          f"torch {meta['machine']['torch']}, lionbit {meta['machine']['lionbit']}; N {ranks}, "
          f"d {[numel_label(d) for d in numels]}, links {links}, median of {repeats}", flush=True)
    run_cases("collectives", use_ns, links, ranks, a.json, meta,
              lambda c, n, link, tmp: run_ranks(c, n, link, numels, impls, repeats, tmp, a.timeout))
    import report
    report.collectives(a.json)


if __name__ == "__main__":
    main()
