"""The sign collectives in torch.profiler, the way a user looks at a step:
profile a few training steps and read the table. Each call is a span named
after the collective ("lionbit:all_reduce_sign", "lionbit:reduce_scatter_sign")
on the caller's thread, and the worker's steps (pack, count, unpack) show in
the same trace."""


from harness import run_ranks, values
from test_fsdp import LION, _loss, _net, _shard


def _event_counts(prof):
    counts = {}
    for e in prof.events():
        counts[e.name] = counts.get(e.name, 0) + 1
    return counts


def profile_training(rank, world_size, steps, fsdp):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    import lionbit

    model = _shard(_net()) if fsdp else DDP(_net())
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    _loss(model, rank, 0).backward()  # warm-up step, not profiled
    opt.step()
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(1, steps + 1):
            _loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
    counts = _event_counts(prof)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=200)
    return {"counts": {k: v for k, v in counts.items() if "lionbit" in k}, "table_mentions": "lionbit:" in table}


def test_ddp_step_shows_the_sign_all_reduce_and_its_steps():
    steps = 3
    outs = values(run_ranks("test_profiler:profile_training", 2, kwargs={"steps": steps, "fsdp": False}))
    for rank, out in enumerate(outs):
        counts = out["counts"]
        assert counts.get("lionbit:all_reduce_sign", 0) >= steps, (rank, counts)
        assert "lionbit:reduce_scatter_sign" not in counts, (rank, counts)
        for span in ("lionbit::count", "lionbit::unpack"):
            assert counts.get(span, 0) >= steps, (rank, span, counts)
        assert out["table_mentions"], rank


def test_fsdp2_step_shows_the_sign_reduce_scatter():
    steps = 2
    outs = values(run_ranks("test_profiler:profile_training", 2, kwargs={"steps": steps, "fsdp": True}))
    for rank, out in enumerate(outs):
        counts = out["counts"]
        assert counts.get("lionbit:reduce_scatter_sign", 0) >= steps, (rank, counts)
        assert counts.get("lionbit::count", 0) >= steps, (rank, counts)
