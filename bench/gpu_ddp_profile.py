"""A torch.profiler trace of one DDP + DistributedLion step: where the vote's time goes.

Two ranks (on one GPU through the Gloo transport, LIONBIT_CUDA_TRANSPORT=gloo:
NCCL refuses two ranks on one device) train an MLP of --params parameters
(default ~50M, float32) under DDP with DistributedLion attached (its comm
hook votes each bucket's signs). After warm-up steps, rank 0 profiles one
step (CPU and CUDA activities) and writes the Chrome trace (gzipped) and the table of
the operators that took the most device (else host) time.

    python bench/gpu_ddp_profile.py [--device cuda] [--params 5e7] [--out DIR]
"""

import argparse
import gzip
import os
import shutil
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, port, device_type, params, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if device_type == "cuda":
        os.environ["LIONBIT_CUDA_TRANSPORT"] = "gloo"
        torch.cuda.set_device(0)
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    import lionbit

    dist.init_process_group("lionbit", rank=rank, world_size=WORLD)
    try:
        device = torch.device(device_type)
        width = max(64, int((params / 4) ** 0.5))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(device)
        ddp = DDP(model)
        opt = lionbit.DistributedLion(ddp.parameters(), lr=1e-4, weight_decay=0.1)
        opt.attach(ddp)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(32, width, generator=gen).to(device)

        def step():
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

        for _ in range(3):
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            if device_type == "cuda":
                torch.cuda.synchronize()
        if rank == 0:
            n = sum(p.numel() for p in model.parameters())
            trace = os.path.join(out, f"ddp_step_{device_type}.trace.json")
            prof.export_chrome_trace(trace)
            with open(trace, "rb") as raw, gzip.open(trace + ".gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
            os.remove(trace)
            key = "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=25)
            with open(os.path.join(out, f"ddp_step_{device_type}.txt"), "w") as f:
                f.write(f"{n / 1e6:.1f}M parameters, {WORLD} ranks, device {device}\n{table}\n")
            print(f"gpu_ddp_profile: {n / 1e6:.1f}M parameters, {WORLD} ranks on {device}; top operators by {key}:")
            print(table)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    mp.start_processes(_rank, args=(_free_port(), args.device, args.params, args.out), nprocs=WORLD,
                       start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
