"""lionbit demo: a 1-bit sign all-reduce against an fp32 all-reduce.

    torchrun --standalone --nproc-per-node 4 examples/sign_allreduce_demo.py

Every rank holds the same-size float32 tensor (16M elements by default).
Rank 0 prints, for lionbit's majority vote and for Gloo's fp32 all-reduce:
the median time of several runs, the bytes each rank sends (lionbit's own
counter; the ring all-reduce formula for Gloo), and the bytes measured on the
loopback interface's counters (all ranks' traffic, TCP/IP headers included,
divided by the number of ranks).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import lionbit


def lo_bytes() -> int:
    """Bytes sent on the loopback interface so far (Linux), or -1."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])  # transmit bytes
    except OSError:
        pass
    return -1


def timed(fn, repeats):
    times, wire = [], []
    for _ in range(repeats):
        dist.barrier()
        before = lo_bytes()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        dist.barrier()
        after = lo_bytes()
        times.append(elapsed)
        wire.append(after - before)
    # Slowest rank's time: the collective is done when every rank is.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), statistics.median(wire)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group("lionbit")
    rank, n = dist.get_rank(), dist.get_world_size()
    d = args.numel
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(d, generator=g)
    signs = torch.sign(x)
    # Training-like input: every rank sees a shared signal plus its own noise,
    # so ranks mostly agree (as momentum signs do across data-parallel ranks).
    shared = torch.randn(d, generator=torch.Generator().manual_seed(12345))
    correlated = shared + 0.5 * torch.randn(d, generator=g)

    # Correctness first: the vote equals sign(sum of signs) from an fp32 all-reduce.
    ref = signs.clone()
    dist.all_reduce(ref)
    ref = torch.sign(ref)
    vote = x.clone()
    lionbit.all_reduce_sign(vote, "vote")
    assert torch.equal(vote, ref), "vote differs from the fp32 reference"

    buf = x.clone()

    def sign_vote():
        buf.copy_(x)
        lionbit.all_reduce_sign(buf, "vote")

    def sign_vote_correlated():
        buf.copy_(correlated)
        lionbit.all_reduce_sign(buf, "vote")

    def fp32_allreduce():
        buf.copy_(x)
        dist.all_reduce(buf)

    sign_vote()  # warm up both paths
    fp32_allreduce()
    lionbit.reset_stats()
    t_vote, lo_vote = timed(sign_vote, args.repeats)
    payload_vote = lionbit.stats()["bytes_sent"] / args.repeats
    lionbit.reset_stats()
    t_corr, lo_corr = timed(sign_vote_correlated, args.repeats)
    payload_corr = lionbit.stats()["bytes_sent"] / args.repeats
    t_fp32, lo_fp32 = timed(fp32_allreduce, args.repeats)
    payload_fp32 = 2 * (n - 1) / n * 4 * d  # ring all-reduce of float32
    one_bit = 2 * (n - 1) / n * d / 8

    if rank == 0:
        print(f"\nlionbit {lionbit.__version__} demo: {n} ranks on loopback, d = {d:,} float32 elements, "
              f"median of {args.repeats} runs (torch {torch.__version__}, cpu isa {lionbit._C.cpu_isa()})")
        print("check: the vote equals sign(sum of torch.sign) from an fp32 all-reduce on every element\n")
        hdr = f"{'':34}{'time':>10}{'bytes/rank sent':>20}{'bytes/rank on lo':>20}"
        print(hdr)
        print("-" * len(hdr))
        lo = (lambda b: f"{b / n:>20,.0f}") if lo_vote >= 0 else (lambda b: f"{'n/a':>20}")
        print(f"{'Gloo fp32 all-reduce':34}{t_fp32 * 1e3:>8.1f}ms{payload_fp32:>20,.0f}{lo(lo_fp32)}")
        print(f"{'lionbit vote, independent ranks':34}{t_vote * 1e3:>8.1f}ms{payload_vote:>20,.0f}{lo(lo_vote)}")
        print(f"{'lionbit vote, correlated ranks':34}{t_corr * 1e3:>8.1f}ms{payload_corr:>20,.0f}{lo(lo_corr)}")
        print("-" * len(hdr))
        ratio_lo = f"{lo_fp32 / lo_vote:>19.1f}x" if lo_vote > 0 else f"{'n/a':>20}"
        print(f"{'fp32 / lionbit':34}{t_fp32 / t_vote:>9.1f}x{payload_fp32 / payload_vote:>19.1f}x{ratio_lo}")
        print(f"\n1-bit figure 2(N-1)/N * d/8 = {one_bit:,.0f} bytes; lionbit sent {payload_corr / one_bit:.4f}x "
              f"that with correlated ranks, {payload_vote / one_bit:.4f}x with independent ones: at even N,")
        print("independent signs tie (sum 0) on 3/8 of the elements and the tie positions are real information")
        s = lionbit.stats()
        print(f"lionbit time split over the {s['sign_allreduce_calls']} correlated calls: "
              f"pack {s['pack_seconds']:.3f}s, "
              f"comm {s['comm_seconds']:.3f}s, vote {s['vote_seconds']:.3f}s, unpack {s['unpack_seconds']:.3f}s")
        if os.environ.get("LOCAL_WORLD_SIZE"):
            print("note: on one machine Gloo still goes through TCP on loopback")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
