// The 1-bit sign reduce-scatter: phase 1 of the sign all-reduce alone, on a
// shard layout given by the caller (FSDP's, not the all-reduce's 64·N
// padding):
//   0. header round (the all-reduce's 72-byte header, flag kReduceScatter,
//      numel = N · shard elements), checked before anything else moves;
//   1. all-to-all of packed shards: rank k receives shard k of every rank's
//      direction bits (zero positions only from ranks whose shard k holds a
//      zero: a list of offsets when sparse, a plane when dense);
//   2. rank k counts and votes (or averages) its own shard and writes the
//      result into the caller's output. No phase 2: FSDP's next parameter
//      all-gather spreads what the result updates.
// Bytes per rank: (N − 1)/N · d/8 for d elements in all (plus headers).
#pragma once

#include <ATen/core/Tensor.h>

#include "backend/sign_allreduce.hpp"

namespace lionbit {

// Direction bits of the full local input, packed by the caller: N shards of
// `shard_numel` elements each; shard r's bits start at bit r · 64 ·
// words_for(shard_numel) of the planes (each shard starts on a word), laid out
// like bits::pack_signs. Bits past a shard's end are ignored.
//
// Levels (op l1, signbits/levels.h): `sign` holds value_bits planes, plane
// b at word b * N * words_for(shard_numel), each laid out like a
// sign plane; `zero` is unused.
struct PackedShards {
  at::Tensor sign; // uint8 planes on the device of the output
  at::Tensor zero; // undefined for levels
  uint64_t shard_numel;
  uint64_t nans; // NaNs the packer saw (an error on every rank if > 0)
  int value_bits = 0; // levels: p
};

// Bytes each plane must hold for `shard_numel` elements per shard on `world`
// ranks.
inline size_t reduce_scatter_plane_bytes(uint64_t shard_numel, int world) {
  return bits::words_for(static_cast<size_t>(shard_numel)) * 8 * static_cast<size_t>(world);
}

// Writes this rank's shard of vote / avg / sum / l1 of the N ranks'
// directions into `out` (contiguous, shard_numel elements, a supported
// dtype); a vote's or l1's ties follow `tie`. With `planes` (a vote:
// SignRequest::out_planes) `out` is uint8, the shard's sign plane then its
// zero plane, words_for(shard_numel) words each. Throws c10::Error naming
// lionbit, the op and the rank on any failure. `agreed` (or null): resolved
// by the header round (backend/agreement.hpp), before the shards move.
void sign_reduce_scatter_packed(
    const SignComm& c,
    const PackedShards& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::TieRule& tie,
    uint64_t seq,
    bool planes = false,
    Agreement* agreed = nullptr);

} // namespace lionbit
