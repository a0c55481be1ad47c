"""The canonical FSDP2 training script with DistributedLion: a script shaped
like pytorch/examples' distributed/FSDP2/example.py (a transformer built on
the meta device, ``fully_shard`` on every block and then on the root,
``clip_grad_norm_(model.parameters(), max_norm=1.0)`` every step, a
checkpoint saved at the end and loaded at the next start, through its
default path or ``--dcp-api``), with only its optimizer lines changed to
``DistributedLion(...)`` + ``attach(model)``, on real processes.

Each checkpoint path: one run of 2K steps without a checkpoint against a run
of K steps that saves, and a fresh run (new processes, as the script is
started again) that loads and runs K more. The resumed run's parameters and
every rank's momentum must equal the uninterrupted run's bitwise, and each
rank must get its own momentum back (the ranks see different data, so their
momenta differ). The clipping must be active (gradient norms above 1).
"""

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import run_ranks, values

K = 3  # steps per run of the script
VOCAB, DIM, HEADS, SEQ, LAYERS, BATCH = 17, 8, 2, 6, 2, 4
LION = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
PATHS = ("dtensor_api", "dcp_api", "dcp_save")


# -- the model (a small transformer in the example's shape) -------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, t, HEADS, d // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def reset_parameters(self):
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()


# -- the checkpointer (the example's two paths, and dcp.save / dcp.load) ------


class Checkpointer:
    """Saves at the end of a run, loads the latest at the start of the next:
    ``dtensor_api`` (the example's default: full tensors gathered by hand,
    torch.save on rank 0; loaded with distribute_tensor and
    ``load_state_dict(assign=True)``), ``dcp_api`` (its ``--dcp-api``:
    get/set_*_state_dict with full_state_dict=True, cpu_offload=True on
    save, broadcast_from_rank0=True on load) or ``dcp_save``
    (torch.distributed.checkpoint's dcp.save / dcp.load of the default
    sharded state dicts)."""

    def __init__(self, folder, path):
        self.path = path
        self.root = os.path.join(folder, path)
        runs = [int(d) for d in os.listdir(self.root)] if os.path.isdir(self.root) else []
        self.last = max(runs, default=None)

    def _dir(self, run):
        return os.path.join(self.root, str(run))

    def load_model(self, model):
        if self.path == "dcp_save":
            model.to_empty(device="cpu")
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, checkpoint_id=self._dir(self.last))
            set_model_state_dict(model, sd["model"])
            return
        full = torch.load(os.path.join(self._dir(self.last), "model.pt"), mmap=True, weights_only=True)
        if self.path == "dcp_api":
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            return
        meta = model.state_dict()
        sharded = {
            name: nn.Parameter(distribute_tensor(t, meta[name].device_mesh, meta[name].placements))
            for name, t in full.items()
        }
        model.load_state_dict(sharded, strict=False, assign=True)

    def load_optim(self, model, opt):
        where = self._dir(self.last)
        if self.path == "dcp_save":
            sd = {"optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=where)
            set_optimizer_state_dict(model, opt, sd["optim"])
            return
        full = torch.load(os.path.join(where, "optim.pt"), mmap=True, weights_only=True)
        if self.path == "dcp_api":
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_optimizer_state_dict(model, opt, full, options=options)
            return
        _init_optim_state(opt)
        sd = opt.state_dict()
        for group, saved in zip(sd["param_groups"], full["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for index, saved_index in zip(group["params"], saved["params"]):
                state = sd["state"].get(index)
                for key, value in (state or {}).items():
                    loaded = full["state"][saved_index][key]
                    state[key] = (
                        distribute_tensor(loaded, value.device_mesh, value.placements)
                        if isinstance(value, DTensor) else loaded
                    )
        opt.load_state_dict(sd)

    def save(self, model, opt):
        where = self._dir(0 if self.last is None else self.last + 1)
        if self.path == "dcp_save":
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=where)
            return
        rank0 = dist.get_rank() == 0
        if self.path == "dcp_api":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            msd = get_model_state_dict(model, options=options)
            osd = get_optimizer_state_dict(model, opt, options=options)
        else:
            msd = {name: t.full_tensor().cpu() for name, t in model.state_dict().items()}
            sd = opt.state_dict()
            state = {
                index: {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in st.items()}
                for index, st in sd["state"].items()
            }
            osd = {"param_groups": sd["param_groups"], "state": state}
        if rank0:
            os.makedirs(where, exist_ok=True)
            torch.save(msd, os.path.join(where, "model.pt"))
            torch.save(osd, os.path.join(where, "optim.pt"))


# -- the script -------------------------------------------------------------------


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def _tokens(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def main(rank, world_size, folder, path, steps):
    """The example's main() on CPU: build on meta, shard every block and the
    root, initialize or load, train ``steps`` steps with clipping, save."""
    import lionbit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    checkpointer = Checkpointer(folder, path) if path else None
    resumed = checkpointer is not None and checkpointer.last is not None
    if not resumed:
        model.to_empty(device="cpu")
        model.reset_parameters()
    else:
        checkpointer.load_model(model)
    optim = lionbit.DistributedLion(model.parameters(), **LION)  # was: torch.optim.Adam(model.parameters(), lr=1e-2)
    optim.attach(model)  # the one added line
    if resumed:
        checkpointer.load_optim(model, optim)
    params = list(model.parameters())
    loaded = _digest(optim.state[p]["exp_avg"] for p in params) if resumed else None
    start = optim.steps_taken
    norms = []
    for _ in range(steps):
        x = _tokens(rank, optim.steps_taken)
        loss = model(x).sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norms.append(float(norm.to_local() if hasattr(norm, "to_local") else norm))
        optim.step()
        optim.zero_grad()
    at_save = _digest(optim.state[p]["exp_avg"] for p in params)
    if checkpointer is not None:
        checkpointer.save(model, optim)
    return {
        "start": start,
        "steps": optim.steps_taken,
        "lr": optim.param_groups[0]["lr"],
        "loaded_momentum": loaded,
        "momentum": at_save,
        "params": _digest(p.full_tensor() for p in params),
        "norms": norms,
    }


def first_runs(rank, world_size, folder):
    """The uninterrupted run of 2K steps, then a first run of K steps that
    saves through every path (a fresh model for each)."""
    out = {"full": main(rank, world_size, folder, None, 2 * K)}
    for path in PATHS:
        out[path] = main(rank, world_size, folder, path, K)
    return out


def resumed_runs(rank, world_size, folder):
    return {path: main(rank, world_size, folder, path, K) for path in PATHS}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_example_clips_and_resumes_its_momentum(world_size, tmp_path):
    folder = str(tmp_path)
    first = values(run_ranks("test_fsdp2_example:first_runs", world_size, kwargs=dict(folder=folder)))
    again = values(run_ranks("test_fsdp2_example:resumed_runs", world_size, kwargs=dict(folder=folder)))
    full = [f["full"] for f in first]
    assert len({r["params"] for r in full}) == 1, "the replicas' parameters differ"
    assert len({r["momentum"] for r in full}) == world_size, "each rank's momentum should be its own"
    assert all(v > 1.0 for r in full for v in r["norms"]), "the clipping did nothing: the test would not test it"
    assert len({tuple(r["norms"]) for r in full}) == world_size, "each rank clips by its own norm"
    for path in PATHS:
        for rank in range(world_size):
            before, after, want = first[rank][path], again[rank][path], full[rank]
            what = (path, rank)
            # a fresh start runs like the first half of the uninterrupted run
            assert before["start"] == 0 and before["steps"] == K and before["norms"] == want["norms"][:K], what
            # the resume gets this rank's own momentum and the step count back ...
            assert after["start"] == K and after["loaded_momentum"] == before["momentum"], what
            assert after["lr"] == LION["lr"], what
            # ... and continues bitwise as if never stopped
            assert after["steps"] == 2 * K and after["norms"] == want["norms"][K:], what
            assert after["params"] == want["params"], what
            assert after["momentum"] == want["momentum"], what
