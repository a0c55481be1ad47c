"""The time-to-quality workload: a causal transformer language model of about
10M parameters on the Python standard library's own sources, tokenized with a
byte-level BPE tokenizer trained here (Hugging Face `tokenizers`, no download).

Corpus: every .py file under the running interpreter's standard library
(sysconfig's "stdlib" path, site-packages and dist-packages left out), in
sorted order of their paths relative to it; about 11 MB under CPython 3.11.
Splits, fixed by the file (never a file in two splits): a file goes to
validation if the first byte of sha256(relative path) % 20 == 0, to test if
it is 1, else to training. The tokenizer (vocabulary VOCAB, byte-level BPE,
min frequency 2) is trained on the training files alone; the corpus, the
tokenizer and the three token arrays are cached under ~/.cache/lionbit/lm_stdlib
(keyed by the corpus's sha256), so a second run starts in a second.

Model (MODEL): token embedding + learned positions, pre-norm transformer
layers with a causal mask, final norm, an output head tied to the embedding.
Batches: random windows of CTX + 1 tokens of the training tokens; a seed fixes
the model's initial weights and the whole sequence of global batches, which
the ranks split. Metric: mean cross-entropy per token (nats) on EVAL_WINDOWS
fixed windows of the validation (or test) tokens.

    python examples/lm_stdlib.py            # builds the cache, prints the facts
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn

VOCAB = 8192
CTX = 128
MODEL = dict(vocab=VOCAB, ctx=CTX, d_model=320, layers=6, heads=5, ffn=1280)
EVAL_WINDOWS = 64
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "lionbit", "lm_stdlib")


def corpus_files() -> list:
    """(relative path, bytes) of every standard-library .py file, sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    out.append((os.path.relpath(path, root), f.read()))
    out.sort(key=lambda kv: kv[0])
    return out


def split_of(rel: str) -> str:
    h = hashlib.sha256(rel.encode()).digest()[0] % 20
    return "val" if h == 0 else "test" if h == 1 else "train"


def _texts(files):
    parts = {"train": [], "val": [], "test": []}
    for rel, raw in files:
        parts[split_of(rel)].append(raw.decode("utf-8", errors="replace"))
    return parts


def build(verbose: bool = True, limit: int | None = None) -> dict:
    """The cached corpus facts, tokenizer and token arrays (built on first use).
    ``limit``: only the first files (a test's few-second corpus)."""
    files = corpus_files()[:limit]
    digest = hashlib.sha256()
    for rel, raw in files:
        digest.update(rel.encode() + b"\0" + raw + b"\0")
    sha = digest.hexdigest()
    folder = os.path.join(CACHE, f"{sha[:16]}-v{VOCAB}")
    tensors = os.path.join(folder, "tokens.pt")
    if not os.path.exists(tensors):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        t0 = time.perf_counter()
        texts = _texts(files)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts["train"], trainer=trainer)
        arrays = {}
        for split, docs in texts.items():
            ids = [e.ids for e in tok.encode_batch(docs)]
            arrays[split] = torch.tensor([i for doc in ids for i in doc], dtype=torch.int16)
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        facts = dict(corpus_sha256=sha, python=sys.version.split()[0], files=len(files),
                     bytes=sum(len(raw) for _, raw in files),
                     split_files={s: sum(split_of(r) == s for r, _ in files) for s in ("train", "val", "test")},
                     split_bytes={s: sum(len(t.encode()) for t in texts[s]) for s in texts},
                     tokens={s: len(a) for s, a in arrays.items()}, vocab=tok.get_vocab_size(),
                     build_s=round(time.perf_counter() - t0, 1))
        torch.save({"arrays": arrays, "facts": facts}, tensors + ".tmp")
        os.replace(tensors + ".tmp", tensors)
        if verbose:
            print(f"lm_stdlib: built the tokenizer and tokens in {facts['build_s']} s: {folder}", flush=True)
    saved = torch.load(tensors)
    return {"facts": saved["facts"], "arrays": {k: v.long() for k, v in saved["arrays"].items()}}


class LM(nn.Module):
    """Causal transformer: tied token embedding + learned positions, pre-norm
    layers (nn.TransformerEncoderLayer with a causal mask), final norm."""

    def __init__(self, vocab, ctx, d_model, layers, heads, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(ctx, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.norm(h) @ self.embed.weight.t()


def loss_of(net, windows):
    logits = net(windows[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def model(seed: int, cfg: dict | None = None) -> LM:
    torch.manual_seed(seed)
    return LM(**(cfg or MODEL))


def batches(tokens: torch.Tensor, seed: int, steps: int, global_batch: int, ctx: int = CTX) -> torch.Tensor:
    """(steps, global_batch) window starts: the whole sequence of a seed's global batches."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, len(tokens) - ctx - 1, (steps, global_batch), generator=g)


def eval_windows(tokens: torch.Tensor, count: int = EVAL_WINDOWS, ctx: int = CTX) -> torch.Tensor:
    """`count` fixed, evenly spaced windows of ctx + 1 tokens of an evaluation split."""
    stride = (len(tokens) - ctx - 1) // count
    starts = torch.arange(count) * stride
    return tokens[starts[:, None] + torch.arange(ctx + 1)]


@torch.no_grad()
def evaluate(net, windows: torch.Tensor, rank: int = 0, world: int = 1) -> float:
    """Mean cross-entropy per token (nats) over the windows, shared out over the ranks
    when called on all of them (the all-reduce runs on the default group)."""
    import torch.distributed as dist

    net = getattr(net, "module", net)
    mine = windows[rank::world]
    logits = net(mine[:, :-1])
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1),
                                        reduction="sum").double()
    sums = torch.stack([total, torch.tensor(float(mine[:, 1:].numel()), dtype=torch.float64)])
    if world > 1:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def count_params(net) -> int:
    return sum(p.numel() for p in net.parameters())


def main() -> None:
    data = build()
    f = data["facts"]
    net = model(0)
    print(f"corpus: {f['files']:,} .py files of the Python {f['python']} standard library, {f['bytes']:,} bytes "
          f"(sha256 {f['corpus_sha256'][:16]}...)")
    parts = (f"{s} {f['split_files'][s]:,} / {f['split_bytes'][s]:,} / {f['tokens'][s]:,}"
             for s in ("train", "val", "test"))
    print("splits (files / bytes / tokens): " + ", ".join(parts))
    print(f"tokenizer: byte-level BPE, vocabulary {f['vocab']:,}; "
          f"{f['split_bytes']['train'] / f['tokens']['train']:.2f} bytes per token on the training split")
    print(f"model: {count_params(net):,} parameters ({MODEL}); uniform loss {math.log(VOCAB):.3f} nats/token")


if __name__ == "__main__":
    main()
