"""Train a small transformer with FSDP2 (fully_shard) + DistributedLion over
backend "lionbit".

    torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py [--fsdp1] [--replicas M] [--device cpu|cuda]
                                                                     [--checkpoint DIR] [--bf16]

Several nodes: on M nodes (torchrun --nnodes M ...) it shards inside each
node and votes across the nodes with 1 bit (FSDP2's HSDP, a 2-D (replicate,
shard) mesh; with --fsdp1, HYBRID_SHARD over the same mesh): FSDP reduces
inside the node over the fast link, the nodes vote over the slow one, and
each rank keeps 1/(N / M) of its node's momentum. ``--replicas M`` sets M
itself (1: shard over every rank; on one host, M > 1 emulates the layout).
On a machine with a GPU for each of its ranks (and a lionbit built with its
CUDA path) each rank takes the GPU of its LOCAL_RANK; elsewhere the ranks
run on the CPU.

``--checkpoint DIR`` saves after every epoch and resumes from there, bit for bit:
FSDP2 through torch.distributed.checkpoint (get_state_dict / set_state_dict:
every rank's momentum, sharded as FSDP shards the parameter), FSDP1 as one
file a rank (its shard of the model and of its momentum). FSDP2 also resumes
on another number of ranks or nodes (lionbit.ElasticLoadPlanner: every worker
starts from the mean of the saved momenta; the global batch must still split
evenly); FSDP1 needs the same ones. ``--bf16`` computes in bf16 (FSDP2's
MixedPrecisionPolicy, FSDP1's MixedPrecision: the same steps on both).

The same task and model as examples/ddp_train.py (scikit-learn's bundled
digits, 8 row tokens per image). Each encoder layer and the root are
fully_shard units; opt.attach(model) replaces FSDP's fp32 gradient
reduce-scatter with lionbit's 1-bit sign reduce-scatter. Parameters are still
all-gathered by FSDP (forwarded to Gloo), unchanged. At the end rank 0
compares the bytes of the gradient path with what fp32 FSDP would send, and
prints the optimizer memory per rank against FSDP + AdamW.
"""

import argparse
import hashlib
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import lionbit


class RowTransformer(torch.nn.Module):
    def __init__(self, dim=64, heads=4, layers=2, classes=10):
        super().__init__()
        self.embed = torch.nn.Linear(8, dim)
        self.pos = torch.nn.Parameter(torch.zeros(8, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):  # x: (batch, 64) pixels
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        return self.head(self.encoder(h).mean(1))


def progress(step, total, loss, width=30):
    done = int(width * step / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}")
    sys.stdout.flush()


def pick_device(choice):
    """The rank's device: with "auto", its GPU (LOCAL_RANK, as torchrun sets it)
    where the host has a GPU for each of its ranks and lionbit has its CUDA
    path, else the CPU. With "cuda", more ranks than GPUs share them (NCCL
    refuses that: set LIONBIT_CUDA_TRANSPORT=gloo)."""
    if choice == "auto":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpus = torch.cuda.device_count() if lionbit.built_with_cuda and torch.cuda.is_available() else 0
        choice = "cuda" if gpus >= local_ranks else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not (lionbit.built_with_cuda and torch.cuda.is_available()):
        sys.exit("--device cuda: " + ("no CUDA device here" if lionbit.built_with_cuda else
                                      "this lionbit was built without its CUDA path"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)  # before the process group: NCCL uses the current device
    return device


def save(folder, model, opt, sched, g, epoch, step, fsdp1):
    """The epoch's checkpoint. FSDP2: torch.distributed.checkpoint, each rank
    writing its shards (of the model and of its momentum); FSDP1: a file a
    rank (its local shards and its momentum). Then rank 0 points last.pt at
    it, with what every rank shares (schedule, data order, step), and removes
    the epoch before."""
    rank = dist.get_rank()
    name = f"epoch{epoch}"
    where = os.path.join(folder, name)
    os.makedirs(where, exist_ok=True)
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            torch.save({"model": model.state_dict(), "optimizer": opt.local_state_dict()},
                       os.path.join(where, f"rank{rank}.pt"))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=where)
    dist.barrier()  # every rank's part is written
    if rank == 0:
        last = os.path.join(folder, "last.pt")
        before = torch.load(last, weights_only=False)["where"] if os.path.exists(last) else None
        torch.save({"epoch": epoch, "step": step, "scheduler": sched.state_dict(), "data_order": g.get_state(),
                    "where": name}, os.path.join(folder, "last.tmp"))
        os.replace(os.path.join(folder, "last.tmp"), last)
        if before not in (None, name):  # the epoch before: no longer needed once last.pt names this one
            shutil.rmtree(os.path.join(folder, before), ignore_errors=True)
    dist.barrier()


def load(folder, model, opt, sched, g, fsdp1, device):
    """Resumes from last.pt's checkpoint; returns (epochs done, steps done)."""
    last = torch.load(os.path.join(folder, "last.pt"), weights_only=False)
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

        mine = torch.load(os.path.join(folder, last["where"], f"rank{dist.get_rank()}.pt"), map_location=device,
                          weights_only=False)
        with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(mine["model"])
        opt.load_local_state_dict(mine["optimizer"])
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        # DCP's own planner on the same ranks; on another number, the saved momenta's mean for every worker
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(folder, last["where"]),
                 planner=lionbit.ElasticLoadPlanner())
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    sched.load_state_dict(last["scheduler"])
    g.set_state(last["data_order"])
    return last["epoch"], last["step"]


def params_digest(model, fsdp1):
    """A digest of the whole model's parameters (the same on every rank)."""
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            tensors = [p.detach().cpu().clone() for p in model.parameters()]
    else:
        tensors = [p.full_tensor().detach().cpu() for p in model.parameters()]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()[:12]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aggregation", default="vote", choices=["vote", "avg"])
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 compute: MixedPrecisionPolicy / FSDP1's MixedPrecision(param_dtype=bfloat16, "
                             "reduce_dtype=float32)")
    parser.add_argument("--fsdp1", action="store_true", help="FSDP1 (FullyShardedDataParallel) instead of fully_shard")
    parser.add_argument("--momentum-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--replicas", default="nodes",
                        help="M > 1: shard inside M groups of N / M ranks, vote across them (HSDP); "
                             "default: the number of nodes (torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: a GPU a rank where the host has one for each of its ranks, else the CPU")
    parser.add_argument("--checkpoint", help="a folder: save every epoch, resume from the last save")
    parser.add_argument("--stop-after", type=int, help="stop after this many epochs (a run cut short, to resume)")
    args = parser.parse_args()

    device = pick_device(args.device)
    dist.init_process_group("lionbit")  # CPU tensors over Gloo, CUDA tensors over NCCL
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.batch % world == 0, "the global batch must split evenly across ranks"
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    replicas = nodes if args.replicas == "nodes" else int(args.replicas)
    assert replicas >= 1 and world % replicas == 0, f"--replicas {replicas} must divide the {world} ranks"
    shards = world // replicas  # ranks a node shards over
    # (replicate, shard): rank r is shard r % shards of node r // shards, as torchrun numbers nodes' ranks
    mesh = (init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
            if replicas > 1 else init_device_mesh(device.type, (world,)))

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xte, yte, xtr, ytr = x[perm[:360]], y[perm[:360]], x[perm[360:]], y[perm[360:]]

    torch.manual_seed(0)
    model = RowTransformer()
    d = sum(p.numel() for p in model.parameters())
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy

        kw = {"device_id": device}
        if args.bf16:  # (as FSDP2's policy: Lion reads the gradient reduced in float32; accelerate's bf16 sets
            # reduce_dtype=torch.bfloat16 too, which works as well)
            kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if replicas > 1:  # each node one worker: FSDP reduces inside it, the nodes vote
            kw.update(device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        for i, layer in enumerate(model.encoder.layers):
            model.encoder.layers[i] = FSDP(layer, **kw)
        model = FSDP(model, **kw)
    else:
        model = model.to(device)
        kw = {"mesh": mesh}
        if args.bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.encoder.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    units = 1 + len(model.encoder.layers)
    mdt = getattr(torch, args.momentum_dtype)
    opt = lionbit.DistributedLion(
        model.parameters(), lr=args.lr, weight_decay=0.1, aggregation=args.aggregation, momentum_dtype=mdt
    )
    opt.attach(model)
    steps_per_epoch = len(xtr) // args.batch
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    if rank == 0:
        layout = f"{replicas} replicas (nodes) x {shards} shards" if replicas > 1 else "sharded over all"
        kind = "FSDP1 instances" if args.fsdp1 else "fully_shard units"
        print(f"lionbit {lionbit.__version__}: {world} ranks on {device.type} ({layout}), "
              f"backend {dist.get_backend()}, transformer with {d:,} parameters in {units} {kind}"
              f"{' (bf16 compute)' if args.bf16 else ''}, DistributedLion({args.aggregation}, "
              f"{args.momentum_dtype} momentum)")

    def accuracy():
        with torch.no_grad():
            acc = 100.0 * (model(xte.to(device)).argmax(1).cpu() == yte).float().mean().item()
        if not args.fsdp1:
            model.reshard()  # the root keeps its parameters unsharded after a forward
        return acc

    g = torch.Generator().manual_seed(1)
    step, first, acc, t0 = 0, 0, None, time.perf_counter()
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "last.pt")):
        first, step = load(args.checkpoint, model, opt, sched, g, args.fsdp1, device)
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {first} (step {step})")
    start = step
    # The votes' group: every rank, or under HSDP the replicas (the ranks of one shard index across nodes).
    votes = mesh.get_group("replicate") if replicas > 1 else None
    lionbit.reset_stats(votes)
    for epoch in range(first, args.epochs):
        if args.stop_after is not None and epoch == args.stop_after:
            break
        order = torch.randperm(len(xtr), generator=g)
        for i in range(steps_per_epoch):
            idx = order[i * args.batch : (i + 1) * args.batch].view(world, -1)[rank]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xtr[idx].to(device)), ytr[idx].to(device))
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and (step % 5 == 0 or step == total):
                progress(step, total, loss.item())
        acc = accuracy()
        if rank == 0:
            sys.stdout.write(f"  epoch {epoch + 1}: test accuracy {acc:.2f}%\n")
        if args.checkpoint:
            save(args.checkpoint, model, opt, sched, g, epoch + 1, step, args.fsdp1)
    secs = time.perf_counter() - t0
    acc = accuracy() if acc is None else acc
    ran = max(step - start, 1)  # the byte figures: this run's steps (lionbit's counters start at this run)
    digest = params_digest(model, args.fsdp1)

    stats = lionbit.stats(votes)
    # Padded elements FSDP reduce-scatters per step (each parameter's dim 0
    # padded to a multiple of the shards L, N on a 1-D mesh).
    if args.fsdp1:  # each FlatParameter padded to a multiple of L
        padded = sum(-(-u.numel // shards) * shards for u in opt.attachment.units)
    else:
        padded = sum(-(-p.shape[0] // shards) * shards * (p.numel() // p.shape[0])
                     for p in opt.param_groups[0]["params"])
    one_bit = (world - 1) / world * padded / 8 * ran
    fp32_rs = (world - 1) / world * 4 * padded * ran  # FSDP's fp32 reduce-scatter of gradients
    # FSDP's parameter all-gathers, the same with or without lionbit: forward
    # and backward (the root keeps its parameters unsharded after forward).
    ag = (shards - 1) / shards * 4 * padded * ran * 2
    if replicas > 1:  # HSDP: the nodes vote on each rank's shard (padded / L elements) with 1 bit
        one_bit = 2 * (replicas - 1) / replicas * padded / shards / 8 * ran
        fp32_ar = 2 * (replicas - 1) / replicas * 4 * padded / shards * ran  # HSDP's fp32 all-reduce between nodes
    params = opt.param_groups[0]["params"]  # the sharded DTensors (FSDP1: FlatParameters)
    if args.fsdp1:
        mom_bytes = sum(u.momentum.numel() * u.momentum.element_size() for u in opt.attachment.units)
        shard_bytes = sum(p.numel() * 4 for p in params)
    else:
        mom_bytes = sum(opt.state[p]["exp_avg"].numel() * opt.state[p]["exp_avg"].element_size() for p in params)
        shard_bytes = sum(p.to_local().numel() * 4 for p in params)
    if rank == 0 and replicas > 1:
        print(f"\ndone: {step} steps in {secs:.1f}s, final test accuracy {acc:.2f}%, parameters {digest}")
        print(f"between nodes, bytes sent per rank: lionbit {stats['bytes_sent']:,} "
              f"({stats['bytes_sent'] / ran:,.0f} per step, {stats['bytes_sent'] / one_bit:.2f}x the 1-bit figure "
              f"2(M-1)/M*(d/L)/8, headers included)")
        print(f"                                    HSDP's fp32 all-reduce would send {fp32_ar:,.0f}: "
              f"{fp32_ar / stats['bytes_sent']:.1f}x more")
        print(f"inside the node, FSDP's own reduce-scatter and all-gathers (unchanged): "
              f"~{(shards - 1) / shards * 4 * padded * ran * 3:,.0f}")
        print(f"optimizer memory on rank 0: momentum {mom_bytes:,} bytes (its shard of the node's, "
              f"{mom_bytes / d:.1f} B/param) vs AdamW's two sharded moments {2 * shard_bytes:,} bytes "
              f"({2 * shard_bytes / d:.1f} B/param)")
    elif rank == 0:
        print(f"\ndone: {step} steps in {secs:.1f}s, final test accuracy {acc:.2f}%, parameters {digest}")
        if world == 1:
            print("gradient path: one rank, nothing sent")
        else:
            print(f"gradient path, bytes sent per rank: lionbit {stats['bytes_sent']:,} "
                  f"({stats['bytes_sent'] / ran:,.0f} per step, {stats['bytes_sent'] / one_bit:.2f}x the 1-bit "
                  f"figure (N-1)/N*d/8, headers included)")
            print(f"                                    fp32 FSDP reduce-scatter would send {fp32_rs:,.0f}: "
                  f"{fp32_rs / stats['bytes_sent']:.1f}x more")
            print(f"with FSDP's parameter all-gathers (~{ag:,.0f}, unchanged): lionbit FSDP "
                  f"{ag + stats['bytes_sent']:,.0f} vs fp32 FSDP {ag + fp32_rs:,.0f} "
                  f"({(ag + fp32_rs) / (ag + stats['bytes_sent']):.2f}x)")
        print(f"optimizer memory on rank 0: momentum {mom_bytes:,} bytes (full-size, {mom_bytes / d:.0f} B/param) "
              f"vs AdamW's two sharded moments {2 * shard_bytes:,} bytes ({2 * shard_bytes / d:.1f} B/param)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
