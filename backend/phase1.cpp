#include "backend/phase1.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "signbits/zeros.h"

namespace lionbit {

uint64_t max_shard_zeros(const SignCall& call, const at::Tensor& zero, size_t sw) {
  const std::vector<uint64_t> per_shard = call.k->count_bits(zero, sw);
  return per_shard.empty() ? 0 : *std::max_element(per_shard.begin(), per_shard.end());
}

Phase1 send_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    size_t sw,
    bool exchange) {
  const SignComm& c = call.c;
  const int N = c.world_size;
  const int64_t sb = static_cast<int64_t>(sw * 8);
  const uint64_t my_cap = hs.zero_capacity[c.rank];
  const int64_t my_zbytes = static_cast<int64_t>(bits::zero_encoding_bytes(my_cap, sw));
  at::Tensor send = sign;
  if (my_cap > 0) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    send = call.bytes(static_cast<size_t>(N * (sb + my_zbytes)));
    for (int k = 0; k < N; ++k) {
      const int64_t at = k * (sb + my_zbytes);
      send.narrow(0, at, sb).copy_(sign.narrow(0, k * sb, sb));
      at::Tensor enc = send.narrow(0, at + sb, my_zbytes);
      call.k->encode_zeros(zero.narrow(0, k * sb, sb), my_cap, enc);
    }
  }
  Phase1 p;
  p.sw = sw;
  std::vector<int64_t> send_splits(N, sb + my_zbytes);
  p.recv_splits.resize(N);
  int64_t recv_total = 0;
  for (int j = 0; j < N; ++j) {
    p.recv_splits[j] = sb +
        static_cast<int64_t>(bits::zero_encoding_bytes(hs.zero_capacity[j], sw));
    if (exchange) { // all N shards to the other rank, nothing to this one
      TORCH_CHECK(N == 2, where(call), "internal: the exchange is for two ranks");
      p.recv_splits[j] = j == c.rank ? 0 : N * p.recv_splits[j];
      send_splits[j] = j == c.rank ? 0 : N * (sb + my_zbytes);
    }
    recv_total += p.recv_splits[j];
    if (j != c.rank) {
      c.stats->bytes_sent += static_cast<uint64_t>(send_splits[j]);
      c.stats->bytes_received += static_cast<uint64_t>(p.recv_splits[j]);
    }
  }
  p.f = issue_alltoall(
      call, call.bytes(static_cast<size_t>(recv_total)), send, p.recv_splits, send_splits);
  return p;
}

void wait_shards(const SignCall& call, Phase1& p) {
  p.recv = wait_data(call, "all-to-all of packed signs (phase 1)", p.f);
}

std::vector<PlaneIn> receive_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    at::Tensor& scratch) {
  const SignComm& c = call.c;
  const int N = c.world_size;
  const int64_t sb = static_cast<int64_t>(p.sw * 8);
  ScopedTimer t(c.stats->vote_ns, "lionbit::count");
  std::vector<PlaneIn> in(N);
  int64_t q = 0;
  for (int j = 0; j < N; ++j) {
    const uint64_t cap = hs.zero_capacity[j];
    in[j].sign = p.recv.narrow(0, q, sb);
    if (cap > 0 && !bits::zeros_as_list(cap, p.sw)) {
      in[j].zero = p.recv.narrow(0, q + sb, sb);
    } else if (cap > 0) {
      if (!scratch.defined()) {
        scratch = call.bytes(static_cast<size_t>(N * sb));
      }
      at::Tensor plane = scratch.narrow(0, j * sb, sb);
      const at::Tensor list = p.recv.narrow(0, q + sb, p.recv_splits[j] - sb);
      TORCH_CHECK_VALUE(
          call.k->decode_zeros(list, cap, plane), where(call), "rank ", j,
          " sent a corrupt list of zero positions in phase 1");
      in[j].zero = plane;
    }
    q += p.recv_splits[j];
  }
  return in;
}

std::vector<PlaneIn> exchanged_shard(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    const at::Tensor& sign,
    const at::Tensor& zero,
    int shard,
    at::Tensor& scratch) {
  const SignComm& c = call.c;
  const int64_t sb = static_cast<int64_t>(p.sw * 8);
  const int other = 1 - c.rank;
  ScopedTimer t(c.stats->vote_ns, "lionbit::count");
  std::vector<PlaneIn> in(2);
  in[c.rank].sign = sign.narrow(0, shard * sb, sb);
  if (hs.zero_capacity[c.rank] > 0) {
    in[c.rank].zero = zero.narrow(0, shard * sb, sb);
  }
  const uint64_t cap = hs.zero_capacity[other];
  const int64_t block = p.recv_splits[other] / 2; // [sign_k | zeros_k] per shard k
  const at::Tensor mine = p.recv.narrow(0, shard * block, block);
  in[other].sign = mine.narrow(0, 0, sb);
  if (cap > 0 && !bits::zeros_as_list(cap, p.sw)) {
    in[other].zero = mine.narrow(0, sb, sb);
  } else if (cap > 0) {
    if (!scratch.defined()) {
      scratch = call.bytes(static_cast<size_t>(2 * sb));
    }
    at::Tensor plane = scratch.narrow(0, shard * sb, sb);
    TORCH_CHECK_VALUE(
        call.k->decode_zeros(mine.narrow(0, sb, block - sb), cap, plane), where(call), "rank ",
        other, " sent a corrupt list of zero positions in the exchange");
    in[other].zero = plane;
  }
  return in;
}

} // namespace lionbit
