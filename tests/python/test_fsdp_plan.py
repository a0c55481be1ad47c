"""An FSDP2 model's step replayed from its plan (lionbit.fsdp_plan), as a
user's script: two ranks, a model sharded unit by unit (dim 0s that FSDP
pads, a bfloat16 unit beside float32 ones), decay / no-decay parameter
groups, the learning rate set in every group before each step, the
gradients clipped every step, a GradScaler (one step skipped for an inf on
one rank), and what scripts do between steps that changes what a step is:
freezing and unfreezing a layer, zero_grad(set_to_none=False), gradient
accumulation without a sync, a gradient set to None, reloading the optimizer's state dict,
resetting one momentum, a parameter that starts training mid-run in a group
of its own, a non-contiguous gradient, an evaluation pass (eval mode,
no_grad) between two steps. Every step, on every rank, the
parameters and this rank's momenta equal Distributed Lion computed
independently in plain torch ops on unsharded copies; the steps the plan
must not replay (each of those events) are the ones it did not, and the
others were replayed. (HSDP's replayed steps: test_hsdp.)
"""

import copy

import pytest
import torch

from harness import run_ranks, values

LR, WD, BETAS, CLIP = 0.01, 0.1, (0.9, 0.99), 1.0
STEPS = 17
SKIP = 2  # rank 1's gradient holds an inf: under the GradScaler every rank skips the step
FREEZE, UNFREEZE = 3, 5  # layer `a` has no gradient in steps 3 and 4
NONCONTIG = 7  # b's weight's gradient given as a transposed view
KEEP_GRADS = 9  # from here zero_grad(set_to_none=False): the gradients are zeroed in place
RELOAD = 10  # after this step: opt.load_state_dict(deepcopy(opt.state_dict()))
EVAL = 5  # after this step: a validation pass (eval mode, no_grad)
NO_GRAD = 11  # after backward head.bias.grad is set to None: it is not updated this step
RESET = 12  # before this step: head.bias's state dropped (its momentum starts again at 0)
ACCUMULATE = 13  # two micro-batches, the first without a gradient sync
ADD = 15  # from here `extra` trains, in a parameter group of its own
# The steps a plan replays: not the first (it plans), nor the skipped one (its
# votes raised), nor one at any of the events that change the step, nor the
# one after the non-contiguous gradient (its step could not be planned, so the
# next one plans).
REPLAYED = [1, 4, 6, 9, 10, 13, 14, 16]


class Scale(torch.nn.Module):
    """A bfloat16 parameter: a unit of its own (FSDP2 gathers a unit in one dtype)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, y):
        return y * self.w.float()


class Net(torch.nn.Module):
    """Dims 33 and 7 are not multiples of 2: FSDP pads them."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 33)
        self.b = torch.nn.Linear(33, 7)
        self.head = torch.nn.Linear(7, 4)
        self.scale = Scale()
        self.extra = torch.nn.Parameter(torch.zeros(4))  # trained from step ADD on

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.scale(self.head(h)) + self.extra


def _model(device="cpu"):
    torch.manual_seed(0)
    net = Net().to(device)
    net.extra.requires_grad_(False)
    return net


def _batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _loss(model, rank, step, micro=0):
    device = model.extra.device
    x, y = (t.to(device) for t in _batch(rank, step, micro))
    return torch.nn.functional.cross_entropy(model(x), y)


def _lr(step):
    return LR * 0.9**step  # every group's lr set before each step


def _decays(name):
    return name.endswith("weight") and not name.startswith("scale")


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def _trained(name, step):
    if name.startswith("a.") and FREEZE <= step < UNFREEZE:
        return False
    if name == "head.bias" and step == NO_GRAD:
        return False
    return name != "extra" or step >= ADD


def simulate(world_size, device="cpu"):
    """Distributed Lion on world_size simulated ranks, plain torch ops (the
    float contract of lionbit.lion_math): each rank's gradient from its own
    unsharded copy (clipped by its own norm), the vote sign(sum of
    directions), the events of the script."""
    b1, b2 = BETAS
    cb1, comb1, cb2, comb2 = (_f32(v).to(device) for v in (b1, 1 - b1, b2, 1 - b2))
    net = _model(device)
    params = dict(net.named_parameters())
    momenta = [{} for _ in range(world_size)]
    history = []
    for step in range(STEPS):
        if step == SKIP:  # nothing changes anywhere
            history.append(history[-1])
            continue
        trained = [n for n in params if _trained(n, step)]
        if step == RESET:
            for m in momenta:
                m.pop("head.bias")
        votes = {n: torch.zeros_like(params[n], dtype=torch.float32) for n in trained}
        for r in range(world_size):
            rep = copy.deepcopy(net)
            mine = dict(rep.named_parameters())
            for n, p in mine.items():
                p.requires_grad_(n in trained)
            for micro in range(2 if step == ACCUMULATE else 1):
                _loss(rep, r, step, micro).backward()
            torch.nn.utils.clip_grad_norm_([mine[n] for n in trained], CLIP)
            for n in trained:  # in float32 (the momentum's dtype), whatever the parameter's
                g, m = mine[n].grad.float(), momenta[r].get(n, torch.zeros(params[n].shape, device=device))
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


def script(rank, world_size, device="cpu"):
    """The user's script."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lionbit

    net = _model(device)
    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    for unit in (net.a, net.b, net.scale):
        fully_shard(unit, mesh=mesh)
    fully_shard(net, mesh=mesh)
    named = dict(net.named_parameters())
    decay = [p for n, p in named.items() if n != "extra" and _decays(n)]
    no_decay = [p for n, p in named.items() if n != "extra" and not _decays(n)]
    opt = lionbit.DistributedLion([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                                  betas=BETAS, weight_decay=WD)
    opt.attach(net)
    want = simulate(world_size, device)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=10**6)
    replayed = []
    for step in range(STEPS):
        if step == FREEZE:
            net.a.requires_grad_(False)
        if step == UNFREEZE:
            net.a.requires_grad_(True)
        if step == ADD:
            named["extra"].requires_grad_(True)
            opt.add_param_group({"params": [named["extra"]], "weight_decay": 0.0})
        if step == RESET:
            opt.state[named["head.bias"]] = {}
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.zero_grad(set_to_none=step < KEEP_GRADS)
        micros = 2 if step == ACCUMULATE else 1
        for micro in range(micros):
            net.set_requires_gradient_sync(micro == micros - 1)
            scaler.scale(_loss(net, rank, step, micro)).backward()
        if step == SKIP and rank == world_size - 1:
            net.b.weight.grad.to_local()[0, 0] = float("inf")
        if step == NO_GRAD:
            named["head.bias"].grad = None
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], CLIP)
        if step == NONCONTIG:
            g = net.b.weight.grad
            local = g.to_local().t().contiguous().t()
            net.b.weight.grad = torch.distributed.tensor.DTensor.from_local(local, g.device_mesh, g.placements)
            assert not net.b.weight.grad.to_local().is_contiguous()
        before = opt.attachment.plan.replayed
        scaler.step(opt)
        scaler.update()
        if opt.attachment.plan.replayed > before:
            replayed.append(step)
        if step == EVAL:  # a validation pass between steps: nothing of the next step changes
            net.eval()
            with torch.no_grad():
                net(torch.ones(3, 8, device=device))
            net.train()
        if step == RELOAD:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        params, momenta = want[step]
        for n, p in named.items():
            got = p.full_tensor()
            assert torch.equal(got, params[n]), f"step {step}: {n} differs from the simulation"
            if n in momenta[rank]:
                m = opt.state[p].get("exp_avg")
                assert m is not None and torch.equal(m, momenta[rank][n]), f"step {step}: {n}'s momentum"
    assert scaler.get_scale() == 2.0**9, "the scaler backed off once, on every rank"
    return replayed


def test_an_fsdp2_models_replayed_steps_equal_the_simulation():
    res = values(run_ranks("test_fsdp_plan:script", 2))
    assert res == [REPLAYED, REPLAYED], res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_fsdp2_models_replayed_steps_equal_the_simulation_on_a_gpu():
    """The same on one GPU (NCCL underneath, world size 1, FSDP's own
    gradients): the plan's calls of the GPU's list kernels with spans, a
    launch per parameter group and dtype pair."""
    res = values(run_ranks("test_fsdp_plan:script", 1, kwargs={"device": "cuda"}))
    assert res == [REPLAYED], res
