"""An FSDP1 model's step replayed from its plan (lionbit.fsdp1_plan), as a
user's script: two ranks, three FSDP instances (one FULL_SHARD unit whose
flat parameter FSDP pads, a NO_SHARD unit beside it, a bfloat16 unit, the
root), use_orig_params with decay / no-decay parameter groups, the learning
rate set in every group before each step, the root's clip_grad_norm_ every
step, and what scripts do between steps that changes what a step is or
must not: an inf in one rank's batch (every rank raises, nothing changes,
the script goes on), a layer the forward skips for two steps,
a parameter frozen at attach() (in the optimizer) that starts training, one
frozen and outside the optimizer that joins it in a group of its own,
zero_grad(set_to_none=False), torch's optimizer state dict reloaded, the
per-rank momentum file reloaded, gradient accumulation under no_sync(),
an evaluation pass (eval mode, no_grad) between two steps.
Every step, on every rank, the parameters and this rank's momenta equal
Distributed Lion computed independently in plain torch ops on unsharded
copies; the steps the plan must not replay (each of those events) are the
ones it did not, and the others were replayed.
"""

import copy

import pytest
import torch

from harness import run_ranks, values
from test_fsdp_plan import Scale  # a bfloat16 parameter: a unit of its own (a FlatParameter is one dtype)

LR, WD, BETAS, CLIP = 0.01, 0.1, (0.9, 0.99), 1.0
STEPS = 16
SKIP = 2  # the last rank's batch holds an inf: every rank raises, nothing changes anywhere
DROP, RETURN = 3, 5  # the forward skips layer `a` in steps 3 and 4: its unit has no gradient
THAW = 6  # head.bias, frozen at attach() and in the optimizer, trains from here
KEEP_GRADS = 8  # from here zero_grad(set_to_none=False): the gradients are zeroed in place
RELOAD = 9  # after this step: opt.load_state_dict(deepcopy(opt.state_dict()))
EVAL = 7  # after this step: a validation pass (eval mode, no_grad)
LOCAL_RELOAD = 11  # after this step: opt.load_local_state_dict(deepcopy(opt.local_state_dict()))
ADD = 12  # from here `extra` (frozen, in no group) trains, in a parameter group of its own
ACCUMULATE = 13  # two micro-batches, the first under model.no_sync()
# The steps a plan replays: not the first (it plans), nor the one that raised,
# nor the first step without `a`, the first with it again, the first with
# head.bias or `extra` training (each plans anew).
REPLAYED = [1, 4, 7, 8, 9, 10, 11, 13, 14, 15]


class Net(torch.nn.Module):
    """a's 297 elements are odd: FSDP pads its flat parameter to shard it."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 33)
        self.b = torch.nn.Linear(33, 7)
        self.head = torch.nn.Linear(7, 4)
        self.scale = Scale()
        self.extra = torch.nn.Parameter(torch.zeros(4))  # trained from step ADD on
        self.register_buffer("bypass", torch.linspace(-1, 1, 8 * 33).reshape(8, 33))

    def forward(self, x, use_a=True):
        h = torch.tanh(self.a(x)) if use_a else x @ self.bypass
        return self.scale(self.head(torch.tanh(self.b(h)))) + self.extra


def _model(device="cpu"):
    torch.manual_seed(0)
    net = Net().to(device)
    net.head.bias.requires_grad_(False)
    net.extra.requires_grad_(False)
    return net


def _batch(rank, world_size, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    if step == SKIP and rank == world_size - 1:
        x[0, 0] = float("inf")
    return x, y


def _loss(model, rank, world_size, step, micro=0):
    device = model.bypass.device
    x, y = (t.to(device) for t in _batch(rank, world_size, step, micro))
    return torch.nn.functional.cross_entropy(model(x, use_a=not DROP <= step < RETURN), y)


def _lr(step):
    return LR * 0.9**step  # every group's lr set before each step


def _decays(name):
    return name.endswith("weight")


def _trained(name, step):
    if name.startswith("a.") and DROP <= step < RETURN:
        return False
    if name == "head.bias":
        return step >= THAW
    return name != "extra" or step >= ADD


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def simulate(world_size, device="cpu"):
    """Distributed Lion on world_size simulated ranks, plain torch ops (the
    float contract of lionbit.lion_math): each rank's gradient from its own
    unsharded copy (clipped by its own norm, DDP's semantics), the vote
    sign(sum of directions), the events of the script."""
    b1, b2 = BETAS
    cb1, comb1, cb2, comb2 = (_f32(v).to(device) for v in (b1, 1 - b1, b2, 1 - b2))
    net = _model(device)
    params = dict(net.named_parameters())
    momenta = [{n: torch.zeros(p.shape, device=device) for n, p in params.items()} for _ in range(world_size)]
    history = []
    for step in range(STEPS):
        if step == SKIP:  # nothing changes anywhere
            history.append(history[-1])
            continue
        trained = [n for n in params if _trained(n, step)]
        votes = {n: torch.zeros(params[n].shape, device=device) for n in trained}
        for r in range(world_size):
            rep = copy.deepcopy(net)
            mine = dict(rep.named_parameters())
            for n, p in mine.items():
                p.requires_grad_(n in trained)
            for micro in range(2 if step == ACCUMULATE else 1):
                _loss(rep, r, world_size, step, micro).backward()
            torch.nn.utils.clip_grad_norm_([mine[n] for n in trained], CLIP)
            for n in trained:  # in float32 (the momentum's dtype), whatever the parameter's
                g, m = mine[n].grad.float(), momenta[r][n]
                votes[n] += torch.sign(torch.add(torch.mul(m, cb1), torch.mul(g, comb1)))
                momenta[r][n] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
        with torch.no_grad():
            for n in trained:
                lr, wd = _lr(step), (WD if _decays(n) else 0.0)
                clr, decay = _f32(lr).to(device), _f32(1.0 - lr * wd).to(device)
                x = params[n]
                x.copy_(torch.sub(torch.mul(x.float(), decay), torch.mul(torch.sign(votes[n]), clr)).to(x.dtype))
        history.append(({n: p.detach().clone() for n, p in params.items()},
                        [{n: m.clone() for n, m in mr.items()} for mr in momenta]))
    return history


def _momenta(opt):
    """This rank's momentum per original parameter: its segment of lionbit's
    flat momentum of its FSDP instance (full-size, in FlatParameter order)."""
    return {fqn: unit.momentum_tensor()[off : off + numel]
            for unit in opt.attachment.units for off, numel, _, fqn in unit.segments}


def script(rank, world_size, device="cpu"):
    """The user's script."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    import lionbit

    net = _model()
    kw = dict(device_id=torch.device(device), use_orig_params=True)
    net.a = FSDP(net.a, sharding_strategy=ShardingStrategy.FULL_SHARD, **kw)
    net.b = FSDP(net.b, sharding_strategy=ShardingStrategy.NO_SHARD, **kw)
    net.scale = FSDP(net.scale, sharding_strategy=ShardingStrategy.FULL_SHARD, **kw)
    model = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD, **kw)
    named = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    decay = [p for n, p in named.items() if _decays(n)]
    no_decay = [p for n, p in named.items() if not _decays(n) and n != "extra"]  # (head.bias frozen: in it)
    opt = lionbit.DistributedLion([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                                  betas=BETAS, weight_decay=WD)
    opt.attach(model)
    want = simulate(world_size, device)
    replayed = []
    for step in range(STEPS):
        if step == THAW:
            named["head.bias"].requires_grad_(True)
        if step == ADD:
            named["extra"].requires_grad_(True)
            opt.add_param_group({"params": [named["extra"]], "weight_decay": 0.0})
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.zero_grad(set_to_none=step < KEEP_GRADS)
        if step == ACCUMULATE:
            with model.no_sync():
                _loss(model, rank, world_size, step, 0).backward()
            _loss(model, rank, world_size, step, 1).backward()
        else:
            _loss(model, rank, world_size, step).backward()
        model.clip_grad_norm_(CLIP)
        before = opt.attachment.plan.replayed
        try:
            opt.step()
        except RuntimeError as err:  # the script's guard: log and go on
            assert step == SKIP and f"non-finite gradient (inf or NaN) on rank(s) [{world_size - 1}]" in str(err)
        if opt.attachment.plan.replayed > before:
            replayed.append(step)
        if step == EVAL:  # a validation pass between steps: nothing of the next step changes
            model.eval()
            with torch.no_grad():
                model(torch.ones(3, 8, device=device))
            model.train()
        if step == RELOAD:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        if step == LOCAL_RELOAD:
            opt.load_local_state_dict(copy.deepcopy(opt.local_state_dict()))
        params, momenta = want[step]
        with FSDP.summon_full_params(model):
            for n, p in named.items():
                assert torch.equal(p.detach(), params[n]), f"step {step}: {n} differs from the simulation"
        for n, m in _momenta(opt).items():
            assert torch.equal(m, momenta[rank][n].reshape(-1)), f"step {step}: {n}'s momentum differs"
    # opt.state shows every parameter's momentum in its state dict, `extra` (added at step ADD) too
    sd = opt.state_dict()
    name_of = {p: n for n, p in named.items()}
    mine = _momenta(opt)
    ps = [p for g in opt.param_groups for p in g["params"]]  # torch's indices of "state"
    assert all(torch.equal(sd["state"][i]["exp_avg"], mine[name_of[p]]) for i, p in enumerate(ps))
    # (no plan where the list kernels do not run: LIONBIT_KERNELS=aten)
    return replayed == (REPLAYED if lionbit.kernel_choice.list_kernels_allowed(device) else []) or replayed


def test_an_fsdp1_models_replayed_steps_equal_the_simulation():
    res = values(run_ranks("test_fsdp1_plan:script", 2))
    assert res == [True, True], f"replayed steps {res}, expected {REPLAYED}"


def test_at_world_size_one_every_unit_is_no_shard_and_replays_alike():
    """FSDP1 runs every instance NO_SHARD on one rank: the plan's votes are
    the NO_SHARD units' all-reduce chunks alone."""
    res = values(run_ranks("test_fsdp1_plan:script", 1))
    assert res == [True], f"replayed steps {res}, expected {REPLAYED}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_fsdp1_models_replayed_steps_equal_the_simulation_on_a_gpu():
    """The same on one GPU (NCCL underneath, world size 1: every unit
    NO_SHARD): the GPU's list kernels with spans of the flat tensors, for
    the directions, the momenta and the applies (a launch per parameter
    group and dtype pair)."""
    res = values(run_ranks("test_fsdp1_plan:script", 1, kwargs={"device": "cuda"}))
    assert res == [True], f"replayed steps {res}, expected {REPLAYED}"
