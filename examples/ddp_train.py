"""Train a small transformer with DDP + DistributedLion over backend "lionbit".

    torchrun --standalone --nproc-per-node 4 examples/ddp_train.py [--device cpu|cuda] [--hierarchy node]
                                                                    [--checkpoint DIR]

On a machine with a GPU for each of its ranks (and a lionbit built with its
CUDA path) each rank takes the GPU of its LOCAL_RANK and the votes go over
NCCL; elsewhere the ranks run on the CPU over Gloo. On several nodes of several GPUs,
``--hierarchy node`` counts the signs inside each node first (the same
result, bit for bit, with fewer bytes between nodes: docs/hierarchy.md).

``--checkpoint DIR`` saves after every epoch and resumes from there, through
torch.distributed.checkpoint: every rank writes its own momentum, since each
rank's momentum is its own (saving rank 0's alone would restart every rank
from rank 0's momentum); the resumed run takes the same steps, bit for bit,
as one that was never stopped. On another number of ranks (a node lost or
added: torchrun --nnodes=MIN:MAX) it resumes too, every rank from the mean of
the saved momenta (lionbit.ElasticLoadPlanner).

The data are scikit-learn's bundled digits (no download): each 8x8 image is a
sequence of 8 row tokens. Each rank trains on its share of every global
batch; no gradient crosses the network, only 1 bit per parameter each way.
At the end rank 0 compares the bytes lionbit sent with what fp32 DDP (a ring
all-reduce of every gradient) would have sent.
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
from torch.nn.parallel import DistributedDataParallel as DDP

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


def save(folder, model, opt, sched, g, epoch, step):
    """The epoch's checkpoint: torch.distributed.checkpoint, every rank
    writing its momentum (and one rank the model); then rank 0 points last.pt
    at it, with what every rank shares (schedule, data order, step), and
    removes the epoch before."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"epoch{epoch}"
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(folder, name))
    if dist.get_rank() == 0:
        last = os.path.join(folder, "last.pt")
        before = torch.load(last, weights_only=False)["where"] if os.path.exists(last) else None
        torch.save({"epoch": epoch, "step": step, "scheduler": sched.state_dict(), "data_order": g.get_state(),
                    "where": name}, os.path.join(folder, "last.tmp"))
        os.replace(os.path.join(folder, "last.tmp"), last)  # a crash mid-save leaves the last good one
        if before not in (None, name):
            shutil.rmtree(os.path.join(folder, before), ignore_errors=True)
    dist.barrier()


def load(folder, model, opt, sched, g):
    """Resumes from last.pt's checkpoint; returns (epochs done, steps done)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    last = torch.load(os.path.join(folder, "last.pt"), weights_only=False)
    model_sd, optim_sd = get_state_dict(model, opt)
    # DCP's own planner on the same ranks; on another number, the saved momenta's mean for every rank
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(folder, last["where"]),
             planner=lionbit.ElasticLoadPlanner())
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    sched.load_state_dict(last["scheduler"])
    g.set_state(last["data_order"])
    return last["epoch"], last["step"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch, split across ranks")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--aggregation", default="vote", choices=["vote", "avg"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: a GPU a rank where the host has one for each of its ranks, else the CPU")
    parser.add_argument("--hierarchy", default="flat", choices=["flat", "node"],
                        help="node: count the signs inside each node first (several GPUs a node)")
    parser.add_argument("--checkpoint", help="a folder: save every epoch, resume from the last save")
    parser.add_argument("--stop-after", type=int, help="stop after this many epochs (a run cut short, to resume)")
    args = parser.parse_args()

    device = pick_device(args.device)
    dist.init_process_group("lionbit")  # CPU tensors over Gloo, CUDA tensors over NCCL
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.batch % world == 0, "the global batch must split evenly across ranks"

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    xte, yte, xtr, ytr = x[perm[:360]], y[perm[:360]], x[perm[360:]], y[perm[360:]]

    torch.manual_seed(0)
    model = DDP(RowTransformer().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    d = sum(p.numel() for p in model.parameters())
    opt = lionbit.DistributedLion(model.parameters(), lr=args.lr, weight_decay=0.1, aggregation=args.aggregation,
                                  hierarchy=args.hierarchy)
    opt.attach(model)
    steps_per_epoch = len(xtr) // args.batch
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    if rank == 0:
        print(f"lionbit {lionbit.__version__}: {world} ranks on {device.type}, backend {dist.get_backend()}, "
              f"transformer with {d:,} parameters, DistributedLion({args.aggregation}"
              f"{', hierarchy=' + repr(args.hierarchy) if args.hierarchy != 'flat' else ''})")

    def accuracy():
        model.eval()
        with torch.no_grad():
            acc = 100.0 * (model(xte.to(device)).argmax(1).cpu() == yte).float().mean().item()
        model.train()
        return acc

    g = torch.Generator().manual_seed(1)
    step, first, acc, t0 = 0, 0, None, time.perf_counter()
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "last.pt")):
        first, step = load(args.checkpoint, model, opt, sched, g)
        if rank == 0:
            print(f"resumed from {args.checkpoint} after epoch {first} (step {step})")
    start = step
    lionbit.reset_stats()
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
            save(args.checkpoint, model, opt, sched, g, epoch + 1, step)
    secs = time.perf_counter() - t0
    acc = accuracy() if acc is None else acc
    ran = max(step - start, 1)  # this run's steps (lionbit's counters start at this run)

    stats = lionbit.stats()
    fp32 = 2 * (world - 1) / world * 4 * d * ran  # ring all-reduce of fp32 gradients
    one_bit = 2 * (world - 1) / world * d / 8 * ran
    hashes = [None] * world
    dist.all_gather_object(hashes, hash(tuple(p.detach().sum().item() for p in model.parameters())))
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
        print(f"\ndone: {step} steps in {secs:.1f}s, final test accuracy {acc:.2f}%, "
              f"replicas identical: {len(set(hashes)) == 1}, parameters {digest.hexdigest()[:12]}")
    if rank == 0 and world == 1:
        print("bytes sent: one rank, nothing sent")
    elif rank == 0:
        calls = stats["sign_allreduce_calls"]
        intra, inter = stats.get("intra_node_bytes_sent", 0), stats.get("inter_node_bytes_sent", 0)
        sent = stats["bytes_sent"] + intra + inter
        print(f"bytes sent per rank: lionbit {sent:,} ({sent / ran:,.0f} per step; "
              f"the 1-bit figure 2(N-1)/N*d/8 is {one_bit / ran:,.0f}: {sent / one_bit:.2f}x it)")
        if args.hierarchy != "flat":
            print(f"  of which inside the node {intra:,.0f}, between nodes {inter:,.0f}, "
                  f"the header rounds {stats['bytes_sent']:,.0f} (docs/hierarchy.md: bytes)")
        print(f"                     fp32 DDP would send {fp32:,.0f} (32 bits a parameter, 32x the 1-bit figure): "
              f"{fp32 / sent:.1f}x lionbit's bytes")
        if args.hierarchy != "flat":
            print("  (hierarchy='node' sends each node's counts between nodes: fewer bytes than the flat vote's")
            print("  where a node has several ranks, more with one rank a node)")
        else:
            print("  why more than the 1-bit figure (it counts sign bits only): each vote also sends its headers and")
            print("  the directions that are exactly 0 (where, not their signs), which weigh more on a small model")
        if args.hierarchy == "flat" and world % 2 == 0 and stats["inline_tie_chunks"]:
            tie, inline = f"{world // 2}-{world // 2}", stats["inline_tie_chunks"]
            print(f"  and, at an even N, where the ranks tie ({tie}): in {inline} of {calls} votes the tie positions")
            print("  rode along in the all-gather, at 1.625 bits an element there instead of 1 (up to 1.31x the 1-bit")
            print("  figure from that alone)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
