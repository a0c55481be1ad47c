#include "backend/sign_reduce_scatter.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "signbits/count.h"
#include "signbits/unpack.h"
#include "signbits/zeros.h"
#include "backend/phase1.hpp"
#include "backend/phase2.hpp"
#include "backend/sign_common.hpp"

namespace lionbit {
namespace {

// Per-element values of the result codes (bit b of the code = plane b).
std::vector<double> code_values(bits::SignOp op, int N, bool with_zeros, int planes) {
  if (op == bits::SignOp::kVote || op == bits::SignOp::kLevels) {
    return {-1, 1, 0, 0}; // sign bit + 2 * zero bit (Phase2::vote_shard)
  }
  return count_code_values(op, N, with_zeros, planes);
}

} // namespace

void sign_reduce_scatter_packed(
    const SignComm& c,
    const PackedShards& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::TieRule& tie,
    uint64_t seq,
    bool planes,
    Agreement* agreed) {
  const SignCall call{c, op, Collective::kReduceScatter, seq, out.device()};
  const KernelSet& k = *call.k;
  const bool levels = op == bits::SignOp::kLevels;
  const int p = levels ? in.value_bits : 1; // planes per shard
  const int N = c.world_size;
  TORCH_CHECK(
      !planes || op == bits::SignOp::kVote, where(call), "internal: result planes of a vote only");
  // The result as planes: announced as bfloat16 values (-1, 0, +1), as the all-reduce's.
  const auto dt = planes ? std::optional<bits::DType>(bits::DType::kBFloat16)
                         : bits_dtype(out.scalar_type());
  TORCH_CHECK(dt.has_value(), where(call), "unsupported dtype ", out.scalar_type());
  const size_t S = static_cast<size_t>(in.shard_numel);
  const size_t sw = bits::words_for(S);
  const int64_t sb = static_cast<int64_t>(sw * 8);
  TORCH_CHECK(
      static_cast<int64_t>(out.numel()) == (planes ? 2 * sb : static_cast<int64_t>(S)) &&
          out.is_contiguous(),
      where(call), "output must be contiguous with ",
      planes ? c10::str(2 * sb, " bytes (two planes)") : c10::str(S, " elements"));

  // This rank's planes, shard k at words [k * sw, (k + 1) * sw), cleaned
  // shard by shard (KernelSet::clean). Levels: shard k's p planes one after
  // the other at words [k * p * sw, (k + 1) * p * sw), bits past the shard's
  // end cleared (level 0).
  at::Tensor sign = call.bytes(static_cast<size_t>(N * sb * p));
  at::Tensor zero = levels ? at::Tensor() : call.bytes(static_cast<size_t>(N * sb));
  bits::ZeroCode zero_code;
  std::vector<bits::ZeroCode> to; // shard k's code goes to rank k
  if (levels && sb > 0) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    const unsigned tail = static_cast<unsigned>(S % bits::kWordBits);
    const int64_t mask = static_cast<int64_t>((uint64_t{1} << tail) - 1);
    for (int r = 0; r < N; ++r) {
      for (int b = 0; b < p; ++b) {
        at::Tensor dst = sign.narrow(0, (static_cast<int64_t>(r) * p + b) * sb, sb);
        dst.copy_(in.sign.narrow(0, (static_cast<int64_t>(b) * N + r) * sb, sb));
        if (tail != 0) {
          dst.view(at::kLong).narrow(0, static_cast<int64_t>(sw) - 1, 1).bitwise_and_(mask);
        }
      }
    }
  } else if (sb > 0) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    sign.copy_(in.sign.narrow(0, 0, N * sb));
    zero.copy_(in.zero.narrow(0, 0, N * sb));
    for (int r = 0; r < N; ++r) {
      at::Tensor s = sign.narrow(0, r * sb, sb);
      at::Tensor z = zero.narrow(0, r * sb, sb);
      k.clean(s, z, S);
    }
    to = k.zero_codes(zero, sw);
    zero_code = bits::max_code(to);
  }

  // 0. Header round: same call, op, dtype and shard size everywhere; NaN and
  //    local rejections raise on every rank.
  const auto mine = bits::make_header(
      op, *dt, c.rank, bits::kReduceScatter | header_flags(call, zero_code.zeros, in.nans), seq,
      static_cast<uint64_t>(S) * N, zero_code, 0, bits::CallRule{tie, levels ? p : 0});
  const bits::HeaderSummary hs = header_round(call, mine, to);
  if (agreed != nullptr) {
    agreed->agree(true); // every rank agreed: what follows can fail only for a fault
  }
  c.stats->sign_reduce_scatter_calls += 1;
  c.stats->elements += static_cast<uint64_t>(S) * N;
  if (S == 0) {
    return;
  }

  // 1. All-to-all: rank k gets every rank's shard k.
  Phase1 p1 = send_shards(call, hs, sign, zero, sw * p);
  wait_shards(call, p1);
  sign = zero = at::Tensor();
  at::Tensor decoded;
  const std::vector<PlaneIn> contrib = receive_shards(call, hs, p1, decoded);

  // 2. Count / vote the own shard.
  std::vector<at::Tensor> result; // the result's code planes
  {
    ScopedTimer t(c.stats->vote_ns, "lionbit::count");
    if (op == bits::SignOp::kVote || levels) {
      // Into the result's own planes, or planes to unpack.
      at::Tensor s_plane = planes ? out.narrow(0, 0, sb) : call.bytes(static_cast<size_t>(sb));
      at::Tensor z_plane = planes ? out.narrow(0, sb, sb) : call.bytes(static_cast<size_t>(sb));
      Phase2::vote_shard(
          k, op, bits::CallRule{tie, levels ? p : 0}, contrib, static_cast<uint64_t>(c.rank) * sw,
          s_plane, z_plane);
      if (planes) {
        s_plane.bitwise_and_(z_plane.bitwise_not()); // a 0 is a zero bit alone, as the all-reduce's
      }
      result = {s_plane, z_plane};
    } else {
      const int P = bits::code_planes(N, hs.any_zero);
      TORCH_CHECK(
          P <= bits::kMaxUnpackPlanes, where(call), "world size ", N, " is too large for op ",
          bits::sign_op_name(op));
      at::Tensor codes = call.bytes(static_cast<size_t>(P * sb));
      k.count_code(contrib, codes);
      for (int b = 0; b < P; ++b) {
        result.push_back(codes.narrow(0, b * sb, sb));
      }
    }
  }
  p1 = Phase1();
  decoded = at::Tensor();

  if (planes) {
    return; // the vote's planes are the result
  }
  // 3. Unpack the own shard's result into the output.
  ScopedTimer t(c.stats->unpack_ns, "lionbit::unpack");
  const auto values = code_values(op, N, hs.any_zero, static_cast<int>(result.size()));
  at::Tensor flat = out.view({-1});
  k.unpack(result, lut_tensor(*dt, values, call.device), flat);
}

} // namespace lionbit
