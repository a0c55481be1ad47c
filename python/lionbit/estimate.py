"""Estimate one training step's gradient communication on a cluster of nodes.

    python -m lionbit.estimate --params 7e9 --nodes 16 --gpus-per-node 8 --inter 100gbit

prints, for d parameters on M nodes of L GPUs each (N = M * L ranks), the
modelled time and bytes of each way to combine the ranks' gradients once:

    flat vote            lionbit's sign all-reduce over all N ranks, as built
    exact hierarchical   the same majority, counted inside each node first (hierarchy="node")
    node vote            a vote inside each node, then a vote of the node votes (hierarchy="node_vote";
                         approximate)
    fp32 / bf16 ring     an NCCL-style ring all-reduce over all N ranks
    fp32 / bf16 hier.    reduce-scatter in the node, ring all-reduce across nodes, all-gather in the node

and recommends the fastest exact one. It is also lionbit's one model of its own
wire and of one collective on one link a rank (sign_wire, ring_wire,
sign_allreduce_on_link, ring_allreduce_on_link), which bench/cost_model.py (suite 4)
validates against the measured collectives of suite 1. Standard library only: it imports no
other lionbit module and no torch, so `python path/to/estimate.py ...` works too.

The cluster
-----------
Each node has one network link to a non-blocking switch, shared by its L GPUs
(--inter: its rate per direction; for nodes with a NIC per GPU pass the sum),
and a switched intra-node fabric (NVLink/NVSwitch) that gives every GPU its own
rate per direction (--intra). Links are full duplex: a phase that sends X bytes
out of a node also receives X, and takes X / rate.

Ranks are numbered node by node (as torchrun does), so a ring over all N ranks
enters and leaves each node once: of each ring step's N hops, M cross nodes
(one out of each node) and N - M stay inside one. This is why a flat ring puts
only its per-rank bytes on each node's link, not L times them: NCCL builds its
rings this way.

The model
---------
    time      = sum over phases (latency + bandwidth) + kernels   (no overlap: an upper bound)
    latency   = steps * alpha + messages * o
    bandwidth = max(inter-node bytes per node / inter rate, intra-node bytes per GPU / intra rate)

A phase's transfers inside and between nodes run at once, so its bandwidth term
is that of its slower link. A step of a collective that spans nodes waits for
its inter-node hop: alpha_inter; a step inside a node costs alpha_intra. An
all-to-all posts its messages at once: one step, plus o per message. Every
collective is pipelined: latency is paid once per step, not per chunk. The
phases of a hierarchical method run one after another (an upper bound: NCCL
overlaps the phases of its hierarchical all-reduce).

Bytes per step of d parameters (b = ceil(log2(2L + 1)), the bits of a count in -L..L):

    method              inter-node link, bytes per node     intra-node, bytes per GPU   dependent steps
    flat vote           (L (M-1)/M + (N-1)/N) d/8           (L-1)/N d/8 + (N-1)/N d/8   1 + (N-1)
    exact hierarchical  (b + 1) (M-1)/M d/8                 2 (L-1)/L d/8               1 + 1 + (M-1) + (L-1)
    node vote           2 (M-1)/M d/8                       2 (L-1)/L d/8               1 + 1 + (M-1) + (L-1)
    ring, e bytes       2 (N-1)/N e d                       2 (N-1)/N e d               2 (N-1)
    hierarchical        2 (M-1)/M e d                       2 (L-1)/L e d               (L-1) + 2 (M-1) + (L-1)

  - flat vote: an all-to-all of the N packed shards (d/8N bytes each; a node's L
    ranks send L (N - L) of them to other nodes), then a ring all-gather of the
    N voted shards (each node's link carries N - 1 shards). On one node (M = 1)
    nothing crosses nodes. (Were the all-gather direct instead of a ring, the
    node's link would carry 2 L (M-1)/M d/8, about L d/4.)
  - exact hierarchical: a 1-bit all-to-all inside the node, so local rank j
    holds the node's exact counts (b bit-planes) of 1/L of the vector; the M
    ranks j exchange their counts (all-to-all, each owns 1/M of it), vote the
    exact majority over N, all-gather the 1-bit result across nodes, then inside
    the node. Ties are left out (lionbit sends them in up to 1.6 bits).
  - node vote: as exact hierarchical, but the node's vote (1 bit) crosses nodes,
    not its counts (a tie inside a node broken to fit the bit): a majority of
    node majorities, not the majority over N.
  - ring: reduce-scatter then all-gather, 2 (N-1) steps of d e / N bytes a hop.
  - hierarchical: each of the L local ranks all-reduces its 1/L of the vector
    with its peers on the other nodes (a ring over M); the node's link carries
    all L of them, 2 (M-1)/M e d: from a few nodes on, about the flat ring's
    2 (N-1)/N e d. It saves latency (2 (M-1) inter-node steps, not 2 (N-1)).

HSDP (--hsdp; estimate_hsdp, never recommended over the methods above: every rank holds
1/L of the parameters, gradient and optimizer state, another memory regime). FSDP2 shards
inside the node and replicates across nodes; each node is one replica. Inside the node,
counted alike for every HSDP row: FSDP's ring all-gather of the parameters (p bytes an
element, twice under reshard_after_forward: forward and backward) and its ring
reduce-scatter of the gradients (r bytes), each (L-1)/L d elements a GPU. Between nodes each
rank exchanges its d/L shard with the M ranks holding the same shard, the node's L ranks at
once over its link:

    method                      between nodes, bytes per rank       steps a unit   optimizer state
    HSDP + DistributedLion      sign_wire over M of d/L elements    2M - 1         momentum, d/L
                                (about 2 (M-1)/M (d/L)/8 + 72 (M-1))
    HSDP + AdamW, e bytes       2 (M-1)/M e d/L (a ring)            2 (M-1)        2 d/L fp32

so DistributedLion sends 1/32 of the fp32 all-reduce's bytes between nodes, 1/16 of bf16's.
Each fully_shard unit pays its collectives' steps again (--fsdp-units). Left out: FSDP's
overlap of its collectives with compute, the optimizer update itself, the all-gathers' copies.

Kernels (GPU memory traffic / an assumed rate): pack reads 4 bytes (the fp32
direction) and writes 1 bit per element, unpack reads 1 bit and writes 4 bytes
(streaming kernels); counting reads and writes its bit-planes (a count kernel);
an all-reduce reads 2 e and writes e bytes per element it reduces, and the bf16
ones convert fp32 to bf16 and back (4 + 2 bytes each way; streaming).

Measured kernels (--gpu-rates FILE, a `make gpu-check` JSON): lionbit's pack, vote, count and
unpack at the seconds an element that run measured (GpuRates, each kernel at its largest size;
a vote at N between the N measured read off their line; where the run has the apply from the
vote's planes, a flat vote unpacks nothing and its update applies from them), the streaming kernels at its
device-to-device copy rate (bytes of traffic a second). --step then adds a whole step after the
backward pass (step_estimates): the exchange and the optimizer's update, for DistributedLion
(its measured direction and apply kernels), Lion and AdamW on NCCL's bf16 all-reduce (their
update's bytes at the copy rate: a floor), PowerSGD with AdamW (rank r on a transformer's
matrices, two fp32 all-reduces, 8 passes over the gradient) and the two HSDP rows.

Assumptions (none is measured; every one is a constant below or an option):
H100 SXM memory bandwidth 3.35 TB/s, of which streaming kernels reach 80 % and
count kernels 50 %; NVLink 4: 900 GB/s per GPU both ways, 450 GB/s each way;
alpha 2 us a step inside a node, 20 us between nodes; o = 1 us a message of an
all-to-all. The flat vote's bytes are the wire's as built (sign_wire below: chunks
padded to whole words, each vote message's 8-byte count, the 64-byte header round
and its N-1 steps); the table above is its d/8 approximation. Left out: vote ties,
the hierarchical votes' header rounds, protocol overheads (take --inter as the goodput), overlap with the backward pass
and of kernels with transfers, DDP's bucketing (each bucket pays the latency
again), switch congestion.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace

# --- assumptions: stated, not measured -----------------------------------------------
GPU_MEMORY_BYTES_PER_S = 3.35e12  # H100 SXM HBM3, the vendor's figure
STREAM_FRACTION = 0.8  # assumed: pack, unpack, reductions, casts reach 80 % of it
COUNT_FRACTION = 0.5  # assumed: the bit-sliced count/vote kernels reach 50 % of it
NVLINK_BYTES_PER_S = 450e9  # NVLink 4 (H100): 900 GB/s per GPU in both directions, 450 GB/s each way
INTRA_LATENCY_S = 2e-6  # assumed: one dependent step inside a node (NCCL over NVLink)
INTER_LATENCY_S = 20e-6  # assumed: one dependent step between nodes (Ethernet, RDMA or TCP)
MESSAGE_OVERHEAD_S = 1e-6  # assumed: each further message an all-to-all posts at once
DIRECTION_BYTES = 4  # pack reads the fp32 Lion direction; unpack writes an fp32 sign

METHODS = (
    # name, label, exact, where it comes from
    ("flat_vote", "flat vote", True, "lionbit"),
    ("exact_hierarchical", "exact hierarchical", True, 'lionbit hierarchy="node"'),
    ("node_vote", "node vote", False, 'lionbit hierarchy="node_vote"'),
    ("ring_fp32", "fp32 ring all-reduce", True, "NCCL"),
    ("ring_bf16", "bf16 ring all-reduce", True, "NCCL"),
    ("hierarchical_fp32", "fp32 hierarchical all-reduce", True, "NCCL"),
    ("hierarchical_bf16", "bf16 hierarchical all-reduce", True, "NCCL"),
)
HSDP_METHODS = (
    # FSDP2 on a (replicate, shard) mesh: a different memory regime, never recommended over METHODS
    ("hsdp_lion", "HSDP + DistributedLion", True, "lionbit on FSDP2 HSDP"),
    ("hsdp_adamw_fp32", "HSDP + AdamW (fp32 all-reduce)", True, "FSDP2 HSDP (NCCL)"),
    ("hsdp_adamw_bf16", "HSDP + AdamW (bf16 all-reduce)", True, "FSDP2 HSDP (NCCL)"),
)


# --- lionbit's wire, as built (checked against lionbit._C.wire_layout by the tests) ---
WORD_BITS = 64  # signbits/types.h kWordBits: a rank's shard is whole 64-bit words
HEADER_BYTES = 72  # signbits/wire.h sizeof(WireHeader): the header round, one to each rank (all-to-all)
TIE_COUNT_BYTES = 16  # backend/phase2.cpp: a vote message starts with its zeros' code (two u64)
TRIT_BYTES_PER_WORD = 13  # signbits/trits.h: 64 results in base 3 (ties riding inline)
# backend/sign_common.hpp kDirectAllgatherBytes: on the CPU (Gloo) communicator an all-gather whose
# result (n pieces) is at most this many bytes goes to every peer at once (1 step), else round the ring
DIRECT_ALLGATHER_BYTES = 64 << 10


def default_chunk_elems(n: int, gpu: bool = False) -> int:
    """signbits/wire.cpp: elements a pipelined chunk by default: 4M (256M on a GPU), at
    least 256K a rank's shard."""
    return max(1 << (28 if gpu else 22), (1 << 18) * n)


def chunk_elems_for(requested: int, n: int, gpu: bool = False) -> int:
    """signbits/wire.cpp: the chunk, rounded up to whole words a shard (64 N elements);
    requested <= 0: the default for N (LIONBIT_CHUNK_ELEMS sets it at run time)."""
    if requested <= 0:
        requested = default_chunk_elems(n, gpu)
    unit = WORD_BITS * n
    return (max(requested, unit) + unit - 1) // unit * unit


def shard_words(numel: int, n: int) -> int:
    """signbits/types.h: words of a rank's shard of `numel` elements (padded to 64 N)."""
    unit = WORD_BITS * n
    return (numel + unit - 1) // unit * unit // WORD_BITS // n


def zero_encoding_bytes(capacity: int, words: int, runs: int | None = None, packed: int = 0) -> int:
    """signbits/zeros.cpp: up to `capacity` zeros in at most `runs` runs (None: not known,
    as many as zeros) in a plane of `words` words, sent as the smallest of: 32-bit offsets
    (padded to an even count), (first, end) pairs of 32-bit offsets a run, `packed` bytes
    of packed runs (signbits/packed_runs.h: variable-length gaps and lengths with repeats,
    a multiple of 8; 0: not offered), the plane. Offsets are 32-bit: planes of 2^32 - 1
    elements or more go dense."""
    if capacity <= 0:
        return 0
    plane = words * 8
    if words * WORD_BITS >= 0xFFFFFFFF:
        return plane
    listed = (capacity + (capacity & 1)) * 4
    ran = (capacity if runs is None else runs) * 8
    packed = packed if packed > 0 and packed % 8 == 0 else plane
    return min(listed, ran, packed, plane)


def sign_wire(
    op: str,
    n: int,
    d: int,
    tie_fraction: float = 0.0,
    chunk_request: int = 0,
    gpu: bool = False,
    ag_steps: int | None = None,
) -> dict:
    """The bytes one rank sends in lionbit.all_reduce_sign of d elements over n ranks
    (op "vote" or "avg", inputs without exact zeros), and the call's dependent message steps:

      header round   an all-to-all of HEADER_BYTES (one addressed to each)    1 step
      per chunk (padded to 64 n elements; sb = a shard's bytes):
        n = 2        one exchange of the rank's whole packed chunk: 2 sb      1 step
        phase 1      all-to-all of the packed shards: (n-1) sb                1 step
        phase 2      all-gather of the owner's message, (n-1) of them: on the CPU, when
                     the n messages are at most DIRECT_ALLGATHER_BYTES, sent to every
                     peer at once (1 step), else round the ring ((n-1) steps)
                     vote: TIE_COUNT_BYTES + sb, or with dense ties inline from the
                     second vote on (the steady state): TIE_COUNT_BYTES + 13 bytes a
                     word padded to 8; avg: bit_width(n) count planes of sb each
        sparse ties  (vote) their positions, a list in an all-gather of its own (its
                     steps as phase 2's), when smaller than a plane
      n = 2, chunks >= 2: a second header round (the first chunk is announced alone;
                     half of the rest leaves as signs only while the rest is packed,
                     then the rest's round; zeros there would follow in a message of
                     its own, not modelled: inputs without exact zeros)      1 step

    tie_fraction: the fraction of a shard's elements that tie (their mean count is taken as
    every shard's). ag_steps: steps of every all-gather (default: as above, by size and device).
    Returns bytes, steps, chunks, chunk_elems, inline_elems (elements whose results rode
    in base 3) and shards: [(elements of a chunk, chunks of that length, shard words)]."""
    if op not in ("vote", "avg"):
        raise ValueError(f"sign_wire: op must be 'vote' or 'avg', got {op!r}")
    chunk = chunk_elems_for(chunk_request, n, gpu)
    full, rest = divmod(int(d), chunk)
    counts = ((chunk, full), (rest, 1 if rest else 0))
    shards = [(length, mult, shard_words(length, n)) for length, mult in counts if mult]
    def ag(message: int) -> int:
        if ag_steps is not None:
            return ag_steps
        return 1 if not gpu and n * message <= DIRECT_ALLGATHER_BYTES else n - 1

    chunks = full + (1 if rest else 0)
    rounds = 2 if n == 2 and chunks >= 2 else 1
    nbytes, steps, inline_elems = rounds * (n - 1) * HEADER_BYTES, rounds, 0
    for length, mult, sw in shards:
        sb = sw * 8
        if n == 2:
            nbytes += mult * 2 * sb
            steps += mult
            continue
        tie_steps = 0
        if op == "vote":
            ties = math.ceil(tie_fraction * sw * WORD_BITS)
            listed = zero_encoding_bytes(ties, sw)
            if ties > 0 and listed >= sb:
                message = TIE_COUNT_BYTES + (TRIT_BYTES_PER_WORD * sw + 7) // 8 * 8
                inline_elems += mult * length
            else:
                message = TIE_COUNT_BYTES + sb + listed
                tie_steps = ag(listed) if ties > 0 else 0
        else:
            message = int(n).bit_length() * sb  # count planes
        nbytes += mult * (n - 1) * (sb + message)
        steps += mult * (1 + ag(message) + tie_steps)  # phase 1 (an all-to-all), phase 2, a tie list
    return {
        "bytes": nbytes,
        "steps": steps,
        "chunks": chunks,
        "chunk_elems": chunk,
        "inline_elems": inline_elems,
        "shards": shards,
    }


def ring_wire(n: int, d: float, elem_bytes: int, log_steps: bool = False) -> dict:
    """An all-reduce of d elements of elem_bytes over n ranks by a ring (Gloo, NCCL):
    reduce-scatter then all-gather, 2 (n-1) steps of d e / n bytes, 2 (n-1)/n e d bytes a
    rank sends, and (n-1)/n d elements it reduces. log_steps: a what-if, recursive halving
    + doubling (2 ceil(log2 n) steps, the same bytes for n a power of 2)."""
    steps = 2 * math.ceil(math.log2(n)) if log_steps else 2 * (n - 1)
    return {"bytes": 2 * (n - 1) / n * elem_bytes * d, "steps": steps, "reduced_elems": (n - 1) / n * d}


# --- one collective, one link a rank (suite 4 validates it against suite 1's runs) -----
@dataclass(frozen=True)
class LinkRates:
    """One link a rank: payload bytes/s each way, seconds a dependent message step, and
    seconds for each further message an all-to-all posts at once."""

    goodput: float
    alpha: float
    msg_overhead: float = 0.0


@dataclass(frozen=True)
class CoreRates:
    """The kernels on a rank's core: bytes/s of float32 read by pack, written by unpack
    (base-3 results at unpack_trits; 0: as unpack), read bandwidth (reductions), and the
    vote's seconds an output element, vote_a + vote_b * N. kappa: ranks a core (>= 1), a
    factor on every compute term."""

    pack: float
    unpack: float
    read: float
    vote_a: float
    vote_b: float
    unpack_trits: float = 0.0
    kappa: float = 1.0

    def vote_s(self, out_elems: float, n: int) -> float:
        return out_elems * (self.vote_a + self.vote_b * n)


def terms(nbytes: float, latency: float, bandwidth: float, kernels: float, **extra) -> dict:
    """A collective's time as latency + bandwidth + kernels (no overlap: an upper bound),
    and which of the three bounds it."""
    parts = (("latency", latency), ("bandwidth", bandwidth), ("kernels", kernels))
    return dict(
        bytes=nbytes,
        latency_s=latency,
        bandwidth_s=bandwidth,
        kernel_s=kernels,
        time_s=latency + bandwidth + kernels,
        bound=max(parts, key=lambda p: p[1])[0],
        **extra,
    )


def sign_allreduce_on_link(
    op: str,
    n: int,
    d: int,
    link: LinkRates,
    core: CoreRates,
    tie_fraction: float = 0.0,
    chunk_request: int = 0,
    log_allgather: bool = False,
) -> dict:
    """lionbit.all_reduce_sign of d float32 elements over n ranks: sign_wire's bytes and
    steps, and its time on one link a rank:

      latency        steps * alpha, plus (n-1) o for each all-to-all's messages (a chunk's,
                     a header round's)
      bandwidth      bytes / goodput
      kernels        pack 4 d bytes, vote the own shard of every chunk with n inputs (at
                     n = 2 both shards; avg's count at the vote's rate), unpack 4 d bytes
                     (base-3 results at their own rate); times kappa

    log_allgather: a what-if (not built): all-gathers by recursive doubling, ceil(log2 n)
    steps each (in place of n - 1, or 1 for the direct ones), the same bytes."""
    ag_steps = math.ceil(math.log2(n)) if log_allgather else None
    wire = sign_wire(op, n, d, tie_fraction, chunk_request, ag_steps=ag_steps)
    voted = 2 if n == 2 else 1  # the exchange: each rank votes both shards
    vote_s = sum(mult * voted * core.vote_s(sw * WORD_BITS, n) for _, mult, sw in wire["shards"])
    inline = wire["inline_elems"]
    trits = core.unpack_trits or core.unpack
    kern = core.kappa * (4 * d / core.pack + vote_s + 4 * (d - inline) / core.unpack + 4 * inline / trits)
    nbytes, steps, chunks = wire["bytes"], wire["steps"], wire["chunks"]
    rounds = 2 if n == 2 and chunks >= 2 else 1
    lat = steps * link.alpha + (chunks + rounds) * (n - 1) * link.msg_overhead
    return terms(nbytes, lat, nbytes / link.goodput, kern, steps=steps, chunks=chunks, chunk_elems=wire["chunk_elems"])


def ring_allreduce_on_link(
    n: int,
    d: int,
    elem_bytes: int,
    reduce_read_bytes: int,
    link: LinkRates,
    core: CoreRates,
    log_steps: bool = False,
) -> dict:
    """A ring all-reduce (Gloo's) on one link a rank: ring_wire's bytes and steps, and the
    reduction of its elements reading reduce_read_bytes each at the core's read bandwidth."""
    wire = ring_wire(n, d, elem_bytes, log_steps)
    nbytes, steps = wire["bytes"], wire["steps"]
    kern = core.kappa * wire["reduced_elems"] * reduce_read_bytes / core.read
    return terms(nbytes, steps * link.alpha, nbytes / link.goodput, kern, steps=steps)


@dataclass(frozen=True)
class Cluster:
    """M nodes of L GPUs. Rates in bytes/s per direction; latencies in seconds a step."""

    nodes: int
    gpus_per_node: int = 8
    inter_bytes_per_s: float = 100e9 / 8  # each node's network link, shared by its GPUs
    intra_bytes_per_s: float = NVLINK_BYTES_PER_S  # each GPU's NVLink
    inter_latency_s: float = INTER_LATENCY_S
    intra_latency_s: float = INTRA_LATENCY_S
    message_overhead_s: float = MESSAGE_OVERHEAD_S

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class GpuRates:
    """lionbit's GPU kernels as `make gpu-check` measured them (lionbit_bench_cuda's rows of its
    JSON, each kernel at the largest size measured): seconds an element, and the GPU's
    device-to-device copy in bytes of memory traffic a second. The vote and count tables are
    (N, seconds an output element), N ascending."""

    source: str
    device: str
    copy_bytes_per_s: float
    pack_s: float  # pack_signs f32: an fp32 direction read, 1 bit written
    unpack_s: float  # unpack f32 (2 planes): the sign and zero planes read, an fp32 written
    direction_s: float  # lion_direction f32/f32: the Lion direction from gradient and momentum
    apply_s: float  # lion_apply_dense f32/f32: the voted direction applied, the momentum updated
    vote: tuple
    count: tuple
    # lion_apply_planes f32: the apply from the vote's two result planes (a flat vote's, and
    # HSDP's replicate vote), no unpack before it; None where the run predates that row (the
    # flat vote then pays the unpack and the dense apply, as the hierarchical votes do)
    apply_planes_s: float | None = None

    def from_planes(self, planes: bool) -> bool:
        """Whether a vote whose apply can read its planes (``planes``) is timed so: the row measured."""
        return planes and self.apply_planes_s is not None

    def update_s(self, planes: bool) -> float:
        """Seconds an element of DistributedLion's update: the direction, then the apply from
        the vote's planes (``planes``, where measured) or from its unpacked values."""
        return self.direction_s + (self.apply_planes_s if self.from_planes(planes) else self.apply_s)

    def per_element(self, table: tuple, n: float) -> float:
        """Seconds an output element at N inputs: linear between the N measured, the first's below
        them, the last two's line above (the kernels read N planes: linear in N)."""
        if n <= table[0][0] or len(table) == 1:
            return table[0][1]
        pairs = list(zip(table, table[1:]))
        (n0, s0), (n1, s1) = next((p for p in pairs if n <= p[1][0]), pairs[-1])
        return s0 + (s1 - s0) * (n - n0) / (n1 - n0)


# make gpu-check's kernel rows (lionbit_bench_cuda) that GpuRates reads, by field
GPU_KERNEL_ROWS = {
    "pack_s": "pack_signs f32",
    "unpack_s": "unpack f32 (2 planes)",
    "direction_s": "lion_direction f32/f32",
    "apply_s": "lion_apply_dense f32/f32",
}
GPU_COPY_ROW = "memcpy D2D (f32)"
GPU_PLANES_ROW = "lion_apply_planes f32"  # optional: GpuRates.apply_planes_s


def gpu_rates(path: str) -> GpuRates:
    """The kernel rates of a `make gpu-check` JSON (figures.bench_kernels; e.g.
    docs/benchmarks/gpu_check_h200_5.json). ValueError naming the file and what it lacks."""
    where = str(path)
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: not a readable JSON file ({err})") from None
    rows = doc.get("figures", {}).get("bench_kernels") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: no figures.bench_kernels (the kernel rates of a make gpu-check JSON)")
    largest = {}  # kernel -> its row at the largest size
    for row in rows:
        ok = isinstance(row, dict) and isinstance(row.get("kernel"), str)
        ok = ok and all(isinstance(row.get(key), (int, float)) and row[key] > 0 for key in ("elements_M", "time_us"))
        if not ok:
            raise ValueError(f"{where}: a bench_kernels row without kernel, elements_M > 0 and time_us > 0: {row!r}")
        if row["kernel"] not in largest or row["elements_M"] > largest[row["kernel"]]["elements_M"]:
            largest[row["kernel"]] = row

    def seconds(name: str) -> float:
        if name not in largest:
            raise ValueError(f"{where}: no {name!r} row in figures.bench_kernels")
        return largest[name]["time_us"] * 1e-6 / (largest[name]["elements_M"] * 1e6)

    def table(prefix: str) -> tuple:
        found = sorted((int(name[len(prefix):]), seconds(name)) for name in largest
                       if name.startswith(prefix) and name[len(prefix):].isdigit())
        if not found:
            raise ValueError(f"{where}: no {prefix}<N> row in figures.bench_kernels")
        return tuple(found)

    singles = {field_name: seconds(name) for field_name, name in GPU_KERNEL_ROWS.items()}
    vote, count = table("vote N="), table("count_code N=")
    copy = largest.get(GPU_COPY_ROW)
    if copy is None or not isinstance(copy.get("MB"), (int, float)) or copy["MB"] <= 0:
        raise ValueError(f"{where}: no {GPU_COPY_ROW!r} row with its MB in figures.bench_kernels")
    gpu = doc.get("gpu")
    return GpuRates(
        source=str(path),
        device=str(gpu.get("name", "a GPU")) if isinstance(gpu, dict) else "a GPU",
        copy_bytes_per_s=copy["MB"] * 1e6 / (copy["time_us"] * 1e-6),
        vote=vote,
        count=count,
        apply_planes_s=seconds(GPU_PLANES_ROW) if GPU_PLANES_ROW in largest else None,
        **singles,
    )


@dataclass(frozen=True)
class Kernels:
    """GPU kernel rates: assumed, in bytes of memory traffic a second (see above), or measured
    (Kernels.measured: lionbit's own kernels at make gpu-check's rates, the streaming ones,
    NCCL's reductions and casts among them, at its device-to-device copy rate)."""

    stream_bytes_per_s: float = STREAM_FRACTION * GPU_MEMORY_BYTES_PER_S
    count_bytes_per_s: float = COUNT_FRACTION * GPU_MEMORY_BYTES_PER_S
    gpu: GpuRates | None = None

    @classmethod
    def measured(cls, rates: GpuRates) -> Kernels:
        return cls(rates.copy_bytes_per_s, rates.copy_bytes_per_s, rates)

    def stream_s(self, nbytes: float) -> float:
        return nbytes / self.stream_bytes_per_s

    def lionbit_s(self, elems: float, planes: bool = False) -> float:
        """lionbit's pack of `elems` fp32 directions and unpack of their result; on measured
        rates with ``planes`` (a vote whose apply reads its result planes) no unpack: the
        apply's share is GpuRates.update_s(True)'s."""
        if self.gpu is None:
            return self.stream_s(lionbit_kernel_bytes(elems))
        return elems * (self.gpu.pack_s + (0.0 if self.gpu.from_planes(planes) else self.gpu.unpack_s))

    def count_s(self, nbytes: float, out_elems: float, inputs: float, vote: bool = True) -> float:
        """Counting `inputs` bit-planes into `out_elems` results, `nbytes` of planes read and
        written: a vote's 1-bit result, or (vote=False) the exact counts (count_code)."""
        if self.gpu is None:
            return nbytes / self.count_bytes_per_s
        return out_elems * self.gpu.per_element(self.gpu.vote if vote else self.gpu.count, inputs)


@dataclass(frozen=True)
class Phase:
    """One collective phase: its bytes on each kind of link and its dependent steps."""

    name: str
    inter_bytes: float = 0.0  # sent out of each node over its network link
    intra_bytes: float = 0.0  # sent by the busiest GPU over NVLink
    inter_steps: int = 0  # steps that wait for an inter-node hop (alpha_inter each)
    intra_steps: int = 0  # steps inside a node (alpha_intra each)
    messages: int = 0  # further messages of an all-to-all (o each)


@dataclass
class Estimate:
    """One method's step communication: seconds, by term, and bytes per link."""

    method: str
    label: str
    exact: bool
    source: str
    time_s: float
    latency_s: float
    inter_s: float  # bandwidth time on the network links
    intra_s: float  # bandwidth time on NVLink
    kernel_s: float
    inter_bytes_per_node: float
    intra_bytes_per_gpu: float
    bound: str
    phases: list = field(default_factory=list)


@dataclass
class HsdpEstimate(Estimate):
    """An HSDP method's step: FSDP's traffic inside the node and the replicas' exchange
    between nodes (an Estimate, and these), and its memory per rank."""

    inter_bytes_per_rank: float = 0.0  # what one rank sends to other nodes (its shard's exchange)
    cross_node_s: float = 0.0  # the exchange between nodes alone: latency + bandwidth
    fsdp_intra_bytes_per_gpu: float = 0.0  # FSDP's all-gathers and reduce-scatter (the same in every row)
    optimizer_state_bytes_per_rank: float = 0.0
    memory_bytes_per_rank: float = 0.0  # parameters + gradient + optimizer state (docs/fsdp.md's table)


@dataclass(frozen=True)
class Fsdp:
    """How FSDP2 runs inside the node (the same for every HSDP method): the bytes of an
    element its all-gather of parameters sends (MixedPrecisionPolicy.param_dtype) and its
    reduce-scatter of gradients sends (reduce_dtype), whether the backward all-gathers the
    parameters again (reshard_after_forward), the units (each a collective of its own,
    paying its steps), and DistributedLion's momentum element."""

    param_bytes: int = 4
    reduce_bytes: int = 4
    reshard_after_forward: bool = True
    units: int = 1
    momentum_bytes: int = 4


def count_bits(gpus_per_node: int) -> int:
    """Bits of a node's exact count of L signs, -L..L: ceil(log2(2L + 1))."""
    return math.ceil(math.log2(2 * gpus_per_node + 1))


def steps_if(k: int) -> int:
    """An all-to-all among k members: one step, none when k == 1."""
    return 1 if k > 1 else 0


def phase_terms(p: Phase, c: Cluster) -> tuple:
    """One phase's (latency, inter-node bandwidth time, intra-node bandwidth time)."""
    latency = p.inter_steps * c.inter_latency_s + p.intra_steps * c.intra_latency_s + p.messages * c.message_overhead_s
    return latency, p.inter_bytes / c.inter_bytes_per_s, p.intra_bytes / c.intra_bytes_per_s


def phase_time(p: Phase, c: Cluster) -> float:
    """One phase alone: its latency and its slower link's bandwidth term."""
    latency, t_inter, t_intra = phase_terms(p, c)
    return latency + max(t_inter, t_intra)


def combine(
    method: str,
    c: Cluster,
    phases: list,
    stream_bytes: float,
    own_s: float,
    k: Kernels,
    hsdp: dict | None = None,
) -> Estimate:
    """Adds the phases (each bounded by its slower link) and the kernels: `stream_bytes` of
    streaming kernels and `own_s` seconds of lionbit's (Kernels.lionbit_s, count_s); with
    `hsdp` (HsdpEstimate's own fields), an HsdpEstimate."""
    latency = inter = intra = 0.0
    for p in phases:
        t_latency, t_inter, t_intra = phase_terms(p, c)
        latency += t_latency
        if t_inter >= t_intra:
            inter += t_inter
        else:
            intra += t_intra
    kern = k.stream_s(stream_bytes) + own_s
    terms = {
        "latency": latency,
        "inter-node bandwidth": inter,
        "intra-node bandwidth": intra,
        "kernels": kern,
    }
    name, label, exact, source = next(m for m in METHODS + HSDP_METHODS if m[0] == method)
    return (Estimate if hsdp is None else HsdpEstimate)(
        method=name,
        label=label,
        exact=exact,
        source=source,
        time_s=sum(terms.values()),
        latency_s=latency,
        inter_s=inter,
        intra_s=intra,
        kernel_s=kern,
        inter_bytes_per_node=sum(p.inter_bytes for p in phases),
        intra_bytes_per_gpu=sum(p.intra_bytes for p in phases),
        bound=max(terms, key=terms.get),
        phases=[p.name for p in phases],
        **(hsdp or {}),
    )


def lionbit_kernel_bytes(d: float) -> float:
    """pack (read the fp32 direction, write 1 bit) + unpack (read 1 bit, write fp32)."""
    return 2 * (DIRECTION_BYTES * d + d / 8)


# --- the methods: d parameters on cluster c -------------------------------------------


def flat_vote(d: float, c: Cluster, k: Kernels | None = None) -> Estimate:
    """lionbit's vote over all N ranks, its bytes as sign_wire states them (GPU chunks, no
    ties): the header round, an all-to-all of packed shards and a ring all-gather of the
    votes; at N = 2 one exchange of the packed signs, each rank voting every shard itself."""
    k = k or Kernels()
    n, m, lpn = c.ranks, c.nodes, c.gpus_per_node
    wire = sign_wire("vote", n, int(math.ceil(d)), gpu=True)
    shard = sum(mult * sw * 8 for _, mult, sw in wire["shards"])  # a rank's shard of every chunk
    flat_inter = m > 1  # a flat collective's every step waits for the inter-node hop

    def ring_phase(name: str, hop_bytes: float, steps: int) -> Phase:
        return Phase(
            name,
            inter_bytes=hop_bytes if flat_inter else 0.0,  # one hop out of each node per step
            intra_bytes=hop_bytes if lpn > 1 or not flat_inter else 0.0,
            inter_steps=steps if flat_inter else 0,
            intra_steps=0 if flat_inter else steps,
        )

    header = ring_phase("header round", (n - 1) * HEADER_BYTES, n - 1)
    if n == 2:
        return combine(
            "flat_vote",
            c,
            [header, ring_phase("exchange of the packed signs", 2 * shard, 1)],
            0.0,
            k.lionbit_s(d, planes=True) + k.count_s(2 * d / 8, d, 2),  # each rank votes every element
            k,
        )
    a2a = Phase(
        "all-to-all of the packed signs",
        inter_bytes=lpn * (n - lpn) * shard,  # the node's L ranks, each to the N - L ranks elsewhere
        intra_bytes=(lpn - 1) * shard,
        inter_steps=steps_if(n) if flat_inter else 0,
        intra_steps=0 if flat_inter else steps_if(n),
        messages=n - 1,
    )
    votes = sum(mult * (TIE_COUNT_BYTES + sw * 8) for _, mult, sw in wire["shards"])
    ring = ring_phase("ring all-gather of the votes", (n - 1) * votes, n - 1)
    count = k.count_s(d / 8 + shard, 8 * shard, n)  # N shards in, one out
    return combine("flat_vote", c, [header, a2a, ring], 0.0, k.lionbit_s(d, planes=True) + count, k)


def two_level_vote(method: str, d: float, c: Cluster, k: Kernels | None, cross_bits: int) -> Estimate:
    """Count inside the node, exchange `cross_bits`-bit values per element across nodes,
    vote, and bring the 1-bit result back across nodes and then inside the node."""
    k = k or Kernels()
    m, lpn = c.nodes, c.gpus_per_node
    part = d / lpn  # elements each local rank owns across nodes
    phases = [
        Phase(
            "1-bit all-to-all inside the node (counts of L)",
            intra_bytes=(lpn - 1) / lpn * d / 8,
            intra_steps=steps_if(lpn),
            messages=lpn - 1,
        ),
        Phase(
            f"all-to-all of {cross_bits}-bit values across nodes",
            inter_bytes=lpn * (m - 1) / m * part * cross_bits / 8,  # all L local ranks share the link
            inter_steps=steps_if(m),
            messages=m - 1,
        ),
        Phase("ring all-gather of the votes across nodes", inter_bytes=lpn * (m - 1) / m * part / 8, inter_steps=m - 1),
        Phase("ring all-gather of the votes inside the node", intra_bytes=(lpn - 1) / lpn * d / 8, intra_steps=lpn - 1),
    ]
    # L inputs of d/L bits in, counts out; then M count sets of d/(L M) in, 1 bit out (measured
    # rates: the count of counts timed as a vote of M x cross_bits planes)
    count_in_node = k.count_s(d / 8 + part * cross_bits / 8, part, lpn, vote=False)
    count_across = k.count_s(part * cross_bits / 8 + part / m / 8, part / m, m * cross_bits)
    return combine(method, c, phases, 0.0, k.lionbit_s(d) + count_in_node + count_across, k)


def exact_hierarchical(d: float, c: Cluster, k: Kernels | None = None) -> Estimate:
    """The exact majority over N: the node's exact counts (b bit-planes) cross nodes."""
    return two_level_vote("exact_hierarchical", d, c, k, count_bits(c.gpus_per_node))


def node_vote(d: float, c: Cluster, k: Kernels | None = None) -> Estimate:
    """Approximate: each node's 1-bit vote crosses nodes, and the nodes' votes are voted."""
    return two_level_vote("node_vote", d, c, k, 1)


def cast_bytes(d: float, elem_bytes: int) -> float:
    """fp32 gradients to the wire type and the result back (none for fp32)."""
    return 0.0 if elem_bytes == 4 else 2 * (4 + elem_bytes) * d


def ring_allreduce(d: float, c: Cluster, elem_bytes: int = 4, k: Kernels | None = None) -> Estimate:
    """An NCCL-style ring over all N ranks, node by node: reduce-scatter then all-gather,
    2 (N-1) steps of d e / N bytes on every hop; one hop leaves each node per step."""
    n, m, lpn = c.ranks, c.nodes, c.gpus_per_node
    wire = ring_wire(n, d, elem_bytes)
    flat_inter = m > 1
    ring = Phase(
        "ring reduce-scatter + all-gather",
        inter_bytes=wire["bytes"] if flat_inter else 0.0,
        intra_bytes=wire["bytes"] if lpn > 1 else 0.0,
        inter_steps=wire["steps"] if flat_inter else 0,
        intra_steps=0 if flat_inter else wire["steps"],
    )
    reduce = wire["reduced_elems"] * 3 * elem_bytes  # read two, write one
    method = "ring_fp32" if elem_bytes == 4 else "ring_bf16"
    return combine(method, c, [ring], reduce + cast_bytes(d, elem_bytes), 0.0, k or Kernels())


def hierarchical_allreduce(d: float, c: Cluster, elem_bytes: int = 4, k: Kernels | None = None) -> Estimate:
    """Reduce-scatter inside the node, a ring all-reduce of each 1/L across the nodes (the
    L local ranks at once, sharing the node's link), all-gather inside the node."""
    m, lpn = c.nodes, c.gpus_per_node
    phases = [
        Phase("reduce-scatter inside the node", intra_bytes=(lpn - 1) / lpn * elem_bytes * d, intra_steps=lpn - 1),
        Phase(
            "ring all-reduce of 1/L across nodes",
            inter_bytes=lpn * 2 * (m - 1) / m * elem_bytes * d / lpn,
            inter_steps=2 * (m - 1),
        ),
        Phase("all-gather inside the node", intra_bytes=(lpn - 1) / lpn * elem_bytes * d, intra_steps=lpn - 1),
    ]
    reduce = ((lpn - 1) / lpn * d + (m - 1) / m * d / lpn) * 3 * elem_bytes
    method = "hierarchical_fp32" if elem_bytes == 4 else "hierarchical_bf16"
    return combine(method, c, phases, reduce + cast_bytes(d, elem_bytes), 0.0, k or Kernels())


# --- HSDP: FSDP2 on a (replicate, shard) mesh, a node one replica -----------------------


def fsdp_phases(d: float, c: Cluster, f: Fsdp) -> tuple:
    """FSDP's own traffic inside the node, counted alike for every HSDP method: a ring
    all-gather of the parameters for the forward (and again for the backward under
    reshard_after_forward) and a ring reduce-scatter of the gradients, each (L-1)/L of d
    elements a GPU sends, L-1 steps a unit. Returns the phases and the kernels' bytes
    (the reduce-scatter's reduction: read two, write one; the all-gathers' copies left out)."""
    lpn = c.gpus_per_node
    gather = Phase(
        "FSDP all-gather of the parameters inside the node (forward)",
        intra_bytes=(lpn - 1) / lpn * f.param_bytes * d,
        intra_steps=(lpn - 1) * f.units,
    )
    phases = [gather]
    if f.reshard_after_forward:
        phases.append(replace(gather, name=gather.name.replace("forward", "backward")))
    phases.append(
        Phase(
            "FSDP reduce-scatter of the gradients inside the node",
            intra_bytes=(lpn - 1) / lpn * f.reduce_bytes * d,
            intra_steps=(lpn - 1) * f.units,
        )
    )
    return phases, (lpn - 1) / lpn * d * 3 * f.reduce_bytes


def hsdp_memory(d: float, c: Cluster, state_bytes: float) -> dict:
    """Bytes per rank: fp32 parameters and FSDP's fp32 sharded gradient, 4 d/L each, and the
    optimizer state (docs/fsdp.md's memory table; activations and the unsharded parameters
    of the unit being run left out)."""
    part = d / c.gpus_per_node
    return {"optimizer_state_bytes_per_rank": state_bytes, "memory_bytes_per_rank": 8 * part + state_bytes}


def hsdp_lion(d: float, c: Cluster, k: Kernels | None = None, f: Fsdp | None = None) -> HsdpEstimate:
    """HSDP + DistributedLion: each rank packs the Lion direction of its d/L shard and
    votes it with the M ranks holding the same shard (lionbit's sign all-reduce over the
    replicate group, a unit at a time, its bytes and steps as sign_wire states them: GPU
    chunks, no ties); the node's L ranks do so at once, sharing its link. One node: plain
    Lion on FSDP, nothing between nodes."""
    f, k = f or Fsdp(), k or Kernels()
    m, lpn = c.nodes, c.gpus_per_node
    part = d / lpn
    phases, stream = fsdp_phases(d, c, f)
    per_rank, own, cross_s = 0.0, 0.0, 0.0
    if m > 1:
        unit = int(math.ceil(part / f.units))
        wire = sign_wire("vote", m, unit, gpu=True)
        per_rank = f.units * wire["bytes"]
        shard = sum(mult * sw * 8 for _, mult, sw in wire["shards"])
        cross = Phase(
            "sign all-reduce of each rank's shard across nodes (replicate group)",
            inter_bytes=lpn * per_rank,
            inter_steps=f.units * wire["steps"],
            messages=f.units * wire["chunks"] * (m - 1) if m > 2 else 0,
        )
        phases.append(cross)
        cross_s = phase_time(cross, c)
        own = k.lionbit_s(part, planes=True)
        if m == 2:
            own += k.count_s(2 * part / 8, part, 2)
        else:
            own += k.count_s(part / 8 + f.units * shard, 8 * f.units * shard, m)
    memory = hsdp_memory(d, c, f.momentum_bytes * part)
    extra = {"inter_bytes_per_rank": per_rank, "cross_node_s": cross_s, **memory}
    extra["fsdp_intra_bytes_per_gpu"] = sum(p.intra_bytes for p in phases)
    return combine("hsdp_lion", c, phases, stream, own, k, extra)


def hsdp_adamw(
    d: float, c: Cluster, elem_bytes: int = 4, k: Kernels | None = None, f: Fsdp | None = None
) -> HsdpEstimate:
    """HSDP + AdamW (or Lion) as FSDP2 runs it: after the reduce-scatter inside the node,
    each rank all-reduces its d/L shard of the gradient with the M ranks holding the same
    shard, a ring of elem_bytes elements (2 (M-1)/M e d/L bytes, 2 (M-1) steps a unit);
    the node's L ranks share its link. A gradient of another dtype than the reduce-scatter's
    is cast to elem_bytes and back (streaming). AdamW's state: 2 fp32 elements a parameter."""
    f, k = f or Fsdp(), k or Kernels()
    m, lpn = c.nodes, c.gpus_per_node
    part = d / lpn
    phases, stream = fsdp_phases(d, c, f)
    per_rank, cross_s = 0.0, 0.0
    if m > 1:
        wire = ring_wire(m, part, elem_bytes)
        per_rank = wire["bytes"]
        cross = Phase(
            f"ring all-reduce of each rank's shard across nodes ({'fp32' if elem_bytes == 4 else 'bf16'})",
            inter_bytes=lpn * per_rank,
            inter_steps=f.units * wire["steps"],
        )
        phases.append(cross)
        cross_s = phase_time(cross, c)
        stream += wire["reduced_elems"] * 3 * elem_bytes
        if elem_bytes != f.reduce_bytes:
            stream += 2 * (f.reduce_bytes + elem_bytes) * part
    memory = hsdp_memory(d, c, 8 * part)
    extra = {"inter_bytes_per_rank": per_rank, "cross_node_s": cross_s, **memory}
    extra["fsdp_intra_bytes_per_gpu"] = sum(p.intra_bytes for p in phases)
    method = "hsdp_adamw_fp32" if elem_bytes == 4 else "hsdp_adamw_bf16"
    return combine(method, c, phases, stream, 0.0, k, extra)


def estimate_hsdp(d: float, c: Cluster, k: Kernels | None = None, f: Fsdp | None = None) -> list:
    """Every method of HSDP_METHODS, in its order: the same model sharded over each node's
    L GPUs, replicated over the M nodes. A different memory regime from estimate_all's
    (every rank holds 1/L of the parameters, gradient and state): compare them with each
    other; recommend() never picks one."""
    return [hsdp_lion(d, c, k, f), hsdp_adamw(d, c, 4, k, f), hsdp_adamw(d, c, 2, k, f)]


def estimate_all(d: float, c: Cluster, k: Kernels | None = None) -> list:
    """Every method of METHODS, in its order."""
    return [
        flat_vote(d, c, k),
        exact_hierarchical(d, c, k),
        node_vote(d, c, k),
        ring_allreduce(d, c, 4, k),
        ring_allreduce(d, c, 2, k),
        hierarchical_allreduce(d, c, 4, k),
        hierarchical_allreduce(d, c, 2, k),
    ]


def recommend(estimates: list) -> Estimate:
    """The fastest exact method. The node vote is approximate: never recommended; nor is an
    HSDP method (estimate_hsdp), another memory regime than the replicated methods."""
    return min((e for e in estimates if e.exact and not isinstance(e, HsdpEstimate)), key=lambda e: e.time_s)


# --- a whole step on measured GPU kernels: the gradient's exchange and the update -------

# Bytes of memory an optimizer's update moves per fp32 parameter, timed at the measured copy rate:
# a floor for torch's optimizers (its foreach Lion took about 4x its floor's time on an H100 and an
# H200, docs/cuda.md), so the comparison favours them. AdamW reads p, g, m, v and writes p, m, v;
# Lion reads p, g, m and writes p, m.
ADAMW_UPDATE_BYTES = 28
LION_UPDATE_BYTES = 20
# PowerSGD (a DDP comm hook; torch's rank-r compression with error feedback) on a transformer's
# matrices: the error added to the gradient (read 2, write 1), M Q and M^T P (M read twice), the
# low-rank product written back and the new error kept (read 1, write 2): 8 fp32 passes.
POWERSGD_BYTES = 32
POWERSGD_RANK = 4
# A transformer's width by its size (the GPT-3 family): PowerSGD's matrices are h x h and h x 4h.
TRANSFORMER_WIDTHS = ((125e6, 768), (350e6, 1024), (760e6, 1536), (1.3e9, 2048), (2.7e9, 2560),
                      (6.7e9, 4096), (13e9, 5120), (175e9, 12288))
# lionbit's row of each regime, against which report_step sets the others
LIONBIT_STEP = {"replicated": "distributed_lion", "HSDP": "hsdp_lion"}
STEP_METHODS = (
    # name, label, where its state lives
    ("distributed_lion", "DistributedLion", "replicated"),
    ("lion_bf16", "Lion + bf16 all-reduce", "replicated"),
    ("adamw_bf16", "AdamW + bf16 all-reduce", "replicated"),
    ("powersgd_adamw", "PowerSGD + AdamW", "replicated"),
    ("hsdp_lion", "HSDP + DistributedLion", "HSDP"),
    ("hsdp_adamw_bf16", "HSDP + AdamW, bf16", "HSDP"),
)


@dataclass
class StepEstimate:
    """One method's step after the backward pass: the gradient's exchange (an Estimate's time,
    its kernels included) and the optimizer's update, both on the measured GPU."""

    method: str
    label: str
    regime: str  # "replicated" (DDP) or "HSDP" (1/L of the state a rank): compare within one
    exchange: str  # the exchange's own label
    exchange_s: float
    update_s: float
    time_s: float
    inter_bytes_per_node: float


def transformer_width(d: float) -> int:
    """The width h of the GPT-3 family's model nearest d parameters (in log scale)."""
    return min(TRANSFORMER_WIDTHS, key=lambda row: abs(math.log(row[0] / d)))[1]


def powersgd_exchange(d: float, c: Cluster, k: Kernels, rank: int, width: int) -> tuple:
    """PowerSGD's two fp32 all-reduces (P, then Q) of a transformer's d parameters as layers of
    12 h^2 (four h x h and two h x 4h matrices): 9 r h elements each a layer, each on the faster
    of the ring and hierarchical all-reduce; plus its 8 passes over the gradient. Returns
    (seconds, bytes a node's link carries)."""
    elems = d / (12 * width * width) * 9 * rank * width
    one = min((ring_allreduce(elems, c, 4, k), hierarchical_allreduce(elems, c, 4, k)), key=lambda e: e.time_s)
    return 2 * one.time_s + k.stream_s(POWERSGD_BYTES * d), 2 * one.inter_bytes_per_node


def step_estimates(d: float, c: Cluster, rates: GpuRates, rank: int = POWERSGD_RANK, width: int = 0) -> list:
    """Every method of STEP_METHODS, in its order, on make gpu-check's measured kernels (fp32
    parameters, gradients and state; one exchange of the whole gradient, no overlap with the
    backward pass). DistributedLion takes the exact vote (flat or hierarchy="node") whose step is faster
    and its measured direction and apply kernels (a flat vote's apply from its result planes
    where the rates have that row); the all-reduces take NCCL's faster bf16 one."""
    k = Kernels.measured(rates)
    width = width or transformer_width(d)
    replicated = estimate_all(d, c, k)
    votes = [e for e in replicated if e.method in ("flat_vote", "exact_hierarchical")]

    def update(e: Estimate) -> float:  # a flat vote's apply reads its planes
        return d * rates.update_s(planes=e.method == "flat_vote")

    vote = min(votes, key=lambda e: e.time_s + update(e))  # the faster step, not the faster exchange
    bf16 = min((e for e in replicated if e.method in ("ring_bf16", "hierarchical_bf16")), key=lambda e: e.time_s)
    hsdp_lion_e, _, hsdp_bf16 = estimate_hsdp(d, c, k)
    lion_s = update(vote)
    psgd_s, psgd_bytes = powersgd_exchange(d, c, k, rank, width)
    adamw_s = k.stream_s(ADAMW_UPDATE_BYTES * d)
    part = 1 / c.gpus_per_node
    hsdp_lion_s = part * d * rates.update_s(planes=c.nodes > 1)  # the replicate vote is a flat one
    rows = {
        "distributed_lion": (vote.label, vote.time_s, lion_s, vote.inter_bytes_per_node),
        "lion_bf16": (bf16.label, bf16.time_s, k.stream_s(LION_UPDATE_BYTES * d), bf16.inter_bytes_per_node),
        "adamw_bf16": (bf16.label, bf16.time_s, adamw_s, bf16.inter_bytes_per_node),
        "powersgd_adamw": (f"rank {rank}, h = {width}", psgd_s, adamw_s, psgd_bytes),
        "hsdp_lion": (hsdp_lion_e.label, hsdp_lion_e.time_s, hsdp_lion_s, hsdp_lion_e.inter_bytes_per_node),
        "hsdp_adamw_bf16": (hsdp_bf16.label, hsdp_bf16.time_s, part * adamw_s, hsdp_bf16.inter_bytes_per_node),
    }
    out = []
    for name, label, regime in STEP_METHODS:
        exchange, exchange_s, update_s, inter = rows[name]
        out.append(StepEstimate(name, label, regime, exchange, exchange_s, update_s, exchange_s + update_s, inter))
    return out


def report_step(d: int, c: Cluster, rates: GpuRates, steps: list) -> str:
    lines = [
        f"A step after the backward pass on {rates.device}'s measured kernels ({rates.source}): the gradient's "
        f"exchange and the optimizer's update, fp32 parameters and state; {count_label(d)} parameters on "
        f"{c.nodes} x {c.gpus_per_node} GPUs, {rate_label(c.inter_bytes_per_s)} per node",
        "",
        f"{'method':<26} {'step ms':>10} {'exchange ms':>12} {'update ms':>10} {'inter GB per node':>18}  exchange",
    ]
    for e in steps:
        lines.append(
            f"{e.label:<26} {e.time_s * 1e3:>10,.1f} {e.exchange_s * 1e3:>12,.1f} {e.update_s * 1e3:>10,.1f} "
            f"{e.inter_bytes_per_node / 1e9:>18,.3f}  {e.exchange}"
        )
    for regime, method in LIONBIT_STEP.items():
        mine = next(e for e in steps if e.method == method)
        best = min((e for e in steps if e.regime == regime and e is not mine), key=lambda e: e.time_s)
        ratio = best.time_s / mine.time_s
        verdict = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        lines.append(
            f"{regime}: {mine.label} {mine.time_s * 1e3:,.1f} ms, {verdict} than the fastest other method, "
            f"{best.label} ({best.time_s * 1e3:,.1f} ms)"
        )
    lines.append(
        "updates at the measured copy rate for torch's optimizers (a floor), lionbit's at its measured kernels; "
        "PowerSGD is approximate (rank-r with error feedback), DistributedLion's vote is exact; compare HSDP rows "
        "with each other (1/L of the state a rank); time only: what each buys in quality is docs/benchmarks.md's"
    )
    return "\n".join(lines)


# --- input ----------------------------------------------------------------------------

RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]+)\s*$")
PREFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
COUNT_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """A link rate, per direction, to bytes/s. A lower-case b (or none) is bits, an
    upper-case B bytes: '100gbit', '100g', '100Gbps', '100Gb/s' are 12.5e9 bytes/s;
    '450GB/s', '450GBps' are 450e9 bytes/s; 'nvlink' is NVLink 4's 450 GB/s."""
    s = text.strip()
    if s.lower() == "nvlink":
        return NVLINK_BYTES_PER_S
    match = RATE_RE.match(s)
    unit = match.group(2) if match else ""
    prefix = unit[:1].lower()
    rest = unit[1:]
    in_bytes = rest.startswith("B") or rest.lower() == "byte/s"
    bits_units = ("", "bit", "bit/s", "b/s", "bps")
    byte_units = ("B", "B/s", "Bps", "byte/s")
    if not match or prefix not in PREFIXES or (rest not in byte_units and rest.lower() not in bits_units):
        raise ValueError(
            f"invalid rate {text!r}: give a number and a unit, for example 25gbit, 100gbit, 400gbit, "
            f"10g, 100Gbps (bits per second) or 450GB/s (bytes per second), or 'nvlink'"
        )
    value = float(match.group(1)) * PREFIXES[prefix]
    if value <= 0:
        raise ValueError(f"invalid rate {text!r}: must be more than 0")
    return value if in_bytes else value / 8


def rate_label(bytes_per_s: float) -> str:
    """12.5e9 -> '100 Gbit/s'; the NVLink rate in GB/s."""
    if bytes_per_s >= 100e9:
        return f"{bytes_per_s / 1e9:g} GB/s"
    bits = bytes_per_s * 8
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def parse_count(text: str) -> int:
    """A parameter count: '7e9', '7000000000', '7B', '1.3b', '125M' (decimal suffixes)."""
    s = text.strip()
    mult = COUNT_SUFFIXES.get(s[-1:].lower(), 1.0) if s[-1:].isalpha() else 1.0
    try:
        value = float(s[:-1] if mult != 1.0 else s) * mult
    except ValueError:
        value = float("nan")
    if not value >= 1 or math.isinf(value):
        raise ValueError(f"invalid parameter count {text!r}: give a number of at least 1, e.g. 7e9 or 7B")
    return int(round(value))


def count_label(d: float) -> str:
    """7e9 -> '7B', 1.3e9 -> '1.3B', 125e6 -> '125M'."""
    for mult, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if d >= mult:
            return f"{d / mult:.4g}{suffix}"
    return f"{d:g}"


def arg_type(parse):
    """An argparse type: the parser's ValueError as argparse's error naming the argument."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"invalid value {text!r}: must be a whole number of at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or math.isinf(value):
        raise ValueError(f"invalid value {text!r}: must be a number more than 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lionbit.estimate",
        description="Model one training step's gradient communication on M nodes of L GPUs, per method "
        "(lionbit's votes and NCCL-style all-reduces), and recommend the fastest exact one.",
        epilog="Every rate is per direction. The model and its assumptions: the docstring of lionbit/estimate.py.",
    )
    p.add_argument("--params", required=True, type=arg_type(parse_count), help="parameters: 7e9, 7B, 125M")
    p.add_argument("--nodes", required=True, type=arg_type(positive_int), help="number of nodes (M)")
    p.add_argument("--gpus-per-node", default=8, type=arg_type(positive_int), help="GPUs a node (L; 8)")
    p.add_argument(
        "--inter",
        required=True,
        type=arg_type(parse_rate),
        help="each node's network rate, shared by its GPUs: 25gbit, 100gbit, 400gbit, 10g",
    )
    p.add_argument(
        "--intra",
        default=NVLINK_BYTES_PER_S,
        type=arg_type(parse_rate),
        help="each GPU's rate inside the node (default nvlink: NVLink 4, 900 GB/s both ways = 450GB/s each way)",
    )
    p.add_argument(
        "--inter-latency-us",
        default=INTER_LATENCY_S * 1e6,
        type=arg_type(positive_float),
        help=f"latency of a step between nodes (default {INTER_LATENCY_S * 1e6:g})",
    )
    p.add_argument(
        "--intra-latency-us",
        default=INTRA_LATENCY_S * 1e6,
        type=arg_type(positive_float),
        help=f"latency of a step inside a node (default {INTRA_LATENCY_S * 1e6:g})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    h = p.add_argument_group(
        "HSDP", "FSDP2 sharding inside each node, replicas across nodes (a table of its own; see docs/fsdp.md)"
    )
    h.add_argument(
        "--hsdp",
        action="store_true",
        help="also model HSDP + DistributedLion and HSDP + AdamW (fp32, bf16 all-reduce across nodes)",
    )
    dtypes = {"fp32": 4, "bf16": 2}
    h.add_argument(
        "--fsdp-param-dtype",
        default="fp32",
        choices=dtypes,
        help="dtype of FSDP's all-gather of parameters inside the node (MixedPrecisionPolicy param_dtype; fp32)",
    )
    h.add_argument(
        "--fsdp-reduce-dtype",
        default="fp32",
        choices=dtypes,
        help="dtype of FSDP's reduce-scatter of gradients inside the node (reduce_dtype; fp32)",
    )
    h.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP keeps the parameters gathered from forward to backward: one all-gather a step, not two",
    )
    h.add_argument(
        "--fsdp-units",
        default=1,
        type=arg_type(positive_int),
        help="fully_shard units, each its own collectives and their latency (default 1)",
    )
    h.add_argument("--momentum-dtype", default="fp32", choices=dtypes, help="DistributedLion's momentum (fp32)")
    g = p.add_argument_group("measured GPU kernels", "make gpu-check's kernel rates instead of the assumed ones")
    g.add_argument(
        "--gpu-rates",
        metavar="FILE",
        type=arg_type(gpu_rates),
        help="a make gpu-check JSON (e.g. docs/benchmarks/gpu_check_h200_5.json): lionbit's kernels at its "
        "measured rates, the streaming ones at its device-to-device copy rate",
    )
    g.add_argument(
        "--step",
        action="store_true",
        help="with --gpu-rates: also a whole step (exchange + optimizer update) against Lion and AdamW on NCCL's "
        "bf16 all-reduce, PowerSGD and HSDP",
    )
    g.add_argument(
        "--powersgd-rank", default=POWERSGD_RANK, type=arg_type(positive_int), help="PowerSGD's rank (default 4)"
    )
    g.add_argument(
        "--width",
        default=0,
        type=arg_type(positive_int),
        help="the transformer's width h for PowerSGD's matrices (default: the GPT-3 model nearest --params)",
    )
    return p


def fsdp_config(a: argparse.Namespace) -> Fsdp:
    dtypes = {"fp32": 4, "bf16": 2}
    return Fsdp(
        param_bytes=dtypes[a.fsdp_param_dtype],
        reduce_bytes=dtypes[a.fsdp_reduce_dtype],
        reshard_after_forward=not a.no_reshard_after_forward,
        units=a.fsdp_units,
        momentum_bytes=dtypes[a.momentum_dtype],
    )


# --- output ---------------------------------------------------------------------------


def assumptions(c: Cluster, k: Kernels) -> str:
    links = (
        f"{c.inter_latency_s * 1e6:g} us a step between nodes, {c.intra_latency_s * 1e6:g} us inside a node, "
        f"{c.message_overhead_s * 1e6:g} us a further all-to-all message; the rates are goodput, one network link "
        f"a node, a non-blocking switch; no overlap with compute; vote ties left out"
    )
    if k.gpu is not None:
        return (
            f"GPU kernels as make gpu-check measured them on {k.gpu.device} ({k.gpu.source}; streaming ones at its "
            f"copy rate, {k.stream_bytes_per_s / 1e12:.2f} TB/s of memory traffic); assumptions (not measurements): "
            + links
        )
    return (
        f"assumptions (not measurements): GPU kernels at {k.stream_bytes_per_s / 1e12:.2f} TB/s (pack, unpack, "
        f"reductions) and {k.count_bytes_per_s / 1e12:.2f} TB/s (counting) of memory traffic "
        f"({STREAM_FRACTION:.0%} and {COUNT_FRACTION:.0%} of an H100's {GPU_MEMORY_BYTES_PER_S / 1e12:g} TB/s); "
        + links
    )


def report(d: int, c: Cluster, k: Kernels, estimates: list) -> str:
    best = recommend(estimates)
    lines = [
        f"lionbit.estimate: one step's gradient communication of {count_label(d)} parameters on "
        f"{c.nodes} node{'s' if c.nodes > 1 else ''} x {c.gpus_per_node} GPUs = {c.ranks} ranks",
        f"  between nodes {rate_label(c.inter_bytes_per_s)} per node, inside a node "
        f"{rate_label(c.intra_bytes_per_s)} per GPU (each direction)",
        "",
        f"{'method':<30} {'step comm ms':>13} {'inter-node GB per node':>23} {'intra-node GB per GPU':>22}"
        f"  {'bound':<21} from",
    ]
    for e in estimates:
        label = e.label if e.exact else e.label + " (approximate)"
        lines.append(
            f"{label:<30} {e.time_s * 1e3:>13,.1f} {e.inter_bytes_per_node / 1e9:>23,.3f} "
            f"{e.intra_bytes_per_gpu / 1e9:>22,.3f}  {e.bound:<21} {e.source}"
        )
    ring = next(e for e in estimates if e.method == "ring_fp32")
    lines += ["", f"recommended: {best.label}, {best.time_s * 1e3:,.1f} ms ({best.source})"]
    if best.method != "ring_fp32":
        lines[-1] += f", {ring.time_s / best.time_s:.1f}x faster than the fp32 ring all-reduce"
    if best.method == "exact_hierarchical":
        lines.append('  use it: lionbit.DistributedLion(..., hierarchy="node") (the flat vote\'s update, bit for bit)')
    for e in estimates:
        if not e.exact:
            lines.append(
                f"approximate: {e.label}, {e.time_s * 1e3:,.1f} ms: a majority of the nodes' majorities, not the "
                f"majority over all {c.ranks} ranks"
            )
    lines.append(assumptions(c, k))
    return "\n".join(lines)


def report_hsdp(c: Cluster, f: Fsdp, estimates: list) -> str:
    """The HSDP table: its rows compare with each other, not with the replicated methods."""
    names = {4: "fp32", 2: "bf16"}
    gathers = 2 if f.reshard_after_forward else 1
    lines = [
        f"HSDP (FSDP2, a (replicate, shard) mesh of {c.nodes} x {c.gpus_per_node}): each node one replica, "
        f"every rank 1/{c.gpus_per_node} of the parameters, gradient and optimizer state. Another memory regime: "
        "compare these rows with each other, not with the table above.",
        f"  inside the node, the same in every row: FSDP's all-gather of {names[f.param_bytes]} parameters x"
        f"{gathers}, reduce-scatter of {names[f.reduce_bytes]} gradients; {f.units} unit{'s' if f.units > 1 else ''}",
        "",
        f"{'method':<31} {'step comm ms':>13} {'between nodes ms':>17} {'inter GB per rank':>18} "
        f"{'inter GB per node':>18} {'intra GB per GPU':>17} {'opt. state GB per rank':>23}",
    ]
    for e in estimates:
        lines.append(
            f"{e.label:<31} {e.time_s * 1e3:>13,.1f} {e.cross_node_s * 1e3:>17,.1f} "
            f"{e.inter_bytes_per_rank / 1e9:>18,.3f} {e.inter_bytes_per_node / 1e9:>18,.3f} "
            f"{e.intra_bytes_per_gpu / 1e9:>17,.3f} {e.optimizer_state_bytes_per_rank / 1e9:>23,.3f}"
        )
    lion = next(e for e in estimates if e.method == "hsdp_lion")
    for e in estimates:
        if e is lion or lion.inter_bytes_per_rank == 0:
            continue
        lines.append(
            f"HSDP + DistributedLion against {e.label}: {e.inter_bytes_per_rank / lion.inter_bytes_per_rank:.1f}x "
            f"fewer bytes between nodes, {e.time_s / lion.time_s:.1f}x less step communication time "
            f"({e.time_s * 1e3:,.1f} ms against {lion.time_s * 1e3:,.1f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    c = Cluster(
        nodes=a.nodes,
        gpus_per_node=a.gpus_per_node,
        inter_bytes_per_s=a.inter,
        intra_bytes_per_s=a.intra,
        inter_latency_s=a.inter_latency_us * 1e-6,
        intra_latency_s=a.intra_latency_us * 1e-6,
    )
    if a.step and a.gpu_rates is None:
        parser().error(
            "--step needs --gpu-rates FILE: a make gpu-check JSON, e.g. docs/benchmarks/gpu_check_h200_5.json"
        )
    k = Kernels() if a.gpu_rates is None else Kernels.measured(a.gpu_rates)
    estimates = estimate_all(a.params, c, k)
    f = fsdp_config(a)
    hsdp = estimate_hsdp(a.params, c, k, f) if a.hsdp else []
    steps = step_estimates(a.params, c, a.gpu_rates, a.powersgd_rank, a.width) if a.step else []
    if a.json:
        doc = {
            "params": a.params,
            "cluster": asdict(c) | {"ranks": c.ranks},
            "kernels": asdict(k),
            "methods": [asdict(e) for e in estimates],
            "recommended": recommend(estimates).method,
            "assumptions": assumptions(c, k),
        }
        if a.hsdp:
            doc["hsdp"] = {"fsdp": asdict(f), "methods": [asdict(e) for e in hsdp]}
        if a.step:
            doc["step"] = [asdict(e) for e in steps]
        print(json.dumps(doc, indent=1))
    else:
        print(report(a.params, c, k, estimates))
        if a.hsdp:
            print("\n" + report_hsdp(c, f, hsdp))
        if a.step:
            print("\n" + report_step(a.params, c, a.gpu_rates, steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
