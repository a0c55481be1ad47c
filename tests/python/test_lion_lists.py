"""DistributedLion's step over many tensors in one call on the CPU
(``_C.lion_direction_list``, ``_C.lion_apply_list``,
``_C.lion_apply_planes_list``): the fused kernels tensor by tensor in C++, so
that a model of hundreds of small tensors pays a few calls a step, not three
a tensor. Each call against plain torch in float32 one op at a time (the
contract of lionbit.lion_math), with neighbours sharing plane words, tensors
that fill whole words in place, mixed dtypes in one list and bits outside
the tensors left alone; bad lists are refused, naming the element, before
anything changes; a transformer-shaped model in bfloat16 trained on two
ranks equals the paper's rule computed independently; and the GPU branches
(a launch per dtype pair) run here on tensors that say they are on a GPU."""

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values
from lionbit import _C, lion_math

B1, B2, LR = 0.9, 0.99, 3e-3

# (gradient dtype, momentum dtype, elements, bit offset): end to end with gaps;
# the 64- and 128-element tensors start on a word and fill whole words (written
# in place), the others share words with their neighbours.
LAYOUT = [
    (torch.bfloat16, torch.bfloat16, 64, 0),
    (torch.float32, torch.float32, 7, 64),
    (torch.float16, torch.bfloat16, 53, 75),
    (torch.bfloat16, torch.float32, 128, 128),
    (torch.float32, torch.bfloat16, 0, 256),
    (torch.bfloat16, torch.bfloat16, 1029, 259),
    (torch.float16, torch.float32, 192, 1288),
    (torch.float32, torch.float32, 3, 1480),
]
PLANE_BITS = 1536


def _coefs(wd=0.1):
    return lion_math.Coefs({"betas": (B1, B2), "lr": LR, "weight_decay": wd})


def _f32(*vs):
    return [torch.tensor(v, dtype=torch.float32) for v in vs]


def _pairs(seed=0, nonfinite=True):
    gen = torch.Generator().manual_seed(seed)
    gs, ms = [], []
    for gdt, mdt, n, _ in LAYOUT:
        g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-6, 7, (n,), generator=gen).float())
        m = torch.randn(n, generator=gen)
        g[torch.randint(0, 5, (n,), generator=gen) == 0] = 0.0
        m[torch.randint(0, 5, (n,), generator=gen) == 0] = 0.0
        gs.append(g.to(gdt))
        ms.append(m.to(mdt))
    if nonfinite:
        gs[5][17], gs[5][900], ms[2][4] = float("inf"), float("nan"), float("-inf")
    return gs, ms


def _gap_planes():
    """Planes whose bits outside every tensor are 1 (they must stay so) and 0 inside."""
    inside = torch.zeros(PLANE_BITS, dtype=torch.bool)
    for _, _, n, off in LAYOUT:
        inside[off : off + n] = True
    bits = (~inside).to(torch.uint8).view(-1, 8)
    packed = (bits << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8)
    return packed.clone(), packed.clone()


def _bits_of(plane):
    return ((plane.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1).bool()


@pytest.mark.parametrize("update_momentum", [False, True])
def test_the_direction_list_is_torch_tensor_by_tensor(update_momentum):
    gs, ms = _pairs()
    sign, zero = _gap_planes()
    got_ms = [m.clone() for m in ms]
    offsets = [off for *_, off in LAYOUT]
    bad = _C.lion_direction_list(gs, got_ms, B1, 1 - B1, B2, 1 - B2, sign, zero, offsets, update_momentum)

    b1, omb1, b2, omb2 = _f32(B1, 1 - B1, B2, 1 - B2)
    want_sign, want_zero = (_bits_of(p) for p in _gap_planes())
    want_bad = 0
    for g, m, (_, _, n, off) in zip(gs, ms, LAYOUT):
        c = torch.add(torch.mul(m.float(), b1), torch.mul(g.float(), omb1))
        want_sign[off : off + n] = c > 0  # NaN: neither bit
        want_zero[off : off + n] = c == 0
        want_bad += int((~torch.isfinite(c)).sum())
    assert bad == want_bad == 3
    finite = torch.ones(PLANE_BITS, dtype=torch.bool)
    for g, m, (_, _, n, off) in zip(gs, ms, LAYOUT):
        finite[off : off + n] = torch.isfinite(torch.add(torch.mul(m.float(), b1), torch.mul(g.float(), omb1)))
    # A NaN direction's bits are the packers' business (the vote refuses it); every other bit is exact.
    assert torch.equal(_bits_of(sign)[finite], want_sign[finite])
    assert torch.equal(_bits_of(zero)[finite], want_zero[finite])
    for g, m, got in zip(gs, ms, got_ms):
        want = torch.add(torch.mul(m.float(), b2), torch.mul(g.float(), omb2)).to(m.dtype) if update_momentum else m
        same = (got == want) | (torch.isnan(got) & torch.isnan(want))
        assert bool(same.all()) and got.dtype == m.dtype


def test_the_direction_list_is_the_per_tensor_kernel_call_by_call():
    gs, ms = _pairs(seed=1)
    sign, zero = _gap_planes()
    ref_sign, ref_zero = _gap_planes()
    got_ms, ref_ms = [m.clone() for m in ms], [m.clone() for m in ms]
    bad = _C.lion_direction_list(gs, got_ms, B1, 1 - B1, B2, 1 - B2, sign, zero, [o for *_, o in LAYOUT], True)
    ref_bad = sum(
        _C.lion_direction_into(g, m, B1, 1 - B1, B2, 1 - B2, ref_sign, ref_zero, off, update_momentum=True)
        for g, m, (*_, off) in zip(gs, ref_ms, LAYOUT)
    )
    assert bad == ref_bad
    assert torch.equal(sign, ref_sign) and torch.equal(zero, ref_zero)
    for a, b in zip(got_ms, ref_ms):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_the_momentum_list_alone_needs_no_planes():
    gs, ms = _pairs(seed=2, nonfinite=False)
    got = [m.clone() for m in ms]
    assert _C.lion_direction_list(gs, got, B1, 1 - B1, B2, 1 - B2, None, None, [0] * len(gs), True) == 0
    b2, omb2 = _f32(B2, 1 - B2)
    for g, m, x in zip(gs, ms, got):
        assert torch.equal(x, torch.add(torch.mul(m.float(), b2), torch.mul(g.float(), omb2)).to(m.dtype))


def _apply_reference(x, delta, k):
    lr, decay = _f32(*k.values[4:])
    return torch.sub(torch.mul(x.float(), decay), torch.mul(delta.float(), lr)).to(x.dtype)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_apply_lists_are_torch_tensor_by_tensor(wd):
    k = _coefs(wd)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=gen).to(gdt) for gdt, _, n, _ in LAYOUT]
    deltas = [torch.randint(-1, 2, (n,), generator=gen).to(mdt) for _, mdt, n, _ in LAYOUT]
    got = [x.clone() for x in xs]
    _C.lion_apply_list(got, deltas, *k.values[4:])
    for x, d, y in zip(xs, deltas, got):
        assert torch.equal(y, _apply_reference(x, d, k))

    # The same Deltas as a vote's result planes (sign, then zero): +1, -1 or 0 (zero bit set).
    sign, zero = (torch.zeros(PLANE_BITS // 8, dtype=torch.uint8) for _ in range(2))
    sign_bits, zero_bits = _bits_of(sign), _bits_of(zero)
    for d, (_, _, n, off) in zip(deltas, LAYOUT):
        sign_bits[off : off + n], zero_bits[off : off + n] = d > 0, d == 0
    for plane, bits in ((sign, sign_bits), (zero, zero_bits)):
        plane.copy_((bits.view(-1, 8).to(torch.uint8) << torch.arange(8, dtype=torch.uint8)).sum(1, dtype=torch.uint8))
    got = [x.clone().view(2, -1) if x.numel() % 2 == 0 and x.numel() else x.clone() for x in xs]  # any shape
    _C.lion_apply_planes_list(got, sign, zero, [o for *_, o in LAYOUT], *k.values[4:])
    for x, d, y in zip(xs, deltas, got):
        assert torch.equal(y.reshape(-1), _apply_reference(x, d, k))


def test_bad_lists_name_the_element_and_change_nothing():
    gs, ms = _pairs(seed=4, nonfinite=False)
    sign, zero = _gap_planes()
    offsets = [o for *_, o in LAYOUT]
    args = (B1, 1 - B1, B2, 1 - B2)

    def refused(match, gs=gs, ms=ms, sign=sign, zero=zero, offsets=offsets, update=True):
        before = [m.clone() for m in ms]
        with pytest.raises(ValueError, match=match):
            _C.lion_direction_list(gs, ms, *args, sign, zero, offsets, update)
        assert all(torch.equal(a, b) for a, b in zip(before, ms)), "a momentum changed before the refusal"

    refused(r"lion_direction_list: gs\[6\] has 192 elements, ms\[6\] 191",
            ms=ms[:6] + [torch.zeros(191)] + ms[7:])
    refused(r"argument 'gs\[3\]' must be a contiguous float32, bfloat16 or float16 tensor",
            gs=gs[:3] + [torch.zeros(128, dtype=torch.int32)] + gs[4:])
    refused(r"argument 'ms\[5\]' must be a contiguous", ms=ms[:5] + [torch.zeros(2058)[::2]] + ms[6:])
    refused(r"ms\[1\] must be float32 or bfloat16, got Half", ms=ms[:1] + [ms[1].half()] + ms[2:])
    refused(r"negative bit_offsets\[2\]", offsets=offsets[:2] + [-1] + offsets[3:])
    refused(r"argument 'sign' must be .* holding at least 1544 bits", offsets=offsets[:-1] + [1541])
    refused(r"sign and zero are given together or not at all", zero=None)
    refused(r"8 gradients, 8 momenta and 7 bit offsets", offsets=offsets[1:])
    with pytest.raises(ValueError, match="without planes only the momentum update"):
        _C.lion_direction_list(gs, ms, *args, None, None, offsets, False)

    xs = [torch.zeros(n) for *_, n, _ in LAYOUT]
    with pytest.raises(ValueError, match=r"lion_apply_list: xs\[2\] has 53 elements, deltas\[2\] 52"):
        _C.lion_apply_list(xs, [torch.ones(n) for *_, n, _ in LAYOUT[:2]] + [torch.ones(52)]
                           + [torch.ones(n) for *_, n, _ in LAYOUT[3:]], LR, 1.0)
    assert all(int(x.count_nonzero()) == 0 for x in xs), "a parameter changed before the refusal"
    with pytest.raises(ValueError, match=r"lion_apply_planes_list: negative bit_offsets\[1\]"):
        _C.lion_apply_planes_list(xs[:2], sign, zero, [0, -64], LR, 1.0)
    with pytest.raises(ValueError, match=r"lion_apply: argument 'delta' must be a contiguous"):
        _C.lion_apply(xs[0], torch.zeros(64, dtype=torch.int64), LR, 1.0)


@pytest.mark.parametrize("update_momentum", [False, True])
def test_the_direction_list_takes_spans_as_it_takes_their_views(update_momentum):
    """FSDP's chunks of a parameter pass as (tensor, start, length), no view made each: the same
    bits at the same offsets as the views themselves, and only the span's momentum updated.
    Spans of one tensor in any order, empty ones, one whole, edges inside words."""
    gs, ms = _pairs(seed=7)
    cuts = [(5, 0, 1029), (5, 0, 0), (5, 700, 329), (5, 1, 699), (2, 0, 53), (6, 64, 128), (6, 0, 64), (7, 1, 2)]
    offsets, off = [], 3
    for _, _, n in cuts:
        offsets.append(off)
        off += n + 5
    nbytes = lion_math.plane_bytes(off)
    args = (B1, 1 - B1, B2, 1 - B2)
    if update_momentum:  # spans of the momentum update must not overlap: one tensor's, end to end
        cuts = [(5, 0, 1), (5, 1, 699), (5, 700, 0), (5, 700, 329)]
        offsets = offsets[: len(cuts)]
    got = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
    want = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
    got_ms, want_ms = [m.clone() for m in ms], [m.clone() for m in ms]
    bad = _C.lion_direction_list([gs[i] for i, _, _ in cuts], [got_ms[i] for i, _, _ in cuts], *args, *got, offsets,
                                 update_momentum, starts=[a for _, a, _ in cuts], lengths=[n for *_, n in cuts])
    want_bad = _C.lion_direction_list([gs[i][a : a + n] for i, a, n in cuts],
                                      [want_ms[i][a : a + n] for i, a, n in cuts], *args, *want, offsets,
                                      update_momentum)
    assert bad == want_bad and bad > 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got_ms, want_ms):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert update_momentum == any(not torch.equal(a.view(torch.uint8), m.view(torch.uint8))
                                  for a, m in zip(got_ms, ms))

    def refused(match, **kw):
        before = [m.clone() for m in got_ms]
        with pytest.raises(ValueError, match=match):
            _C.lion_direction_list(gs[:2], got_ms[:2], *args, *got, [0, 64], True, **kw)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, got_ms)), \
            "a momentum changed before the refusal"

    refused(r"elements \[60, 60 \+ 5\) of gs\[0\] \(64 elements\) are out of range", starts=[60, 0], lengths=[5, 7])
    refused(r"elements \[-1, -1 \+ 1\) of gs\[1\]", starts=[0, -1], lengths=[64, 1])
    refused(r"elements \[0, 0 \+ -2\) of gs\[1\]", starts=[0, 0], lengths=[64, -2])
    refused("starts and lengths are given together or not at all", starts=[0, 0])
    refused("2 entries of 'gs', 1 starts and 1 lengths", starts=[0], lengths=[1])


# -- a user's training script -------------------------------------------------------

VOCAB, WIDTH, CONTEXT, LAYERS = 96, 32, 16, 2


def _transformer():
    """A GPT-shaped model: embeddings, per-block LayerNorms, qkv / proj / MLP
    matrices with biases; 4 + 12 per block tensors, most of them small."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
            self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
            self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, h):
            q, k, v = self.qkv(self.ln_1(h)).chunk(3, dim=-1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.proj(a)
            return h + self.down(torch.nn.functional.gelu(self.up(self.ln_2(h))))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Embedding(CONTEXT, WIDTH)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f = torch.nn.LayerNorm(WIDTH)

        def forward(self, idx):
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                h = block(h)
            return self.ln_f(h).float() @ self.wte.weight.float().t()  # the head tied to the embedding

    model = GPT().to(torch.bfloat16)
    model.ln_f.float()  # a final norm kept in float32: the lists hold two dtypes
    return model


def _param_groups(model):
    """nanoGPT's recipe: weight decay for matrices, none for biases, norms and embeddings' positions."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "wpe.weight"]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "wpe.weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-3}]


def _tokens(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)


def train_a_transformer(rank, world_size, steps=6):
    """The script: bf16 model, bf16 momentum, decay / no-decay groups,
    zero_grad(set_to_none=True), clipping; beside it the paper's rule on every
    rank's gradients (gathered after clipping: what step() sees)."""
    import lionbit

    model = _transformer()
    groups = _param_groups(model)
    opt = lionbit.DistributedLion(groups, lr=3e-3, betas=(B1, B2), momentum_dtype=torch.bfloat16)
    ref_x = [p.detach().clone() for g in groups for p in g["params"]]
    ref_m = [[torch.zeros_like(x) for x in ref_x] for _ in range(world_size)]
    hyper = [(g.get("lr", 3e-3), g["weight_decay"]) for g in groups for _ in g["params"]]
    b1, omb1, b2, omb2 = _f32(B1, 1 - B1, B2, 1 - B2)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        idx = _tokens(rank, step)
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        params = [p for g in groups for p in g["params"]]
        grads = []
        for p in params:
            parts = [torch.empty_like(p.grad) for _ in range(world_size)]
            dist.all_gather(parts, p.grad.contiguous())
            grads.append(parts)
        opt.step()
        for i, (x, (lr, wd)) in enumerate(zip(ref_x, hyper)):
            votes = torch.zeros(x.shape)
            for r in range(world_size):
                g, m = grads[i][r].float(), ref_m[r][i].float()
                votes += torch.sign(torch.add(torch.mul(m, b1), torch.mul(g, omb1)))
                ref_m[r][i] = torch.add(torch.mul(m, b2), torch.mul(g, omb2)).to(torch.bfloat16)
            clr, decay = _f32(lr, 1.0 - lr * wd)
            ref_x[i] = torch.sub(torch.mul(x.float(), decay), torch.mul(torch.sign(votes), clr)).to(x.dtype)
        for i, p in enumerate(params):
            assert torch.equal(p.detach(), ref_x[i]), f"step {step}: parameter {i} ({tuple(p.shape)}) differs"
            assert torch.equal(opt.state[p]["exp_avg"], ref_m[rank][i]), f"step {step}: momentum {i} differs"
    return sum(p.numel() for p in model.parameters()), len(list(model.parameters()))


def test_a_transformer_in_bfloat16_steps_as_the_papers_rule():
    numel, tensors = values(run_ranks("test_lion_lists:train_a_transformer", 2))[0]
    assert tensors == 4 + 12 * LAYERS and numel > 20_000


class _Calls:
    """lionbit._C with every call counted by name."""

    def __init__(self, real):
        self.real, self.counts = real, {}

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if not callable(fn):
            return fn

        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted


def test_a_step_of_many_tensors_is_a_few_calls_not_three_a_tensor(monkeypatch):
    """No process group: a plain single-process loop of the transformer
    (28 tensors in two parameter groups of two dtypes each)."""
    import lionbit

    model = _transformer()
    opt = lionbit.DistributedLion(_param_groups(model), lr=3e-3)
    calls = _Calls(lion_math._C)
    monkeypatch.setattr(lion_math, "_C", calls)
    for step in range(2):
        opt.zero_grad()
        idx = _tokens(0, step)
        torch.nn.functional.cross_entropy(model(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        opt.step()
    per_step = {name: n / 2 for name, n in calls.counts.items()}
    # Per group a step: the directions' pack, the momentum update and the apply.
    assert per_step == {"lion_direction_list": 4, "lion_apply_list": 2}, per_step


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU: the GPU branches of lionbit.lion_math run on it
    without one, against kernels that stand in for the device's (the CPU lists, checked above)."""

    @property
    def is_cuda(self):
        return True


class _DeviceLists:
    """lionbit._C with the GPU's list kernels replaced by the CPU's, every call recorded."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    @staticmethod
    def _plain(ts):
        assert all(type(t) is _OnGpu for t in ts), "a tensor lost its device on the way"
        return [t.as_subclass(torch.Tensor) for t in ts]

    def lion_direction_list_device(self, gs, ms, b1, omb1, b2, omb2, sign, zero, counts, bit_offsets,
                                   update_momentum, starts=None, lengths=None, m_outs=None):
        assert len({(g.dtype, m.dtype) for g, m in zip(gs, ms)}) == 1, "one dtype pair a launch"
        self.calls.append(("direction", gs[0].dtype, ms[0].dtype, len(gs), update_momentum))
        bad = self.real.lion_direction_list(self._plain(gs), self._plain(ms), b1, omb1, b2, omb2, sign, zero,
                                            bit_offsets, update_momentum, starts=starts, lengths=lengths,
                                            m_outs=None if m_outs is None else self._plain(m_outs))
        if counts is not None:
            counts[1] += bad

    def lion_apply_list_device(self, xs, deltas, lr, decay):
        assert len({(x.dtype, d.dtype) for x, d in zip(xs, deltas)}) == 1, "one dtype pair a launch"
        self.calls.append(("apply", xs[0].dtype, deltas[0].dtype, len(xs)))
        self.real.lion_apply_list(self._plain(xs), self._plain(deltas), lr, decay)

    def lion_apply_planes_list_device(self, xs, sign, zero, bit_offsets, lr, decay, starts=None, lengths=None):
        assert len({x.dtype for x in xs}) == 1, "one parameter dtype a launch"
        self.calls.append(("apply_planes", xs[0].dtype, id(sign), len(xs)))
        self.real.lion_apply_planes_list(self._plain(xs), sign, zero, bit_offsets, lr, decay, starts=starts,
                                         lengths=lengths)


def test_the_gpu_branches_launch_once_a_dtype_pair_and_match_the_cpu(monkeypatch):
    """What runs only on a GPU (a launch per dtype pair, the tallies in a device
    buffer) checked here, so that a GPU session finds it right."""
    k = _coefs()
    gs, ms = _pairs(seed=5)
    offsets = [o for *_, o in LAYOUT]
    want_sign, want_zero = _gap_planes()
    want_ms = [m.clone() for m in ms]
    want_bad = _C.lion_direction_list(gs, want_ms, *k.values[:4], want_sign, want_zero, offsets, False)

    fake = _DeviceLists(_C)
    monkeypatch.setattr(lion_math, "_C", fake)
    on_gpu = [t.clone().as_subclass(_OnGpu) for t in gs], [t.clone().as_subclass(_OnGpu) for t in ms]
    sign, zero = _gap_planes()
    counts = torch.zeros(2, dtype=torch.int64)
    items = [(g, m, off, 0, g.numel()) for g, m, off in zip(*on_gpu, offsets)]
    assert lion_math.pack_directions_list(items, k, sign, zero, counts) == 0
    assert int(counts[1]) == want_bad and torch.equal(sign, want_sign) and torch.equal(zero, want_zero)
    pairs = {(gdt, mdt) for gdt, mdt, _, _ in LAYOUT}
    assert {c[1:3] for c in fake.calls} == pairs and len(fake.calls) == len(pairs), fake.calls
    assert all(not c[4] for c in fake.calls)

    # What DDP's hook and a step's votes call: the count stays in a device tally
    # (the vote reads it when it runs), never read here.
    from lionbit import step_vote

    sign, zero = _gap_planes()
    bad, tally = step_vote.pack_directions([(g, m, k, True, off, a, n) for g, m, off, a, n in items], sign, zero)
    assert bad == 0 and tally.dtype == torch.int64 and tally.shape == (1,), (bad, tally)
    assert int(tally) == want_bad and torch.equal(sign, want_sign) and torch.equal(zero, want_zero)

    fake.calls.clear()
    lion_math.update_momenta(list(zip(*on_gpu)), k)
    assert len(fake.calls) == len(pairs) and all(c[4] for c in fake.calls)
    for g, m, got in zip(gs, ms, on_gpu[1]):
        want = m.clone()
        _C.lion_direction_list([g], [want], *k.values[:4], None, None, [0], True)
        assert torch.equal(got.as_subclass(torch.Tensor).view(torch.uint8), want.view(torch.uint8))

    fake.calls.clear()
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, generator=gen).to(gdt) for gdt, _, n, _ in LAYOUT]
    deltas = [torch.randint(-1, 2, (n,), generator=gen).to(torch.bfloat16) for *_, n, _ in LAYOUT]
    got = [x.clone().as_subclass(_OnGpu) for x in xs]
    lion_math.apply_updates(list(zip(got, [d.as_subclass(_OnGpu) for d in deltas])), k)
    assert len(fake.calls) == len({gdt for gdt, *_ in LAYOUT}), fake.calls
    for x, d, y in zip(xs, deltas, got):
        assert torch.equal(y.as_subclass(torch.Tensor), _apply_reference(x, d, k))

    # Delta as two votes' result planes (a step's votes on a GPU): a launch per
    # vote and parameter dtype, beside a tensor whose Delta is values.
    fake.calls.clear()
    votes = [torch.randint(0, 256, (2 * lion_math.plane_bytes(2000),), generator=gen, dtype=torch.uint8)
             for _ in range(2)]
    planes = [lion_math.delta_views(v, True) for v in votes]
    spans, at = [], [0, 0]
    for i, (_, _, n, _) in enumerate(LAYOUT):
        spans.append((i % 2, at[i % 2], n))
        at[i % 2] += n
    got = [x.clone().as_subclass(_OnGpu) for x in xs]
    items = [(y, planes[v](off, n)) for y, (v, off, n) in zip(got, spans)]
    items[0] = (got[0], deltas[0].as_subclass(_OnGpu))
    lion_math.apply_updates(items, k)
    launches = {(c[1], c[2]) for c in fake.calls if c[0] == "apply_planes"}
    want = {(x.dtype, id(planes[v](0, 1).sign)) for x, (v, _, _) in list(zip(xs, spans))[1:]}
    assert launches == want and len(fake.calls) == len(want) + 1, fake.calls
    for i, (x, y) in enumerate(zip(xs, got)):
        d = deltas[0] if i == 0 else planes[spans[i][0]](spans[i][1], spans[i][2]).values()
        assert torch.equal(y.as_subclass(torch.Tensor), _apply_reference(x, d, k)), i


def test_ddps_step_reads_its_buckets_device_tallies_in_one_round_trip():
    """On a GPU each DDP bucket's pack leaves its non-finite count in a device
    tally; step()'s agreement needs their sum on the host: one read (a host
    sync) a step, not one a bucket. Reads counted as ATen's scalar reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lionbit import ddp

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    votes = []
    for bad, tally in ((1, None), (0, torch.tensor([3])), (2, torch.tensor([0])), (0, torch.tensor([4]))):
        bv = ddp._BucketVote()
        bv.bad, bv.tally = bad, tally
        votes.append(bv)
    with Reads() as reads:
        assert ddp._nonfinite(votes) == 10
    assert reads.n == 1
    assert ddp._nonfinite(votes[:2]) == 4 and ddp._nonfinite(votes[:1]) == 1 and ddp._nonfinite([]) == 0


def test_without_the_list_calls_the_per_tensor_kernels_give_the_same_bits(monkeypatch):
    """Where the list kernels may not run (on a GPU whose list check failed),
    the step falls back to the fused kernels tensor by tensor, which make their
    own scratch planes: the same parameters and momenta, bit for bit."""
    import lionbit
    from lionbit import kernel_choice

    def train(lists: bool):
        model = _transformer()
        opt = lionbit.DistributedLion(_param_groups(model), lr=3e-3, momentum_dtype=torch.bfloat16)
        calls = _Calls(lion_math._C)
        with monkeypatch.context() as m:
            m.setattr(lion_math, "_C", calls)
            if not lists:
                m.setattr(kernel_choice, "list_kernels_allowed", lambda device: False)
            for step in range(3):
                opt.zero_grad()
                idx = _tokens(0, step)
                logits = model(idx[:, :-1]).reshape(-1, VOCAB)
                torch.nn.functional.cross_entropy(logits, idx[:, 1:].reshape(-1)).backward()
                opt.step()
        momenta = [s["exp_avg"].clone() for s in opt.state.values()]
        return [p.detach().clone() for p in model.parameters()], momenta, calls

    xs, ms, with_lists = train(True)
    ys, ns, per_tensor = train(False)
    assert "lion_direction_into" not in with_lists.counts and per_tensor.counts["lion_direction_into"] == 2 * 28 * 3
    assert all(torch.equal(a, b) for a, b in zip(xs, ys)) and all(torch.equal(a, b) for a, b in zip(ms, ns))
