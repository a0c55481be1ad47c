#include "backend/sign_allreduce.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "backend/bits/count.h"
#include "backend/bits/pack.h"
#include "backend/bits/unpack.h"
#include "backend/bits/zeros.h"

namespace lionbit {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the time spent in its scope to a counter.
class ScopedTimer {
 public:
  explicit ScopedTimer(std::atomic<uint64_t>& into)
      : into_(into), start_(Clock::now()) {}
  ~ScopedTimer() {
    into_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(
            Clock::now() - start_)
            .count());
  }

 private:
  std::atomic<uint64_t>& into_;
  Clock::time_point start_;
};

std::string where(const SignComm& c, bits::SignOp op) {
  return std::string("lionbit all_reduce_sign(op=") + bits::sign_op_name(op) +
      ") on rank " + std::to_string(c.rank) + ": ";
}

at::Tensor byte_buffer(size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

uint64_t* words_of(const at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

// Waits for an inner collective; a failure (a dead peer, a timeout) becomes
// an error naming lionbit, the op, the rank and the step.
void wait_inner(
    const SignComm& c,
    bits::SignOp op,
    const char* step,
    const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
  } catch (const c10::Error& e) {
    TORCH_CHECK_WITH(
        DistBackendError, false, where(c, op), "the ", step,
        " over the inner Gloo communicator failed: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK_WITH(
        DistBackendError, false, where(c, op), "the ", step,
        " over the inner Gloo communicator failed: ", e.what());
  }
}

// Ring all-gather: each rank sends and receives (N - 1) chunks.
void count_allgather(const SignComm& c, size_t chunk) {
  const uint64_t b = static_cast<uint64_t>(chunk) * (c.world_size - 1);
  c.stats->bytes_sent += b;
  c.stats->bytes_received += b;
}

bits::HeaderSummary header_round(
    const SignComm& c,
    bits::SignOp op,
    const bits::WireHeader& mine) {
  at::Tensor in = byte_buffer(sizeof(bits::WireHeader));
  std::memcpy(in.data_ptr<uint8_t>(), &mine, sizeof mine);
  at::Tensor out = byte_buffer(sizeof(bits::WireHeader) * c.world_size);
  {
    ScopedTimer t(c.stats->comm_ns);
    wait_inner(c, op, "header round", c.comm->_allgather_base(out, in));
  }
  count_allgather(c, sizeof(bits::WireHeader));
  return bits::check_headers(
      reinterpret_cast<const bits::WireHeader*>(out.data_ptr<uint8_t>()),
      c.world_size, mine);
}

bits::DType bits_dtype_or_throw(at::ScalarType t) {
  auto d = bits_dtype(t);
  TORCH_CHECK(d.has_value(), "unsupported dtype ", t);
  return *d;
}

// A table of 2^nplanes values of `dtype` for unpack().
std::vector<uint8_t> make_table(bits::DType dtype, const std::vector<double>& values) {
  std::vector<uint8_t> lut(values.size() * bits::dtype_size(dtype));
  bits::make_lut(dtype, values.data(), values.size(), lut.data());
  return lut;
}

} // namespace

std::optional<bits::DType> bits_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return bits::DType::kFloat32;
    case at::kHalf:
      return bits::DType::kFloat16;
    case at::kBFloat16:
      return bits::DType::kBFloat16;
    case at::kDouble:
      return bits::DType::kFloat64;
    case at::kChar:
      return bits::DType::kInt8;
    default:
      return std::nullopt;
  }
}

void sign_allreduce_reject(const SignComm& c, bits::SignOp op, uint64_t seq) {
  const auto mine = bits::make_header(
      op, bits::DType::kFloat32, c.rank, bits::kRejected, seq, 0);
  header_round(c, op, mine); // its error is the caller's own: ignore it
}

void sign_allreduce(
    const SignComm& c,
    at::Tensor& tensor,
    bits::SignOp op,
    uint64_t seq) {
  const int N = c.world_size;
  const bits::DType dtype = bits_dtype_or_throw(tensor.scalar_type());
  const size_t esize = bits::dtype_size(dtype);
  // Work on a contiguous buffer; for a non-contiguous input it is a copy and
  // the result is copied back at the end.
  at::Tensor buf = tensor.contiguous();
  const size_t n = static_cast<size_t>(buf.numel());
  const size_t sw = bits::shard_words(n, N); // words per shard
  const size_t sb = sw * sizeof(uint64_t); // bytes per shard plane
  const size_t total_words = sw * static_cast<size_t>(N);

  // Pack.
  at::Tensor sign_plane = byte_buffer(total_words * 8);
  at::Tensor zero_plane = byte_buffer(total_words * 8);
  bits::PackCounts counts;
  {
    ScopedTimer t(c.stats->pack_ns);
    counts = bits::pack_signs(
        dtype, buf.data_ptr(), n, words_of(sign_plane), words_of(zero_plane));
    // Padding elements: sign 0, zero 0 (they vote -1 on every rank; their
    // results are never unpacked).
    const size_t used = bits::words_for(n);
    std::memset(words_of(sign_plane) + used, 0, (total_words - used) * 8);
    std::memset(words_of(zero_plane) + used, 0, (total_words - used) * 8);
  }
  // The most zeros in any of this rank's shards: how its zero planes travel.
  uint64_t my_cap = 0;
  if (counts.zeros > 0) {
    ScopedTimer t(c.stats->pack_ns);
    for (int k = 0; k < N; ++k) {
      my_cap = std::max(my_cap, bits::count_bits(words_of(zero_plane) + k * sw, sw));
    }
  }
  uint32_t flags = 0;
  flags |= my_cap > 0 ? bits::kHasZero : 0u;
  flags |= counts.nans > 0 ? bits::kHasNan : 0u;

  // Header round: every rank learns every rank's size, dtype, op, order and
  // zero/NaN flags, and all raise together if they disagree.
  const auto mine = bits::make_header(op, dtype, c.rank, flags, seq, n, my_cap);
  const bits::HeaderSummary hs = header_round(c, op, mine);
  TORCH_CHECK_VALUE(hs.error.empty(), where(c, op), hs.error);
  c.stats->sign_allreduce_calls += 1;
  c.stats->elements += n;
  if (n == 0) {
    return;
  }

  // Phase 1: all-to-all of packed shards. Rank k gets [sign_k | zeros_k]
  // from every rank, zeros_k encoded as a list or a plane (zeros.h), absent
  // from ranks without zeros.
  const size_t my_zbytes = bits::zero_encoding_bytes(my_cap, sw);
  at::Tensor send = sign_plane;
  if (my_cap > 0) {
    ScopedTimer t(c.stats->pack_ns);
    send = byte_buffer(N * (sb + my_zbytes));
    uint8_t* s = send.data_ptr<uint8_t>();
    for (int k = 0; k < N; ++k) {
      std::memcpy(s, sign_plane.data_ptr<uint8_t>() + k * sb, sb);
      bits::encode_zeros(words_of(zero_plane) + k * sw, sw, my_cap, s + sb);
      s += sb + my_zbytes;
    }
  }
  std::vector<int64_t> in_splits(N, static_cast<int64_t>(sb + my_zbytes));
  std::vector<int64_t> out_splits(N);
  int64_t recv_total = 0;
  for (int j = 0; j < N; ++j) {
    out_splits[j] = static_cast<int64_t>(sb + bits::zero_encoding_bytes(hs.zero_capacity[j], sw));
    recv_total += out_splits[j];
  }
  at::Tensor recv = byte_buffer(static_cast<size_t>(recv_total));
  {
    ScopedTimer t(c.stats->comm_ns);
    // The inner backend may move from the split vectors: hand it copies.
    std::vector<int64_t> out_arg = out_splits, in_arg = in_splits;
    wait_inner(
        c, op, "all-to-all of packed signs (phase 1)",
        c.comm->alltoall_base(recv, send, out_arg, in_arg));
  }
  for (int j = 0; j < N; ++j) {
    if (j != c.rank) {
      c.stats->bytes_sent += static_cast<uint64_t>(in_splits[j]);
      c.stats->bytes_received += static_cast<uint64_t>(out_splits[j]);
    }
  }
  std::vector<bits::Contribution> in(N);
  at::Tensor decoded; // zero planes of ranks that sent lists
  {
    ScopedTimer t(c.stats->vote_ns);
    const uint8_t* p = recv.data_ptr<uint8_t>();
    for (int j = 0; j < N; ++j) {
      const uint64_t cap = hs.zero_capacity[j];
      in[j].sign = reinterpret_cast<const uint64_t*>(p);
      in[j].zero = cap > 0 ? reinterpret_cast<const uint64_t*>(p + sb) : nullptr;
      if (bits::zeros_as_list(cap, sw)) {
        if (!decoded.defined()) {
          decoded = byte_buffer(N * sb);
        }
        uint64_t* plane = words_of(decoded) + j * sw;
        TORCH_CHECK_VALUE(
            bits::decode_zeros(p + sb, sw, cap, plane), where(c, op), "rank ", j,
            " sent a corrupt list of zero positions in phase 1");
        in[j].zero = plane;
      }
      p += out_splits[j];
    }
  }

  // Phases 2 and 3: count and vote the own shard, all-gather the results,
  // unpack every shard into the buffer.
  std::vector<std::vector<const uint64_t*>> planes(N); // per shard
  std::vector<double> values;
  // Buffers the unpack reads from: they live until the end of the call.
  at::Tensor gathered, gathered_zero, tie_planes;
  if (op == bits::SignOp::kVote) {
    // Message: [number of ties in the shard][sign plane of the shard].
    const size_t msg = 8 + sb;
    at::Tensor mine_msg = byte_buffer(msg);
    at::Tensor mine_zero = byte_buffer(sb);
    {
      ScopedTimer t(c.stats->vote_ns);
      bits::vote(in.data(), N, sw, words_of(mine_msg) + 1, words_of(mine_zero));
      words_of(mine_msg)[0] = bits::count_bits(words_of(mine_zero), sw);
    }
    gathered = byte_buffer(msg * N);
    {
      ScopedTimer t(c.stats->comm_ns);
      wait_inner(
          c, op, "all-gather of voted shards (phase 2)",
          c.comm->_allgather_base(gathered, mine_msg));
    }
    count_allgather(c, msg);
    uint64_t tie_cap = 0;
    for (int k = 0; k < N; ++k) {
      const uint64_t ties = words_of(gathered)[k * msg / 8];
      TORCH_CHECK_VALUE(
          ties <= sw * bits::kWordBits, where(c, op), "rank ", k,
          " sent a corrupt vote message (", ties, " ties in a shard of ",
          sw * bits::kWordBits, " elements)");
      tie_cap = std::max(tie_cap, ties);
    }
    if (tie_cap > 0) {
      // Some shard has a tie (or an all-zero element): its tie positions are
      // needed everywhere, as a list or a plane. Only then is this round paid.
      const size_t zb = bits::zero_encoding_bytes(tie_cap, sw);
      at::Tensor mine_enc = byte_buffer(zb);
      bits::encode_zeros(words_of(mine_zero), sw, tie_cap, mine_enc.data_ptr<uint8_t>());
      gathered_zero = byte_buffer(zb * N);
      {
        ScopedTimer t(c.stats->comm_ns);
        wait_inner(
            c, op, "all-gather of tie positions (phase 2)",
            c.comm->_allgather_base(gathered_zero, mine_enc));
      }
      count_allgather(c, zb);
      if (bits::zeros_as_list(tie_cap, sw)) {
        ScopedTimer t(c.stats->unpack_ns);
        tie_planes = byte_buffer(sb * N);
        for (int k = 0; k < N; ++k) {
          TORCH_CHECK_VALUE(
              bits::decode_zeros(
                  gathered_zero.data_ptr<uint8_t>() + k * zb, sw, tie_cap,
                  words_of(tie_planes) + k * sw),
              where(c, op), "rank ", k, " sent a corrupt list of tie positions");
        }
      } else {
        tie_planes = gathered_zero;
      }
    }
    for (int k = 0; k < N; ++k) {
      planes[k].push_back(words_of(gathered) + k * msg / 8 + 1);
      if (tie_cap > 0) {
        planes[k].push_back(words_of(tie_planes) + k * sw);
      }
    }
    // code = sign bit + 2 * tie bit
    values = tie_cap > 0 ? std::vector<double>{-1, 1, 0, 0} : std::vector<double>{-1, 1};
  } else {
    const bool with_zeros = hs.any_zero;
    const int P = bits::code_planes(N, with_zeros);
    at::Tensor mine_code = byte_buffer(P * sb);
    {
      ScopedTimer t(c.stats->vote_ns);
      bits::count_code(in.data(), N, sw, words_of(mine_code));
    }
    gathered = byte_buffer(P * sb * N);
    {
      ScopedTimer t(c.stats->comm_ns);
      wait_inner(
          c, op, "all-gather of shard counts (phase 2)",
          c.comm->_allgather_base(gathered, mine_code));
    }
    count_allgather(c, P * sb);
    for (int k = 0; k < N; ++k) {
      for (int b = 0; b < P; ++b) {
        planes[k].push_back(words_of(gathered) + (static_cast<size_t>(k) * P + b) * sw);
      }
    }
    // code -> Sum; codes that cannot occur map to 0.
    values.resize(size_t{1} << P);
    for (size_t code = 0; code < values.size(); ++code) {
      const int64_t c64 = static_cast<int64_t>(code);
      const int64_t sum = with_zeros ? c64 - N : 2 * c64 - N;
      if (sum < -N || sum > N) {
        values[code] = 0;
      } else {
        values[code] = op == bits::SignOp::kSum
            ? static_cast<double>(sum)
            : static_cast<double>(sum) / static_cast<double>(N);
      }
    }
  }
  TORCH_CHECK(
      static_cast<int>(planes[0].size()) <= bits::kMaxUnpackPlanes,
      where(c, op), "world size ", N, " is too large for op ",
      bits::sign_op_name(op));
  {
    ScopedTimer t(c.stats->unpack_ns);
    const std::vector<uint8_t> lut = make_table(dtype, values);
    const size_t per_shard = sw * bits::kWordBits;
    uint8_t* dst = static_cast<uint8_t*>(buf.data_ptr());
    for (int k = 0; k < N; ++k) {
      const size_t begin = static_cast<size_t>(k) * per_shard;
      if (begin >= n) {
        break;
      }
      const size_t count = std::min(per_shard, n - begin);
      bits::unpack(
          dtype, planes[k].data(), static_cast<int>(planes[k].size()), count,
          lut.data(), dst + begin * esize);
    }
    if (!buf.is_same(tensor)) {
      tensor.copy_(buf);
    }
  }
}

} // namespace lionbit
