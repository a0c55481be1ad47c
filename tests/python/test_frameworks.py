"""DistributedLion inside the frameworks that wrap the model in DDP for you:
PyTorch Lightning (``Trainer(strategy=DDPStrategy(process_group_backend=
"lionbit"))``) and Lightning Fabric, Hugging Face ``transformers.Trainer``
and ``accelerate.Accelerator``, each on 2 CPU ranks as torchrun's workers
(torchrun_env.py: its environment, the ranks forked), written the
way the README tells a user to (gradient clipping at 1.0 included: HF's
default ``max_grad_norm``).

Each run trains a small MLP on seeded synthetic regression data for STEPS
steps and each rank reports: the held-out loss before and after, a hash of
its parameters, ``lionbit.stats()``, a hash of its gradients at the first
step, and every all-reduce dispatched during training. The checks:

- the loss falls about as far as single-process Lion's (same model, data,
  global batch and steps, run in the test process);
- the replicas are bitwise identical at the end;
- lionbit's sign path ran (``sign_allreduce_calls``);
- no gradient all-reduce ran: no all-reduce of more than 16 elements reached
  the process group (a Python kernel on the ``c10d::allreduce_`` operator at
  the AutogradCPU key sees DDP's bucket all-reduces, which the reducer issues
  from C++), and the gradients the optimizer saw differ across ranks (DDP's
  all-reduce would have averaged them). ``test_unattached_ddp_is_caught``
  shows both checks fail where DDP does all-reduce (no ``attach``).

Each test skips, saying what to install, when its framework is missing
(``pip install lightning transformers accelerate``).
"""

import functools
import hashlib
import json
import os
import sys
import tempfile

import pytest
import torch

import torchrun_env

HERE = os.path.dirname(os.path.abspath(__file__))

DIM, HIDDEN = 8, 32
N_TRAIN, N_EVAL = 4096, 512
BATCH = 32  # per rank; the single-process reference uses 2 * BATCH
STEPS = 40
LR, WD = 0.01, 0.01
MAX_NORM = 1.0
BIG = 16  # an all-reduce of more elements than this during training is a gradient all-reduce
NPROC = 2
TIMEOUT = 150


# -- model and data: the same in every rank and in the reference ----------------


def _data():
    g = torch.Generator().manual_seed(1234)
    a = torch.randn(DIM, 16, generator=g) / DIM**0.5
    b = torch.randn(16, 1, generator=g) / 2
    x = torch.randn(N_TRAIN + N_EVAL, DIM, generator=g)
    y = torch.tanh(x @ a) @ b + 0.01 * torch.randn(N_TRAIN + N_EVAL, 1, generator=g)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


class Net(torch.nn.Module):
    """Returns the output, or HF-style {"loss", "logits"} when given labels."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
            torch.nn.Linear(HIDDEN, 1),
        )

    def forward(self, x, labels=None):
        out = self.body(x)
        if labels is None:
            return out
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _net():
    torch.manual_seed(0)
    return Net()


class _Dataset(torch.utils.data.Dataset):
    def __init__(self):
        (self.x, self.y), _ = _data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


@torch.no_grad()
def _eval_loss(model):
    _, (x, y) = _data()
    return torch.nn.functional.mse_loss(model(x), y).item()


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


# -- inside each rank -------------------------------------------------------------

_ALLREDUCES = {"on": False, "big": [], "small": 0}
_LIBS = []


def _log_allreduces():
    """Records every all-reduce dispatched while _ALLREDUCES["on"]: DDP's
    reducer calls c10d::allreduce_ from C++, through the dispatcher, so a
    Python kernel at AutogradCPU (above the CPU kernel, where these ops have
    none) sees it, then hands the call on unchanged."""
    lib = torch.library.Library("c10d", "IMPL")
    _LIBS.append(lib)  # a Library unregisters its kernels when collected
    for name in ("allreduce_", "allreduce_coalesced_"):
        overload = getattr(torch.ops.c10d, name).default

        def kernel(*args, _overload=overload, _name=name, **kwargs):
            if _ALLREDUCES["on"]:
                n = sum(t.numel() for t in args[0])
                if n > BIG:
                    _ALLREDUCES["big"].append([_name, n])
                else:
                    _ALLREDUCES["small"] += 1
            with torch._C._AutoDispatchBelowAutograd():
                return _overload(*args, **kwargs)

        lib.impl(name, kernel, "AutogradCPU")


class _Logging:
    def __enter__(self):
        _ALLREDUCES["on"] = True

    def __exit__(self, *exc):
        _ALLREDUCES["on"] = False


def _lightning(rec, attach, outdir, precision="32-true"):
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import lionbit

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            loss = self.net(batch["x"], batch["labels"])["loss"]
            # The epoch's mean over the ranks: an AVG all-reduce, of an integer batch count too.
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def on_before_optimizer_step(self, optimizer):  # after backward, before clipping
            rec.setdefault("first_grads", _digest(p.grad for p in self.parameters()))

        def configure_optimizers(self):
            # The README recipe: Lightning has wrapped the model in DDP by now.
            opt = lionbit.DistributedLion(self.parameters(), lr=LR, weight_decay=WD)
            rec["wrapped"] = type(self.trainer.model).__name__
            return opt.attach(self.trainer.model, overlap=False) if attach else opt

    module = Module()
    rec["start"] = _eval_loss(module.net)
    trainer = L.Trainer(
        strategy=DDPStrategy(process_group_backend="lionbit"), accelerator="cpu", devices=NPROC,
        max_steps=STEPS, gradient_clip_val=MAX_NORM, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=outdir,
    )
    loader = torch.utils.data.DataLoader(_Dataset(), batch_size=BATCH, shuffle=True)
    with _Logging():
        trainer.fit(module, loader)
    return module.net


def _hf_trainer(rec, attach, outdir):
    import torch.distributed as dist
    import transformers

    import lionbit
    from lionbit.integrations import HFAttachCallback

    # The README recipe: the group first (TrainingArguments(ddp_backend="lionbit")
    # is refused on CPU by accelerate), use_cpu=True (else accelerate sets up no DDP on CPU).
    dist.init_process_group("lionbit")
    args = transformers.TrainingArguments(
        output_dir=outdir, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=STEPS,
        learning_rate=LR, weight_decay=WD, lr_scheduler_type="constant",  # max_grad_norm: 1.0 by default
        save_strategy="no", report_to="none", logging_steps=10, disable_tqdm=True, seed=0,
    )
    assert args.max_grad_norm == MAX_NORM
    model = _net()
    rec["start"] = _eval_loss(model)

    class Probe(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            rec.setdefault("first_grads", _digest(p.grad for p in model.parameters()))

    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_Dataset(),
        optimizer_cls_and_kwargs=(lionbit.DistributedLion, {"lr": LR}), callbacks=[Probe()],
    )
    if attach:
        trainer.add_callback(HFAttachCallback(trainer))
    with _Logging():
        trainer.train()
    rec["wrapped"] = type(trainer.model_wrapped).__name__
    return model


def _accelerate(rec, attach, outdir):
    import accelerate
    import torch.distributed as dist

    import lionbit

    # The README recipe: the group first (on CPU accelerate would create a
    # gloo group), Accelerator(cpu=True) (else no DDP on CPU), attach the
    # optimizer you made to the model prepare() returned. (The unattached
    # run follows the attached one in the same processes.)
    if not dist.is_initialized():
        dist.init_process_group("lionbit")
    accelerator = accelerate.Accelerator(cpu=True)
    model = _net()
    rec["start"] = _eval_loss(model)
    lion = lionbit.DistributedLion(model.parameters(), lr=LR, weight_decay=WD)
    loader = torch.utils.data.DataLoader(_Dataset(), batch_size=BATCH, shuffle=True)
    model, opt, loader = accelerator.prepare(model, lion, loader)
    rec["wrapped"] = type(model).__name__
    if attach:
        lion.attach(model, overlap=False)
    _steps(rec, model, opt, loader, accelerator.backward,
           lambda: accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
    return accelerator.unwrap_model(model)


def _steps(rec, model, opt, loader, backward, clip):
    """The recipes' loop: STEPS steps, the loader started again as often as
    needed, the gradients clipped (``clip()``) between backward and step()."""
    step = 0
    with _Logging():
        while step < STEPS:
            for batch in loader:
                backward(model(batch["x"], batch["labels"])["loss"])
                rec.setdefault("first_grads", _digest(p.grad for p in model.parameters()))
                clip()
                opt.step()
                opt.zero_grad()
                step += 1
                if step == STEPS:
                    break


def _fabric(rec, attach, outdir):
    import lightning as L
    from lightning.fabric.strategies import DDPStrategy

    import lionbit

    # The README recipe: attach the optimizer you created (not the wrapper
    # setup() returns, which refuses) to the model setup() returns.
    fabric = L.Fabric(accelerator="cpu", devices=NPROC, strategy=DDPStrategy(process_group_backend="lionbit"))
    fabric.launch()
    model = _net()
    rec["start"] = _eval_loss(model)
    lion = lionbit.DistributedLion(model.parameters(), lr=LR, weight_decay=WD)
    model, opt = fabric.setup(model, lion)
    if attach:
        try:
            opt.attach(model, overlap=False)
        except TypeError as e:
            rec["wrapper_refused"] = str(e)
        lion.attach(model, overlap=False)
        rec["wrapped"] = type(lion.attachment.model).__name__  # the DDP model inside Fabric's wrapper
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_Dataset(), batch_size=BATCH, shuffle=True))
    _steps(rec, model, opt, loader, fabric.backward, lambda: fabric.clip_gradients(model, opt, max_norm=MAX_NORM))
    return model.module


def _rank_main(framework, outdir, modes):
    """Runs the framework's loop once per mode ("attach" or "none"), one
    after another in this process, and writes rank<r>.<mode>.json each."""
    for mode in modes:
        _rank_run(framework, outdir, mode)


def _rank_run(framework, outdir, mode):
    import torch.distributed as dist

    import lionbit

    if not _LIBS:
        _log_allreduces()
    _ALLREDUCES.update(big=[], small=0)
    if dist.is_initialized():
        lionbit.reset_stats()
    rec = {}
    extra = {"precision": "bf16-mixed"} if mode == "attach_bf16" else {}
    loops = {"lightning": _lightning, "hf_trainer": _hf_trainer, "accelerate": _accelerate, "fabric": _fabric}
    model = loops[framework](rec, mode.startswith("attach"), outdir, **extra)
    rec.update(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
        end=_eval_loss(model),
        params=_digest(model.parameters()),
        stats=lionbit.stats(),
        big_allreduces=_ALLREDUCES["big"],
        small_allreduces=_ALLREDUCES["small"],
    )
    with open(os.path.join(outdir, f"rank{rec['rank']}.{mode}.json"), "w") as f:
        json.dump(rec, f)


# -- the tests ------------------------------------------------------------------


def _torchrun(framework, modes=("attach",)):
    """One launch of NPROC ranks with torchrun's worker environment
    (torchrun_env.py: what the frameworks read to find they are under
    torchrun, TORCHELASTIC_RUN_ID included) that runs the framework's loop
    for each mode in turn; returns ({mode: every rank's record}, output)."""
    with tempfile.TemporaryDirectory(prefix="lionbit-fw-") as outdir:
        out = torchrun_env.run(os.path.abspath(__file__), framework, outdir, ",".join(modes), ranks=NPROC,
                               env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, cwd=outdir,
                               timeout=TIMEOUT)
        res = {}
        for mode in modes:
            res[mode] = []
            for r in range(NPROC):
                with open(os.path.join(outdir, f"rank{r}.{mode}.json")) as f:
                    res[mode].append(json.load(f))
        return res, out


@functools.lru_cache(maxsize=None)
def _reference():
    """Single-process Lion (DistributedLion without a process group) on the
    same model, data, global batch, clipping and steps."""
    import lionbit

    model = _net()
    start = _eval_loss(model)
    opt = lionbit.DistributedLion(model.parameters(), lr=LR, weight_decay=WD)
    loader = torch.utils.data.DataLoader(
        _Dataset(), batch_size=NPROC * BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    step = 0
    while step < STEPS:
        for batch in loader:
            model(batch["x"], batch["labels"])["loss"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
            step += 1
            if step == STEPS:
                break
    end = _eval_loss(model)
    assert end < 0.2 * start, (start, end)  # the task is learnable at these settings
    return {"start": start, "end": end}


def _check(res, out):
    reference = _reference()
    where = f"\n{json.dumps(res, indent=1)}\n--- output ---\n{out[-3000:]}"
    assert [r["rank"] for r in res] == list(range(NPROC)) and all(r["world_size"] == NPROC for r in res), where
    assert all(r["backend"] == "lionbit" for r in res), where
    assert all(r["wrapped"] == "DistributedDataParallel" for r in res), where
    # Replicas identical, from the same start.
    assert len({r["params"] for r in res}) == 1, "replicas differ at the end" + where
    assert len({r["start"] for r in res}) == 1, where
    # The loss falls about as far as single-process Lion's.
    start, end = res[0]["start"], res[0]["end"]
    assert start == pytest.approx(reference["start"]), where
    assert start - end >= 0.8 * (reference["start"] - reference["end"]), (
        f"loss {start:.4f} -> {end:.4f}; single-process Lion {reference['start']:.4f} -> {reference['end']:.4f}" + where
    )
    # lionbit's sign path voted every step...
    assert all(r["stats"]["sign_allreduce_calls"] >= STEPS for r in res), where
    # ...and no gradient was all-reduced.
    assert all(r["big_allreduces"] == [] for r in res), "fp32 gradient all-reduces ran" + where
    assert len({r["first_grads"] for r in res}) == NPROC, "the ranks' gradients were averaged" + where


def test_lightning():
    """Also with precision="bf16-mixed": Lightning refuses to clip for an
    optimizer that says it unscales in its step (_step_supports_amp_scaling),
    bf16 or not; DistributedLion says so to torch's GradScaler only."""
    pytest.importorskip("lightning")
    res, out = _torchrun("lightning", modes=("attach", "attach_bf16"))
    _check(res["attach"], out)
    _check(res["attach_bf16"], out)


def test_fabric():
    """Lightning Fabric wraps the DDP model in a module of its own and the
    optimizer in a subclass that reads the optimizer's state: attach sees
    through the first; on the second it refuses, naming the fix."""
    pytest.importorskip("lightning")
    res, out = _torchrun("fabric")
    _check(res["attach"], out)
    for r in res["attach"]:
        said = r.get("wrapper_refused", "")
        assert "FabricDistributedLion, a framework's wrapper of the optimizer" in said, r


def test_hf_trainer():
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    res, out = _torchrun("hf_trainer")
    _check(res["attach"], out)


@functools.lru_cache(maxsize=None)
def _accelerate_runs():
    """The accelerate loop with attach, then without, in one launch (the
    ranks' start is most of a launch's time)."""
    return _torchrun("accelerate", modes=("attach", "none"))


def test_accelerate():
    pytest.importorskip("accelerate")
    res, out = _accelerate_runs()
    _check(res["attach"], out)


def test_unattached_ddp_is_caught():
    """The checks above see DDP's gradient all-reduce where it runs: the same
    accelerate loop without attach all-reduces every step's gradients."""
    pytest.importorskip("accelerate")
    res, out = _accelerate_runs()
    res = res["none"]
    where = f"\n{json.dumps(res, indent=1)}"
    assert all(len(r["big_allreduces"]) >= STEPS for r in res), where
    assert len({r["first_grads"] for r in res}) == 1, where
    assert len({r["params"] for r in res}) == 1, where


if __name__ == "__main__":  # one rank, started by _torchrun
    _rank_main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
