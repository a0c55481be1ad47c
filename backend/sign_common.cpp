#include "backend/sign_common.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace lionbit {

std::string where(const SignComm& c, bits::SignOp op) {
  return std::string("lionbit all_reduce_sign(op=") + bits::sign_op_name(op) +
      ") on rank " + std::to_string(c.rank) + ": ";
}

at::Tensor byte_buffer(size_t n) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte));
}

uint64_t requested_chunk_elems(int world_size) {
  const char* env = std::getenv("LIONBIT_CHUNK_ELEMS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end != nullptr && *end == '\0' && v > 0) {
      return v;
    }
  }
  return bits::default_chunk_elems(world_size);
}

void wait_inner(
    const SignComm& c,
    bits::SignOp op,
    const char* step,
    const c10::intrusive_ptr<c10d::Work>& work) {
  ScopedTimer t(c.stats->comm_ns);
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
  std::memcpy(bytes_of(in), &mine, sizeof mine);
  at::Tensor out = byte_buffer(sizeof(bits::WireHeader) * c.world_size);
  wait_inner(c, op, "header round", c.comm->_allgather_base(out, in));
  count_allgather(c, sizeof(bits::WireHeader));
  return bits::check_headers(
      reinterpret_cast<const bits::WireHeader*>(bytes_of(out)), c.world_size, mine);
}

std::vector<double> count_code_values(bits::SignOp op, int N, bool with_zeros, int planes) {
  std::vector<double> values(size_t{1} << planes);
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
  return values;
}

} // namespace lionbit
