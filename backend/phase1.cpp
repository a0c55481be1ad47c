#include "backend/phase1.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "signbits/count.h"
#include "signbits/zeros.h"

namespace lionbit {

void clean_planes(uint64_t* sign, uint64_t* zero, size_t words, size_t n) {
  const size_t used = std::min(words, bits::words_for(n));
  const unsigned tail = static_cast<unsigned>(n % bits::kWordBits);
  if (tail != 0 && used == bits::words_for(n)) {
    sign[used - 1] &= (uint64_t{1} << tail) - 1;
    zero[used - 1] &= (uint64_t{1} << tail) - 1;
  }
  if (words > used) {
    std::memset(sign + used, 0, (words - used) * 8);
    std::memset(zero + used, 0, (words - used) * 8);
  }
  for (size_t w = 0; w < used; ++w) {
    sign[w] &= ~zero[w];
  }
}

uint64_t max_shard_zeros(const uint64_t* zero, int N, size_t sw) {
  uint64_t most = 0;
  for (int k = 0; k < N; ++k) {
    most = std::max(most, bits::count_bits(zero + k * sw, sw));
  }
  return most;
}

Phase1 send_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    size_t sw) {
  const SignComm& c = call.c;
  const int N = c.world_size;
  const size_t sb = sw * 8;
  const uint64_t my_cap = hs.zero_capacity[c.rank];
  const size_t my_zbytes = bits::zero_encoding_bytes(my_cap, sw);
  at::Tensor send = sign;
  if (my_cap > 0) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    send = byte_buffer(N * (sb + my_zbytes));
    uint8_t* s = bytes_of(send);
    for (int k = 0; k < N; ++k) {
      std::memcpy(s, bytes_of(sign) + k * sb, sb);
      bits::encode_zeros(words_of(zero) + k * sw, sw, my_cap, s + sb);
      s += sb + my_zbytes;
    }
  }
  Phase1 p;
  p.sw = sw;
  std::vector<int64_t> send_splits(N, static_cast<int64_t>(sb + my_zbytes));
  p.recv_splits.resize(N);
  int64_t recv_total = 0;
  for (int j = 0; j < N; ++j) {
    p.recv_splits[j] = static_cast<int64_t>(
        sb + bits::zero_encoding_bytes(hs.zero_capacity[j], sw));
    recv_total += p.recv_splits[j];
    if (j != c.rank) {
      c.stats->bytes_sent += static_cast<uint64_t>(send_splits[j]);
      c.stats->bytes_received += static_cast<uint64_t>(p.recv_splits[j]);
    }
  }
  p.recv = byte_buffer(static_cast<size_t>(recv_total));
  std::vector<int64_t> recv_arg = p.recv_splits; // the inner backend may move from them
  ScopedTimer t(c.stats->comm_ns, "lionbit::issue");
  p.work = c.comm->alltoall_base(p.recv, send, recv_arg, send_splits);
  return p;
}

void wait_shards(const SignCall& call, Phase1& p) {
  wait_inner(call, "all-to-all of packed signs (phase 1)", *call.c.comm, p.work);
  p.work = {};
}

std::vector<bits::Contribution> receive_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    at::Tensor& scratch) {
  const SignComm& c = call.c;
  const int N = c.world_size;
  const size_t sb = p.sw * 8;
  ScopedTimer t(c.stats->vote_ns, "lionbit::count");
  std::vector<bits::Contribution> in(N);
  const uint8_t* q = bytes_of(p.recv);
  for (int j = 0; j < N; ++j) {
    const uint64_t cap = hs.zero_capacity[j];
    in[j].sign = reinterpret_cast<const uint64_t*>(q);
    in[j].zero = cap > 0 ? reinterpret_cast<const uint64_t*>(q + sb) : nullptr;
    if (bits::zeros_as_list(cap, p.sw)) {
      if (!scratch.defined()) {
        scratch = byte_buffer(N * sb);
      }
      uint64_t* plane = words_of(scratch) + j * p.sw;
      TORCH_CHECK_VALUE(
          bits::decode_zeros(q + sb, p.sw, cap, plane), where(call), "rank ", j,
          " sent a corrupt list of zero positions in phase 1");
      in[j].zero = plane;
    }
    q += p.recv_splits[j];
  }
  return in;
}

} // namespace lionbit
