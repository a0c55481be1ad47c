"""A plain module's step replayed from its plan (lionbit.step_plan), as a
user's script: two ranks, a model with decay / no-decay parameter groups,
its learning rate set in every group before each step (nanoGPT's way), a
GradScaler (one step skipped for an inf on one rank), and the things
scripts do between steps that change what a step is: freezing and
unfreezing a layer, zero_grad(set_to_none=False),
reloading the optimizer's state dict, resetting one momentum, a parameter
group added mid-run, a non-contiguous gradient, a parameter whose ``p.data``
is made non-contiguous after a planned step. Every step, on every rank,
the parameters and this rank's momenta equal Distributed Lion computed
independently in plain torch ops (with one momentum buffer and with two:
``double_buffer=True``); the steps the plan must not replay (each
of those events) are the ones it did not, and the others were replayed.
"""

import copy

import pytest
import torch

from harness import run_ranks, values

LR, WD, BETAS = 0.01, 0.1, (0.9, 0.99)
STEPS = 16
SKIP = 2  # rank 1's gradient holds an inf: under the GradScaler every rank skips the step
FREEZE, UNFREEZE = 3, 5  # the first layer has no gradient in steps 3 and 4
NONCONTIG = 7  # the last weight's gradient given as a transposed view
KEEP_GRADS = 9  # from here zero_grad(set_to_none=False): the same gradient tensors each step
RELOAD = 10  # after this step: opt.load_state_dict(deepcopy(opt.state_dict())): new momentum tensors
RESET = 12  # before this step: the last bias's state dropped (its momentum starts again at 0)
ADD = 13  # from here `extra` trains, in a parameter group of its own
# Before this step (plain module only) the last weight's p.data is made non-contiguous; its p.grad, kept,
# is not. (Under DDP torch's own reducer then leaves a wrong p.grad, Gloo's all-reduce as lionbit's hook.)
PARAM_LAYOUT = 15
# The steps a plan replays: not the first (it plans), nor the skipped one (its
# votes raised; the plan stands), nor one at any of the others, nor the one
# after the non-contiguous gradient (its step could not be planned, so the
# next one plans), nor a step whose parameter is no longer contiguous.
REPLAYED = {"plain": [1, 4, 6, 9, 10, 14], "ddp": [1, 4, 6, 9, 10, 14, 15]}


class Net(torch.nn.Module):
    """A float32 MLP with a bfloat16 output scale (a group of two dtypes: on a
    GPU two launches)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.scale = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, x):
        return self.layers(x) * self.scale.float()


def _model(device):
    """The model, and ``extra`` (outside it), trained from step ADD on."""
    torch.manual_seed(0)
    net = Net().to(device)
    extra = torch.nn.Parameter(torch.randn(4, device=device) * 0.1)
    return net, extra


def _loss(net, extra, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    device = extra.device
    return torch.nn.functional.cross_entropy(net(x.to(device)) + extra, y.to(device))


def _lr(step):
    return LR * 0.8**step  # nanoGPT's habit: every group's lr set before each step


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def simulate(world_size, device, layout_change=True):
    """Distributed Lion on world_size simulated ranks, plain torch ops (the
    float contract of lionbit.lion_math): each rank's gradient from its own
    copy, the vote sign(sum of directions), the events of the script."""
    b1, b2 = BETAS
    cb1, comb1, cb2, comb2 = (_f32(v).to(device) for v in (b1, 1 - b1, b2, 1 - b2))
    net, extra = _model(device)
    params = dict(net.named_parameters(), extra=extra)
    momenta = [{} for _ in range(world_size)]
    history = []
    for step in range(STEPS):
        if step == SKIP:  # nothing changes anywhere
            history.append(history[-1])
            continue
        trained = [n for n in params if not (n.startswith("layers.0.") and FREEZE <= step < UNFREEZE)
                   and not (n == "extra" and step < ADD)]
        if step == RESET:
            for m in momenta:
                m.pop("layers.2.bias")
        votes = {n: torch.zeros_like(params[n]) for n in trained}
        for r in range(world_size):
            rep, rep_extra = copy.deepcopy(net), copy.deepcopy(extra)
            mine = dict(rep.named_parameters(), extra=rep_extra)
            for n, p in mine.items():
                p.requires_grad_(n in trained)
            if layout_change and step >= PARAM_LAYOUT:  # the user's layout, which the forward's products follow
                rep.layers[2].weight.data = rep.layers[2].weight.data.t().contiguous().t()
            _loss(rep, rep_extra, r, step).backward()
            for n in trained:  # in float32 (the momentum's dtype), whatever the parameter's
                g, m = mine[n].grad.float(), momenta[r].get(n, torch.zeros(params[n].shape, device=device))
                votes[n] += torch.sign(torch.add(torch.mul(m, cb1), torch.mul(g, comb1)))
                momenta[r][n] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
        with torch.no_grad():
            for n in trained:
                lr, wd = _lr(step), (WD if n.endswith("weight") else 0.0)
                clr, decay = _f32(lr).to(device), _f32(1.0 - lr * wd).to(device)
                x = params[n]
                x.copy_(torch.sub(torch.mul(x.float(), decay), torch.mul(torch.sign(votes[n]), clr)).to(x.dtype))
        history.append(({n: p.detach().clone() for n, p in params.items()},
                        [{n: m.clone() for n, m in mr.items()} for mr in momenta]))
    return history


def script(rank, world_size, device="cpu", wrapper="plain", double_buffer=False):
    """The user's script; ``wrapper`` "ddp": the model in DDP with the votes
    at step() (attach(overlap=False)), which votes as a plain module does;
    ``double_buffer``: DistributedLion's second momentum buffers
    (lionbit.next_momenta)."""
    import lionbit

    net, extra = _model(device)
    extra.requires_grad_(False)
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    opt = lionbit.DistributedLion([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=LR,
                                  betas=BETAS, weight_decay=WD, double_buffer=double_buffer)
    model = net
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, find_unused_parameters=True)  # (a layer is frozen for two steps)
        opt.attach(model, overlap=False)
    want = simulate(world_size, device, layout_change=wrapper == "plain")
    names = dict(net.named_parameters(), extra=extra)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=10**6)
    replayed = []
    for step in range(STEPS):
        if step == FREEZE:
            net.layers[0].requires_grad_(False)
        if step == UNFREEZE:
            net.layers[0].requires_grad_(True)
        if step == ADD:
            extra.requires_grad_(True)
            opt.add_param_group({"params": [extra], "weight_decay": 0.0})
        if step == RESET:
            opt.state[net.layers[2].bias] = {}
        if step == PARAM_LAYOUT and wrapper == "plain":
            w = net.layers[2].weight
            w.data = w.data.t().contiguous().t()
            assert not w.is_contiguous() and w.grad.is_contiguous()
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.zero_grad(set_to_none=step < KEEP_GRADS)
        scaler.scale(_loss(model, extra, rank, step)).backward()
        if step == SKIP and rank == world_size - 1:
            net.layers[2].weight.grad[0, 0] = float("inf")
        if step == NONCONTIG:
            w = net.layers[2].weight
            w.grad = w.grad.t().contiguous().t()
            assert not w.grad.is_contiguous()
        before = opt.attachment.plan.replayed
        scaler.step(opt)
        scaler.update()
        if opt.attachment.plan.replayed > before:
            replayed.append(step)
        if step == RELOAD:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        params, momenta = want[step]
        for n, p in names.items():
            assert torch.equal(p.detach(), params[n]), f"step {step}: {n} differs from the simulation"
            if n in momenta[rank]:
                got = opt.state[p].get("exp_avg")
                assert got is not None and torch.equal(got, momenta[rank][n]), f"step {step}: {n}'s momentum"
    assert scaler.get_scale() == 2.0**9, "the scaler backed off once, on every rank"
    return replayed


@pytest.mark.parametrize("double_buffer", [False, True], ids=["", "double_buffer"])
@pytest.mark.parametrize("wrapper", ["plain", "ddp"])
def test_a_plain_modules_replayed_steps_equal_the_simulation(wrapper, double_buffer):
    res = values(run_ranks("test_step_plan:script", 2, kwargs={"wrapper": wrapper, "double_buffer": double_buffer}))
    assert res == [REPLAYED[wrapper]] * 2, res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("double_buffer", [False, True], ids=["", "double_buffer"])
@pytest.mark.parametrize("wrapper", ["plain", "ddp"])
def test_a_plain_modules_replayed_steps_equal_the_simulation_on_a_gpu(wrapper, double_buffer):
    """The same on one GPU (NCCL underneath, world size 1): the plan's calls
    of the GPU's list kernels, a launch per parameter group and dtype pair."""
    res = values(run_ranks("test_step_plan:script", 1,
                           kwargs={"device": "cuda", "wrapper": wrapper, "double_buffer": double_buffer}))
    assert res == [REPLAYED[wrapper]], res
