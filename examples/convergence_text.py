"""Training quality on text: a small byte-level causal transformer language
model, trained with the levers experiment's variants (DistributedLion vote,
its Lion Cub options, avg; single-process Lion and AdamW on the same global
batch), on text that ships with Python itself (no download).

    torchrun --standalone --nproc-per-node 4 examples/convergence_text.py
    torchrun --standalone --nproc-per-node 8 examples/convergence_text.py \\
        --variants vote,vote_alt,avg,l1_p4,l1_p8,vote_ms10,vote_ms100 --batch 64 --seeds 0,1,2 --json out.json
    python examples/convergence_text.py --tune --batch 16      # the lr search (validation split only)

The default runs vote, avg, Lion and AdamW at global batch 16 for 200 steps,
seeds 0-2 (a cell of the levers grid): about 10 s per distributed run at
N = 4 (20 s at N = 8) on a 2-core machine shared with other jobs.

Corpus: pydoc_data/topics.py of the standard library (the Python reference
manual's topics that help() shows: 79 topics of English prose, grammar and
code examples, reStructuredText rendered as plain text). Under CPython
3.11.7 (the venv's): 465,126 characters, 466,273 UTF-8 bytes, the file
itself 757,011 bytes; the topics are joined in sorted order with blank lines
between them (sha256 of the bytes in CORPUS_SHA256; another Python version
ships other text, and the JSON records what was used).

Splits, fixed: the bytes cut into 4,096-byte blocks; block i goes to
validation if i % 10 == 8, to test if i % 10 == 9, else to training
(376,161 / 45,056 / 45,056 bytes). Tuning (--tune) sees the training and
validation blocks only; the final table is on the test blocks.

Model: byte-level (vocab 256) causal transformer, context 32 bytes, d_model
64, 2 pre-norm layers, 4 heads, ffn 128, learned positions, untied output
head (102,144 parameters). Every run of a seed starts from the same weights
and sees the same sequence of global batches (random 33-byte windows of the
training blocks); the distributed runs split each global batch across
the ranks (DDP + DistributedLion.attach), the single-process runs see all of
it. Schedule: linear warm-up over 5 % of the steps, then cosine decay to 0,
per step. Metric: test loss in bits per byte (cross-entropy / ln 2, every
test byte predicted once, from the windows of 32 bytes that tile the test
blocks), mean and spread over the seeds.

The run loop, the variant table and the JSON are examples/convergence_digits.py's
(run_levers, VARIANTS); the protocol is docs/convergence_protocol.md ("The
levers experiment").
"""

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence_digits as cd  # noqa: E402

CORPUS_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"  # CPython 3.11.7
BLOCK = 4096
MODEL = dict(ctx=32, d_model=64, layers=2, heads=4, ffn=128)
BATCH = 16  # global batch, sequences (split across ranks)
STEPS = 200
WARMUP = 0.05

# The lr search (--tune, validation split): the same budget for both, 4 lrs,
# Lion's grid 3.3x below AdamW's (the Lion paper's advice), weight decay fixed
# (10x larger for Lion, which makes lr x wd alike).
GRIDS = {
    "lion": dict(lr=[3e-4, 1e-3, 3e-3, 1e-2], betas=(0.9, 0.99), weight_decay=0.1),
    "adamw": dict(lr=[1e-3, 3e-3, 1e-2, 3e-2], betas=(0.9, 0.999), weight_decay=0.01),
}
TUNE_SEEDS = (0, 1)

# Lion's and AdamW's configs per (global batch, steps), from --tune; every
# Lion-family variant runs with Lion's. Mean validation bits per byte, seeds
# 0-1: batch 16, Lion 3.484 (lr 3e-3), AdamW 3.396 (lr 1e-2); batch 64, Lion
# 3.370 (lr 3e-3), AdamW 3.190 (lr 1e-2); all interior (grids in
# docs/convergence.md). A (batch, steps) not listed falls back to the grids'
# centres and the JSON says so.
TUNED = {
    (16, 200): dict(lion=dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
                    adamw=dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)),
    (64, 200): dict(lion=dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1),
                    adamw=dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)),
}
FALLBACK = dict(lion=dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1),
                adamw=dict(lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01))


def corpus_bytes():
    """The corpus as bytes: every pydoc topic, in sorted order, blank lines between."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def splits():
    """(train, validation, test) as 1-D int64 tensors of byte values."""
    raw = corpus_bytes()
    blocks = [raw[i : i + BLOCK] for i in range(0, len(raw), BLOCK)]
    part = {8: "val", 9: "test"}
    out = {"train": [], "val": [], "test": []}
    for i, b in enumerate(blocks):
        out[part.get(i % 10, "train")].append(b)
    as_tensor = lambda bs: torch.tensor(list(b"".join(bs)), dtype=torch.int64)
    return as_tensor(out["train"]), as_tensor(out["val"]), as_tensor(out["test"])


class LM(nn.Module):
    """Byte-level causal transformer: embedding + learned positions, pre-norm
    encoder layers with a causal mask, final norm, untied head."""

    def __init__(self, ctx, d_model, layers, heads, ffn, vocab=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(ctx, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def loss_of(net, windows):
    logits = net(windows[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


class TextTask:
    """The text setup at a chosen global batch and length; evaluate() on the
    test split, or on the validation split with split="val" (tuning)."""

    name = "text"
    metrics = ("test_bits_per_byte", "test_loss")
    higher_is_better = False

    def __init__(self, batch=BATCH, steps=STEPS, split="test", model_cfg=None):
        self.train_bytes, val, test = splits()
        self.eval_bytes = val if split == "val" else test
        self.split = split
        if split == "val":
            self.metrics = ("val_bits_per_byte", "val_loss")
        self.batch, self.steps = batch, steps
        self.cfg = dict(model_cfg or MODEL)
        tuned = TUNED.get((batch, steps))
        self.lion, self.adamw = (tuned["lion"], tuned["adamw"]) if tuned else (FALLBACK["lion"], FALLBACK["adamw"])
        self.hparams = (f"TUNED[({batch}, {steps})]" if tuned
                        else "FALLBACK (the lr grids' centres: none tuned for this batch and length)")

    def model(self, seed):
        torch.manual_seed(seed)
        return LM(**self.cfg)

    def windows(self, seed):
        """The global batches of a seed: (steps, batch) start offsets in the training bytes."""
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, len(self.train_bytes) - self.cfg["ctx"] - 1, (self.steps, self.batch), generator=g)

    def train(self, net, opt, seed, rank=0, world=1):
        span = torch.arange(self.cfg["ctx"] + 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, cd.lr_factor(self.steps, WARMUP))
        for starts in self.windows(seed):
            local = starts.view(world, -1)[rank]  # this rank's share of the global batch
            opt.zero_grad()
            loss_of(net, self.train_bytes[local[:, None] + span]).backward()
            opt.step()
            sched.step()
        return self.steps

    @torch.no_grad()
    def evaluate(self, net, rank=0, world=1):
        """Cross-entropy per byte over the evaluation split, each byte predicted
        once (windows of ctx bytes tiling it); the windows are shared out over
        the ranks when called on all of them."""
        net = getattr(net, "module", net)
        ctx = self.cfg["ctx"]
        x = self.eval_bytes
        n = (len(x) - 1) // ctx
        inputs, targets = x[: n * ctx].view(n, ctx), x[1 : n * ctx + 1].view(n, ctx)
        total, count = 0.0, 0
        for i in range(rank * 128, n, 128 * world):
            logits = net(inputs[i : i + 128])
            total += nn.functional.cross_entropy(logits.reshape(-1, 256), targets[i : i + 128].reshape(-1),
                                                 reduction="sum").item()
            count += targets[i : i + 128].numel()
        if world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, (total, count))
            total, count = sum(p[0] for p in parts), sum(p[1] for p in parts)
        nats = total / count
        prefix = "val" if self.split == "val" else "test"
        return {f"{prefix}_bits_per_byte": nats / math.log(2), f"{prefix}_loss": nats, f"{prefix}_bytes": count}

    def describe(self):
        raw, c = corpus_bytes(), self.cfg
        sha = hashlib.sha256(raw).hexdigest()
        return dict(
            corpus=f"pydoc_data/topics.py (Python {sys.version.split()[0]}), {len(raw):,} bytes",
            corpus_sha256=sha, corpus_is_the_registered_one=sha == CORPUS_SHA256,
            splits=f"{BLOCK}-byte blocks, i % 10 == 8 validation, == 9 test; train {len(self.train_bytes):,} "
                   f"bytes, {self.split} {len(self.eval_bytes):,} bytes",
            model=f"byte-level causal transformer: context {c['ctx']}, d_model {c['d_model']}, {c['layers']} "
                  f"pre-norm layers, {c['heads']} heads, ffn {c['ffn']}, untied head",
            model_config=dict(c),
            tokens_per_step=self.batch * self.cfg["ctx"], schedule=f"linear warm-up {WARMUP:.0%} + cosine to 0",
            test_loss="nats per byte", hparams=self.hparams)


def tune(batch, steps, json_path=None):
    """Single process, no process group: every lr of GRIDS for Lion and AdamW,
    trained on the training blocks, scored by the mean validation bits per
    byte over TUNE_SEEDS; the lowest wins."""
    rows = {}
    for name, g in GRIDS.items():
        rows[name] = []
        for lr in g["lr"]:
            cfg = dict(lr=lr, betas=g["betas"], weight_decay=g["weight_decay"])
            task = TextTask(batch, steps, split="val")
            per = []
            t0 = time.perf_counter()
            for seed in TUNE_SEEDS:
                net = task.model(seed)
                task.train(net, cd.make_single(name, net.parameters(), cfg, cfg), seed)
                per.append(task.evaluate(net)["val_bits_per_byte"])
            rows[name].append(dict(cfg, val_bits_per_byte=statistics.fmean(per), per_seed=per))
            print(f"{name:6} batch {batch} steps {steps} lr {lr:<7g} val bits/byte {statistics.fmean(per):.4f} "
                  f"(seeds {' '.join(f'{v:.4f}' for v in per)}; {time.perf_counter() - t0:.1f} s)", flush=True)
        best = min(rows[name], key=lambda r: r["val_bits_per_byte"])
        edge = best["lr"] in (g["lr"][0], g["lr"][-1])
        print(f"{name} best: lr {best['lr']:g}{'  (at the edge of the grid)' if edge else ''}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(batch=batch, steps=steps, seeds=TUNE_SEEDS, model=MODEL, grids=GRIDS, rows=rows), f,
                      indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="vote,avg,lion,adamw",
                        help=f"comma list of {', '.join(cd.VARIANTS)}")
    parser.add_argument("--batch", type=int, default=BATCH, help="global batch, windows of ctx + 1 bytes")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seeds", default="0-2", help="a count from 0, or a list '0,1,2' / '0-2'")
    parser.add_argument("--json", default=None)
    parser.add_argument("--per-node", type=int, default=None,
                        help="the hierarchy variants (vote_nv, ...) see nodes of this many ranks")
    parser.add_argument("--tune", action="store_true", help="the lr search, single process (no torchrun)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.tune:
        tune(args.batch, args.steps, args.json)
        return
    names = cd.parse_variants(args.variants)
    dist.init_process_group("lionbit")
    cd.run_levers(TextTask(args.batch, args.steps), names, cd.parse_seeds(args.seeds), args.json, args.per_node)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
