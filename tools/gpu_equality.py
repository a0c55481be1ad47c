"""DDP and FSDP2 with DistributedLion on CUDA tensors against the same runs on CPU.

Two ranks (on one GPU they share it through the Gloo transport,
LIONBIT_CUDA_TRANSPORT=gloo, since NCCL refuses two ranks on one device)
train the same model on the same batches under DDP and under FSDP2
(fully_shard), once on CPU tensors and once on CUDA tensors, with
DistributedLion ("vote", "avg" and "l1", bits=4). The model is linear with a
linear loss and small-integer inputs, so every gradient is an exact integer
whatever the order of summation: a CPU run and a CUDA run see the same
gradients and must end bit for bit equal; so must DDP and FSDP2 (both vote
on the same directions). Without a GPU only the CPU runs happen, and DDP is
checked against FSDP2 on CPU.

HSDP (FSDP2 on a 2-D (replicate, shard) mesh) runs on its own four ranks,
2 nodes x 2 ranks ("vote" and "avg"; l1 is refused there): its CUDA run must
equal its CPU run bit for bit (its CPU runs are checked against an
independent reference in tests/python/test_hsdp.py).

    python tools/gpu_equality.py [--devices cpu,cuda] [--no-hsdp] [--json FILE]
"""

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
HSDP_MESH = (2, 2)  # (replicate, shard): 2 nodes x 2 ranks
STEPS = 12
CONFIGS = (("vote", {}), ("avg", {}), ("l1:4", {"aggregation": "l1", "bits": 4}))
HSDP_CONFIGS = CONFIGS[:2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoLinear(torch.nn.Module):
    """Two linear layers, each fed integer inputs of its own: with a linear
    loss, d/dW = t^T x, an exact integer."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(96, 33), torch.nn.Linear(33, 5)

    def forward(self, x, h):
        return self.first(x), self.second(h)


def _model(device):
    torch.manual_seed(0)
    return TwoLinear().to(device)


def _train(rank, kind, device, config):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    name, kwargs = config
    kwargs = kwargs or {"aggregation": name}
    model = _model(device)
    if kind == "ddp":
        wrapped = DDP(model, bucket_cap_mb=0.001)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # FSDP2's default mesh is CUDA wherever there is a GPU: the CPU run names its device.
        if kind == "hsdp":
            mesh = init_device_mesh(device.type, HSDP_MESH, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (WORLD,))
        fully_shard(model.first, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = lionbit.DistributedLion(wrapped.parameters(), lr=2**-10, weight_decay=0.5, **kwargs)
    opt.attach(wrapped)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(-2, 3, (16, 96), generator=gen).float().to(device)
        h = torch.randint(-2, 3, (16, 33), generator=gen).float().to(device)
        t = torch.randint(-1, 2, (16, 5), generator=gen).float().to(device)
        opt.zero_grad()
        a, b = wrapped(x, h)
        loss = (a * h).sum() + (b * t).sum()
        loss.backward()
        opt.step()
    if kind == "ddp":
        full = [p.detach() for p in model.parameters()]
    else:
        full = [p.full_tensor().detach() for p in model.parameters()]
    flat = torch.cat([p.cpu().reshape(-1) for p in full])
    return flat.view(torch.int32).tolist()


def _rank(rank, port, devices, results_dir, world, kinds):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if "cuda" in devices:
        os.environ["LIONBIT_CUDA_TRANSPORT"] = "gloo"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(0)
    import lionbit  # noqa: F401  (registers the backend)

    dist.init_process_group("lionbit", rank=rank, world_size=world)
    out = {}
    try:
        for device in devices:
            for kind in kinds:
                for config in HSDP_CONFIGS if kind == "hsdp" else CONFIGS:
                    out[f"{device}/{kind}/{config[0]}"] = _train(rank, kind, torch.device(device), config)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-hsdp", action="store_true", help="leave out the four-rank HSDP runs")
    ap.add_argument("--json", help="write the verdicts here")
    args = ap.parse_args(argv)
    devices = args.devices.split(",")
    runs = _launch(devices, WORLD, ("ddp", "fsdp2"))
    checks = {}
    for name, _ in CONFIGS:
        for device in devices:
            for kind in ("ddp", "fsdp2"):
                key = f"{device}/{kind}/{name}"
                checks[f"{device} {kind} {name}: ranks agree"] = all(r[key] == runs[0][key] for r in runs)
        checks[f"cpu {name}: ddp == fsdp2"] = runs[0][f"cpu/ddp/{name}"] == runs[0][f"cpu/fsdp2/{name}"]
        if "cuda" in devices:
            for kind in ("ddp", "fsdp2"):
                checks[f"{kind} {name}: cuda == cpu"] = all(
                    r[f"cuda/{kind}/{name}"] == r[f"cpu/{kind}/{name}"] for r in runs)
    moved = sum(a != b for a, b in zip(runs[0]["cpu/ddp/vote"], _initial()))
    checks["the runs moved the parameters"] = moved > 0
    if not args.no_hsdp:
        hsdp = _launch(devices, HSDP_MESH[0] * HSDP_MESH[1], ("hsdp",))
        for name, _ in HSDP_CONFIGS:
            for device in devices:
                key = f"{device}/hsdp/{name}"
                checks[f"{device} hsdp {name}: ranks agree"] = all(r[key] == hsdp[0][key] for r in hsdp)
            if "cuda" in devices:
                checks[f"hsdp {name}: cuda == cpu"] = all(r[f"cuda/hsdp/{name}"] == r[f"cpu/hsdp/{name}"] for r in hsdp)
        checks["hsdp: the runs moved the parameters"] = hsdp[0]["cpu/hsdp/vote"] != _initial()
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    print(f"gpu_equality: {sum(checks.values())}/{len(checks)} checks hold on devices {','.join(devices)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": devices, "checks": checks}, f, indent=1)
    return 0 if all(checks.values()) else 1


#: What the ranks' fork server imports once, so that no rank pays it (4-7 s of CPU a rank on
#: 2-core machines). Importing them initialises no CUDA device (nor does the server do
#: anything else with CUDA): each rank's first CUDA call comes after its fork.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _launch(devices, world, kinds):
    """Each rank's final parameters (as int32 bits) per "device/kind/config", from `world` ranks
    forked from a server that has imported torch (start method "forkserver"; with
    LIONBIT_BENCH_FORK=0, as for the bench scripts' ranks, fresh interpreters: "spawn")."""
    method = "spawn" if os.environ.get("LIONBIT_BENCH_FORK", "1") == "0" else "forkserver"
    mp.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(_free_port(), devices, tmp, world, kinds), nprocs=world,
                           start_method=method)
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def _initial():
    return torch.cat([p.detach().reshape(-1) for p in _model("cpu").parameters()]).view(torch.int32).tolist()


if __name__ == "__main__":
    sys.exit(main())
