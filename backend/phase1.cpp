#include "backend/phase1.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "signbits/zeros.h"

namespace lionbit {

bits::ZeroCode max_shard_zeros(const SignCall& call, const at::Tensor& zero, size_t sw) {
  return bits::max_code(call.k->zero_codes(zero, sw));
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
  TORCH_CHECK(
      hs.sent.size() == static_cast<size_t>(N), where(call), "internal: no zero code per rank");
  // What each rank gets: its shard (the exchange: every shard) with this
  // rank's zeros encoded for the code announced to it.
  std::vector<int64_t> zbytes(N);
  std::vector<int64_t> send_splits(N);
  int64_t send_total = 0;
  bool any = false;
  for (int j = 0; j < N; ++j) {
    zbytes[j] = static_cast<int64_t>(bits::zero_encoding_bytes(hs.sent[j], sw));
    send_splits[j] = sb + zbytes[j];
    if (exchange) { // all N shards to the other rank, nothing to this one
      TORCH_CHECK(N == 2, where(call), "internal: the exchange is for two ranks");
      send_splits[j] = j == c.rank ? 0 : N * (sb + zbytes[j]);
    }
    send_total += send_splits[j];
    any = any || zbytes[j] > 0;
  }
  at::Tensor send = sign;
  if (any) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    send = call.bytes(static_cast<size_t>(send_total));
    int64_t at = 0;
    for (int j = 0; j < N; ++j) {
      // Shards k of the block to j: j's own, or every one in the exchange.
      const int first = exchange ? 0 : j;
      const int end = exchange ? (j == c.rank ? 0 : N) : j + 1;
      for (int k = first; k < end; ++k) {
        send.narrow(0, at, sb).copy_(sign.narrow(0, k * sb, sb));
        if (zbytes[j] > 0) {
          at::Tensor enc = send.narrow(0, at + sb, zbytes[j]);
          call.k->encode_zeros(zero.narrow(0, k * sb, sb), hs.sent[j], enc);
        }
        at += sb + zbytes[j];
      }
    }
  }
  Phase1 p;
  p.sw = sw;
  p.recv_splits.resize(N);
  int64_t recv_total = 0;
  for (int j = 0; j < N; ++j) {
    p.recv_splits[j] = sb + static_cast<int64_t>(bits::zero_encoding_bytes(hs.zero_codes[j], sw));
    if (exchange) {
      p.recv_splits[j] = j == c.rank ? 0 : N * p.recv_splits[j];
    }
    recv_total += p.recv_splits[j];
    if (j != c.rank) {
      count_zero_encodings(c, hs.sent[j], sw, exchange ? N : 1);
      c.stats->bytes_sent += static_cast<uint64_t>(send_splits[j]);
      c.stats->bytes_received += static_cast<uint64_t>(p.recv_splits[j]);
    }
  }
  p.f = issue_alltoall(
      call, call.bytes(static_cast<size_t>(recv_total)), send, p.recv_splits, send_splits);
  return p;
}

Phase1 send_zeros(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    const std::vector<at::Tensor>& zero,
    size_t sw) {
  const SignComm& c = call.c;
  TORCH_CHECK(c.world_size == 2, where(call), "internal: the exchange is for two ranks");
  const int other = 1 - c.rank;
  const int64_t sb = static_cast<int64_t>(sw * 8);
  const bits::ZeroCode my_code = hs.sent.at(static_cast<size_t>(other));
  const int64_t mine = static_cast<int64_t>(bits::zero_encoding_bytes(my_code, sw));
  const int64_t theirs = static_cast<int64_t>(bits::zero_encoding_bytes(hs.zero_codes[other], sw));
  const int64_t chunks = static_cast<int64_t>(zero.size());
  at::Tensor send = call.bytes(static_cast<size_t>(2 * mine * chunks));
  if (my_code.zeros > 0) {
    ScopedTimer t(c.stats->pack_ns, "lionbit::pack");
    for (int64_t i = 0; i < chunks; ++i) {
      for (int64_t k = 0; k < 2; ++k) {
        at::Tensor enc = send.narrow(0, (2 * i + k) * mine, mine);
        call.k->encode_zeros(zero[static_cast<size_t>(i)].narrow(0, k * sb, sb), my_code, enc);
      }
    }
  }
  count_zero_encodings(c, my_code, sw, 2 * chunks);
  Phase1 p;
  p.sw = sw;
  p.recv_splits.assign(2, 0);
  p.recv_splits[other] = 2 * theirs * chunks;
  std::vector<int64_t> send_splits(2, 0);
  send_splits[other] = 2 * mine * chunks;
  c.stats->bytes_sent += static_cast<uint64_t>(send_splits[other]);
  c.stats->bytes_received += static_cast<uint64_t>(p.recv_splits[other]);
  p.f = issue_alltoall(
      call, call.bytes(static_cast<size_t>(p.recv_splits[other])), send, p.recv_splits,
      send_splits);
  return p;
}

void join_zeros(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& signs,
    const Phase1& zeros,
    size_t index) {
  const int other = 1 - call.c.rank;
  const int64_t sb = static_cast<int64_t>(signs.sw * 8);
  const int64_t zb = static_cast<int64_t>(
      bits::zero_encoding_bytes(hs.zero_codes[other], signs.sw));
  if (zb == 0) {
    return; // the other rank has no zero: its signs are the whole message
  }
  const int64_t at = static_cast<int64_t>(index) * 2 * zb;
  at::Tensor joined = call.bytes(static_cast<size_t>(2 * (sb + zb)));
  for (int k = 0; k < 2; ++k) {
    joined.narrow(0, k * (sb + zb), sb).copy_(signs.recv.narrow(0, k * sb, sb));
    joined.narrow(0, k * (sb + zb) + sb, zb).copy_(zeros.recv.narrow(0, at + k * zb, zb));
  }
  signs.recv = joined;
  signs.recv_splits[other] = 2 * (sb + zb);
}

void wait_shards(const SignCall& call, Phase1& p) {
  p.recv = wait_data(call, "all-to-all of packed signs (phase 1)", p.f);
}

namespace {

// One rank's contribution to a shard as sent: `block` = [sign plane | zeros
// encoded for `code`]. Views of `block`, or a list of zeros or runs decoded
// into plane `slot` of `scratch` (`slots` planes of sw words, made when
// first needed). A corrupt list raises naming the sender and `step`.
PlaneIn contribution(
    const SignCall& call,
    const at::Tensor& block,
    const bits::ZeroCode& code,
    size_t sw,
    at::Tensor& scratch,
    int slots,
    int slot,
    int sender,
    const char* step) {
  const int64_t sb = static_cast<int64_t>(sw * 8);
  PlaneIn in;
  in.sign = block.narrow(0, 0, sb);
  const bits::ZeroForm form = bits::zero_form(code, sw);
  if (form == bits::ZeroForm::kNone) {
    return in;
  }
  if (form == bits::ZeroForm::kPlane) {
    in.zero = block.narrow(0, sb, sb);
    return in;
  }
  if (!scratch.defined()) {
    scratch = call.bytes(static_cast<size_t>(slots * sb));
  }
  at::Tensor plane = scratch.narrow(0, slot * sb, sb);
  TORCH_CHECK_VALUE(
      call.k->decode_zeros(block.narrow(0, sb, block.numel() - sb), code, plane), where(call),
      "rank ", call.c.name(sender), " sent a corrupt ", bits::zero_form_noun(form), " of zeros in ",
      step);
  in.zero = plane;
  return in;
}

} // namespace

std::vector<PlaneIn> receive_shards(
    const SignCall& call,
    const bits::HeaderSummary& hs,
    Phase1& p,
    at::Tensor& scratch) {
  const SignComm& c = call.c;
  const int N = c.world_size;
  ScopedTimer t(c.stats->vote_ns, "lionbit::count");
  std::vector<PlaneIn> in(N);
  int64_t q = 0;
  for (int j = 0; j < N; ++j) {
    in[j] = contribution(
        call, p.recv.narrow(0, q, p.recv_splits[j]), hs.zero_codes[j], p.sw, scratch, N, j, j,
        "phase 1");
    q += p.recv_splits[j];
  }
  // The count code's width follows the header round's any_zero (the same on
  // every rank), not the zeros this shard happens to get: a shard no rank
  // sent a zero still counts with a (clear) zero plane.
  const bool none = std::none_of(
      in.begin(), in.end(), [](const PlaneIn& x) { return x.zero.defined(); });
  if (hs.any_zero && none) {
    in[0].zero = call.bytes(p.sw * 8).zero_();
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
  if (hs.zero_most[static_cast<size_t>(c.rank)] > 0) {
    in[c.rank].zero = zero.narrow(0, shard * sb, sb);
  }
  const int64_t block = p.recv_splits[other] / 2; // [sign_k | zeros_k] per shard k
  in[other] = contribution(
      call, p.recv.narrow(0, shard * block, block), hs.zero_codes[other], p.sw, scratch, 2, shard,
      other, "the exchange");
  return in;
}

} // namespace lionbit
