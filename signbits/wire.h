// The wire format of the sign all-reduce's header round, and the checks made
// on what peers send before any of it is used. No torch here.
//
// Trust model: like Gloo and NCCL, the transport is not authenticated; a
// peer is trusted not to be hostile, but nothing it sends is used before it
// has been checked, so a corrupt or mismatched header gives an error on every
// rank instead of memory corruption or a hang (a zero code addressed to one
// rank is checked there: see check_headers).
#pragma once

#include <string>
#include <vector>

#include "signbits/ties.h"
#include "signbits/zeros.h"
#include "types.h"

namespace lionbit::bits {

enum class SignOp : uint8_t {
  kVote = 1,
  kAvg = 2,
  kSum = 3,
  // Lion Cub's L1 aggregation: every rank sends p-bit values (levels.h),
  // the owner votes their sum; phase 2 is a vote's.
  kLevels = 4,
};

const char* sign_op_name(SignOp op);

constexpr uint32_t kWireMagic = 0x3153424cu; // "LBS1"
// 5: a vote's inline-tie phase 2 in base 3 (trits.h). 6: avg / sum with a
// few zeros send the zero-free count planes and a list of the elements with
// a zero, not the zero-aware code's extra plane. 7: the tie rule and the
// levels' bits in the header (64 bytes). 8: a vote's phase 2 carries the
// result's zeros under every tie rule (elements every rank voted 0 for stay
// 0, ties.h); the sign-plane-only format of version 7 is gone. 9: the
// hierarchy flags (kHierExact, kHierNodeVote). 10: at two ranks an
// all-reduce exchanges the ranks' whole planes (each rank votes every shard
// itself) unless kTwoPhase. 11: there, the first round announces one chunk;
// half of the chunks after it carry signs only and move while the rest is
// packed; the second round then gives the rest's zero capacities, and those
// chunks' zeros follow in one message of their own. 12: zeros announced
// with their runs (zero_runs); a plane of zeros may travel as runs (zeros.h).
// 13: and with their packed runs' bytes (zero_packed, packed_runs.h); the
// header is 72 bytes. 14: the header round is an all-to-all, and the zero
// code in each header is that of what its sender sends its receiver (a
// rank whose zeros sit in one shard sends the others signs alone); the most
// zeros of any shard travel beside it (zero_most) for what every rank must
// agree on. A vote's tie round sends each owner's ties at their own size.
constexpr uint16_t kWireVersion = 14;

enum WireFlags : uint32_t {
  kHasZero = 1u << 0, // this rank's input holds a zero: it sends a zero plane
  kHasNan = 1u << 1, // this rank's input holds a NaN
  kRejected = 1u << 2, // this rank rejected the call locally (bad argument)
  // The call is a sign reduce-scatter (phase 1 only: each rank gets its own
  // shard's result), not an all-reduce; numel is then N * the shard size.
  kReduceScatter = 1u << 3,
  kDevice = 1u << 4, // this rank's tensor is on a GPU: its data moves over
                     // the device transport (every rank must agree)
  // Vote: this rank expects ties (its last vote had a dense tie plane). The
  // phase-2 messages carry the tie plane inline, saving the separate tie
  // round, iff every rank sets it (HeaderSummary::inline_ties).
  kTieHint = 1u << 5,
  // The call runs over the cluster's two levels (backend/sign_hierarchy.hpp):
  // exactly (the flat result, bit for bit) or as a vote of node votes. Every
  // rank must agree; neither flag: flat.
  kHierExact = 1u << 6,
  kHierNodeVote = 1u << 7,
  // Two ranks: run the two phases, not the exchange (LIONBIT_SIGN_EXCHANGE=0;
  // the same result bit for bit, more bytes). Every rank must agree.
  kTwoPhase = 1u << 8,
};

// 72 bytes, little-endian (x86-64 and aarch64 both are).
struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t op;
  uint8_t dtype;
  uint32_t rank;
  uint32_t flags;
  uint64_t seq;
  uint64_t numel;
  // Addressed to the header's receiver (each rank sends every rank a header
  // of its own): the most zeros in what this rank sends it in phase 1 (its
  // shard of any chunk; at two ranks' exchange, any shard): with zero_runs
  // and zero_packed, the code of the zero encoding in those messages
  // (zeros.h). At most zero_most (unless that is saturated).
  uint64_t zero_capacity;
  // Elements per pipelined chunk (a multiple of 64 * world size); every rank
  // must use the same.
  uint64_t chunk_elems;
  // The tie rule (ties.h): every rank must use the same.
  uint64_t tie_seed;
  uint8_t tie_break;
  uint8_t value_bits; // kLevels: p; otherwise 0
  uint8_t reserved[2];
  // Addressed like zero_capacity: the most runs of zeros in what the
  // receiver gets (saturated at 2^32 - 1, where shards are too large for
  // runs anyway): at most zero_capacity, 0 iff it is 0.
  uint32_t zero_runs;
  // Addressed like zero_capacity: the most bytes of those zeros as packed
  // runs (a multiple of 8 below the shard's plane), or 0 where not every
  // shard offers them.
  uint32_t zero_packed;
  // The same in every header of a round: the most zeros in any one shard of
  // any chunk of this rank's input (saturated at 2^32 - 1), 0 iff kHasZero
  // is clear. What every rank must agree on reads this (the count formats
  // of phase 2), never the addressed code.
  uint32_t zero_most;
};
static_assert(sizeof(WireHeader) == 72, "WireHeader must be 72 bytes");

// What a call computes beyond its op: the tie rule (vote, levels) and the
// levels' bits (kLevels).
struct CallRule {
  TieRule tie;
  int value_bits = 0;
};

// The header of a call whose zeros are `zeros` (the most in any shard), to
// be addressed (address_header) to each receiver; as it is, it announces
// `zeros` to every receiver.
WireHeader make_header(
    SignOp op,
    DType dtype,
    int rank,
    uint32_t flags,
    uint64_t seq,
    uint64_t numel,
    const ZeroCode& zeros = {},
    uint64_t chunk_elems = 0,
    const CallRule& rule = {});

// `h` addressed to a receiver that gets zeros of code `to` (at most the
// header's zero_most zeros, runs and packed bytes within those of make_header's
// `zeros`).
WireHeader address_header(const WireHeader& h, const ZeroCode& to);

// Largest element count the sign path accepts (keeps all size arithmetic far
// from overflow).
constexpr uint64_t kMaxNumel = 1ull << 48;

// What the header round tells every rank, once every header has been checked.
// What a failed header round means, for the code that acts on it (the
// message in HeaderSummary::error is for people). Values are not on the wire.
enum class HeaderVerdict : uint8_t {
  kAgree = 0, // no error
  kFault, // a corrupt header, or ranks that disagree on the call: a bug or a mismatch
  kRejected, // ranks that rejected their own arguments (they raised there); `ranks` names them
  kNonFinite, // NaN (a Lion direction: NaN or +-Inf) on the ranks `ranks`
};

struct HeaderSummary {
  std::string error; // empty: all headers agree and are well formed
  HeaderVerdict verdict = HeaderVerdict::kAgree;
  std::vector<int> ranks; // kRejected, kNonFinite: the ranks it names
  // Per rank r: the code of the zeros r sends this rank (zeros 0: none).
  std::vector<ZeroCode> zero_codes;
  // Per rank r: the most zeros in any shard of r's input (saturated at
  // 2^32 - 1): the same on every rank.
  std::vector<uint64_t> zero_most;
  // Per rank r: the code of the zeros this rank sends r (its own headers';
  // filled by the round, not by check_headers).
  std::vector<ZeroCode> sent;
  bool any_zero = false;
  bool inline_ties = false; // every rank set kTieHint
};

// Elements per chunk for a tensor of numel elements: `requested` rounded up
// to a multiple of 64 * world_size (at least one such unit).
uint64_t chunk_elems_for(uint64_t requested, int world_size);

// The chunk size asked for when LIONBIT_CHUNK_ELEMS is not set: 4M elements,
// and at least 256K per rank's shard (so 4M up to N = 16). Each chunk pays
// two all-gathers of N - 1 steps: with a fixed chunk, a large N would cut the
// shards into messages so small that latency dominates (bench/cost_model.py
// models it). On a GPU (`gpu`) 256M: a chunk's fixed host cost (kernel
// launches and host round trips for its tallies: about 1 ms on an H200) is
// paid per chunk, while its kernels take microseconds and one NCCL stream
// carries its messages in turn, so smaller chunks overlap nothing; at 4M a
// 1B-parameter step paid 240 of them, at 64M 16. A chunk in flight holds a
// few plane-sized device buffers (its planes, the all-to-all's and the
// all-gather's): 32 MB each at 256M elements.
uint64_t default_chunk_elems(int world_size, bool gpu = false);

// Checks the headers of all world_size ranks (zero codes against the
// shard size of the largest chunk) (headers[r] came from rank r)
// against each other and against this rank's own header `mine` (any of its
// addressed headers). Every check but the addressed zero codes' sees the
// same on every rank, so all ranks fail together; an addressed code is
// checked where it arrives (only a bug in its sender, or memory corrupted on
// the way, makes one wrong: the transport is trusted, see above).
// `names`: how the error and `ranks` name rank r, names[r] (the caller's
// numbering of its ranks, world_size of them: lionbit's backend passes their
// global ranks); empty: r itself.
HeaderSummary check_headers(
    const WireHeader* headers,
    int world_size,
    const WireHeader& mine,
    const std::vector<int>& names = {});

} // namespace lionbit::bits
