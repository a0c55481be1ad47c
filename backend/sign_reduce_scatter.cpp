#include "backend/sign_reduce_scatter.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "backend/bits/count.h"
#include "backend/bits/unpack.h"
#include "backend/bits/zeros.h"
#include "backend/sign_common.hpp"

namespace lionbit {
namespace {

std::string rs_where(const SignComm& c, bits::SignOp op) {
  return std::string("lionbit reduce_scatter_sign(op=") + bits::sign_op_name(op) +
      ") on rank " + std::to_string(c.rank) + ": ";
}

// Per-element values of the result codes (bit b of the code = plane b).
std::vector<double> code_values(bits::SignOp op, int N, bool with_zeros, int planes) {
  if (op == bits::SignOp::kVote) {
    return {-1, 1, 0, 0}; // sign bit + 2 * tie bit
  }
  return count_code_values(op, N, with_zeros, planes);
}

} // namespace

void sign_reduce_scatter_reject(const SignComm& c, bits::SignOp op, uint64_t seq) {
  const auto mine = bits::make_header(
      op, bits::DType::kFloat32, c.rank, bits::kRejected | bits::kReduceScatter, seq, 0, 0, 0);
  header_round(c, op, mine); // its error is the caller's own: ignore it
}

void sign_reduce_scatter_packed(
    const SignComm& c,
    const PackedShards& in,
    at::Tensor& out,
    bits::SignOp op,
    uint64_t seq) {
  const int N = c.world_size;
  const auto dt = bits_dtype(out.scalar_type());
  TORCH_CHECK(dt.has_value(), rs_where(c, op), "unsupported dtype ", out.scalar_type());
  const size_t S = static_cast<size_t>(in.shard_numel);
  TORCH_CHECK(
      static_cast<size_t>(out.numel()) == S && out.is_contiguous(), rs_where(c, op),
      "output must be contiguous with ", S, " elements");
  const size_t sw = bits::words_for(S);
  const size_t sb = sw * 8;

  // 1. This rank's planes: shard k at words [k * sw, (k + 1) * sw). Bits past
  //    a shard's end are cleared (not the caller's promise); a zero bit wins
  //    over a sign bit.
  at::Tensor sign = byte_buffer(N * sb);
  at::Tensor zero = byte_buffer(N * sb);
  uint64_t zero_cap = 0;
  {
    ScopedTimer t(c.stats->pack_ns);
    if (sb > 0) {
      std::memcpy(bytes_of(sign), in.sign, N * sb);
      std::memcpy(bytes_of(zero), in.zero, N * sb);
    }
    uint64_t* s = words_of(sign);
    uint64_t* z = words_of(zero);
    const unsigned tail = static_cast<unsigned>(S % bits::kWordBits);
    for (int k = 0; k < N; ++k) {
      uint64_t* sk = s + k * sw;
      uint64_t* zk = z + k * sw;
      if (tail != 0) {
        sk[sw - 1] &= (uint64_t{1} << tail) - 1;
        zk[sw - 1] &= (uint64_t{1} << tail) - 1;
      }
      for (size_t w = 0; w < sw; ++w) {
        sk[w] &= ~zk[w];
      }
      zero_cap = std::max(zero_cap, bits::count_bits(zk, sw));
    }
  }

  // 0. Header round: same call, op, dtype and shard size everywhere; NaN and
  //    local rejections raise on every rank.
  uint32_t flags = bits::kReduceScatter;
  flags |= zero_cap > 0 ? bits::kHasZero : 0u;
  flags |= in.nans > 0 ? bits::kHasNan : 0u;
  const auto mine = bits::make_header(
      op, *dt, c.rank, flags, seq, static_cast<uint64_t>(S) * N, zero_cap, 0);
  const bits::HeaderSummary hs = header_round(c, op, mine);
  TORCH_CHECK_VALUE(hs.error.empty(), rs_where(c, op), hs.error);
  c.stats->sign_reduce_scatter_calls += 1;
  c.stats->elements += static_cast<uint64_t>(S) * N;
  if (S == 0) {
    return;
  }

  // 1. All-to-all: rank k gets [sign_k | zeros_k] from every rank.
  const size_t my_zbytes = bits::zero_encoding_bytes(zero_cap, sw);
  at::Tensor send = sign;
  if (zero_cap > 0) {
    ScopedTimer t(c.stats->pack_ns);
    send = byte_buffer(N * (sb + my_zbytes));
    uint8_t* p = bytes_of(send);
    for (int k = 0; k < N; ++k) {
      std::memcpy(p, bytes_of(sign) + k * sb, sb);
      bits::encode_zeros(words_of(zero) + k * sw, sw, zero_cap, p + sb);
      p += sb + my_zbytes;
    }
  }
  std::vector<int64_t> in_splits(N, static_cast<int64_t>(sb + my_zbytes));
  std::vector<int64_t> out_splits(N);
  int64_t recv_total = 0;
  for (int j = 0; j < N; ++j) {
    out_splits[j] = static_cast<int64_t>(sb + bits::zero_encoding_bytes(hs.zero_capacity[j], sw));
    recv_total += out_splits[j];
    if (j != c.rank) {
      c.stats->bytes_sent += static_cast<uint64_t>(in_splits[j]);
      c.stats->bytes_received += static_cast<uint64_t>(out_splits[j]);
    }
  }
  at::Tensor recv = byte_buffer(static_cast<size_t>(recv_total));
  {
    std::vector<int64_t> out_arg = out_splits; // the inner backend may move from them
    c10::intrusive_ptr<c10d::Work> a2a;
    {
      ScopedTimer t(c.stats->comm_ns);
      a2a = c.comm->alltoall_base(recv, send, out_arg, in_splits);
    }
    wait_inner(c, op, "all-to-all of packed signs (reduce-scatter)", a2a);
  }
  send = at::Tensor();
  sign = at::Tensor();
  zero = at::Tensor();

  // 2. Count / vote the own shard.
  std::vector<bits::Contribution> contrib(N);
  at::Tensor decoded;
  at::Tensor planes_buf;
  std::vector<const uint64_t*> planes;
  {
    ScopedTimer t(c.stats->vote_ns);
    const uint8_t* p = bytes_of(recv);
    for (int j = 0; j < N; ++j) {
      const uint64_t cap = hs.zero_capacity[j];
      contrib[j].sign = reinterpret_cast<const uint64_t*>(p);
      contrib[j].zero = cap > 0 ? reinterpret_cast<const uint64_t*>(p + sb) : nullptr;
      if (bits::zeros_as_list(cap, sw)) {
        if (!decoded.defined()) {
          decoded = byte_buffer(N * sb);
        }
        uint64_t* plane = words_of(decoded) + j * sw;
        TORCH_CHECK_VALUE(
            bits::decode_zeros(p + sb, sw, cap, plane), rs_where(c, op), "rank ", j,
            " sent a corrupt list of zero positions");
        contrib[j].zero = plane;
      }
      p += out_splits[j];
    }
    if (op == bits::SignOp::kVote) {
      planes_buf = byte_buffer(2 * sb);
      bits::vote(contrib.data(), N, sw, words_of(planes_buf), words_of(planes_buf) + sw);
      planes = {words_of(planes_buf), words_of(planes_buf) + sw};
    } else {
      const int P = bits::code_planes(N, hs.any_zero);
      TORCH_CHECK(
          P <= bits::kMaxUnpackPlanes, rs_where(c, op), "world size ", N,
          " is too large for op ", bits::sign_op_name(op));
      planes_buf = byte_buffer(static_cast<size_t>(P) * sb);
      bits::count_code(contrib.data(), N, sw, words_of(planes_buf));
      for (int b = 0; b < P; ++b) {
        planes.push_back(words_of(planes_buf) + static_cast<size_t>(b) * sw);
      }
    }
  }
  recv = at::Tensor();
  decoded = at::Tensor();

  // 3. Unpack the own shard's result into the output.
  ScopedTimer t(c.stats->unpack_ns);
  const auto values = code_values(op, N, hs.any_zero, static_cast<int>(planes.size()));
  std::vector<uint8_t> lut(values.size() * bits::dtype_size(*dt));
  bits::make_lut(*dt, values.data(), values.size(), lut.data());
  bits::unpack(*dt, planes.data(), static_cast<int>(planes.size()), S, lut.data(), out.data_ptr());
}

} // namespace lionbit
