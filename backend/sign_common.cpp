#include "backend/sign_common.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "backend/sign_errors.hpp"
#include "signbits/levels.h"
#include "signbits/zeros.h"

namespace lionbit {

const char* collective_name(Collective kind) {
  return kind == Collective::kReduceScatter ? "reduce_scatter_sign" : "all_reduce_sign";
}

std::string where(const SignCall& call) {
  return std::string("lionbit ") + collective_name(call.kind) +
      "(op=" + bits::sign_op_name(call.op) + ") on " + call.c.here() + ": ";
}

uint64_t requested_chunk_elems(int world_size, const c10::Device& device) {
  const char* env = std::getenv("LIONBIT_CHUNK_ELEMS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (end != nullptr && *end == '\0' && v > 0) {
      return v;
    }
  }
  return bits::default_chunk_elems(world_size, device.is_cuda());
}

void wait_inner(
    const SignCall& call,
    const char* step,
    const c10d::Backend& via,
    const c10::intrusive_ptr<c10d::Work>& work) {
  ScopedTimer t(call.c.stats->comm_ns, "lionbit::issue");
  try {
    work->wait();
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK_WITH(
        DistBackendError, false, where(call), "the ", step, " over the inner ",
        via.getBackendName(), " communicator failed: ",
        c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
  }
}

// An all-gather (ring or direct, issue_allgather): each rank sends and receives (N - 1) chunks.
void count_allgather(const SignComm& c, size_t chunk) {
  const uint64_t b = static_cast<uint64_t>(chunk) * (c.world_size - 1);
  c.stats->bytes_sent += b;
  c.stats->bytes_received += b;
}

void count_zero_encodings(
    const SignComm& c,
    const bits::ZeroCode& code,
    size_t words,
    int64_t messages) {
  const bits::ZeroForm form = bits::zero_form(code, words);
  if (form == bits::ZeroForm::kNone || messages <= 0) {
    return;
  }
  c.stats->zero_bytes_sent += static_cast<uint64_t>(messages) *
      bits::zero_encoding_bytes(code, words);
  c.stats->zero_encodings[static_cast<int>(form) - 1] += static_cast<uint64_t>(messages);
}

namespace {
// A group of one rank: its collectives are copies of its own input, with no
// inner collective (LIONBIT_ONE_RANK_COPY=0 runs the inner ones all the
// same: the tests of a transport on a machine with one device).
bool one_rank_copies() {
  static const bool on = [] {
    const char* v = std::getenv("LIONBIT_ONE_RANK_COPY");
    return v == nullptr || std::string(v) != "0";
  }();
  return on;
}

// Issues `start(via, dst, src)` on the communicator that carries the call's
// data: the CPU one for CPU tensors; for CUDA tensors the device one, or,
// without it, the CPU one with the data staged through host memory.
template <typename Start>
Inflight issue_data(const SignCall& call, at::Tensor out, const at::Tensor& in, Start start) {
  const bool staged = !call.device.is_cpu() && !call.c.device_comm.defined();
  c10d::Backend& via = staged || call.device.is_cpu() ? *call.c.comm : *call.c.device_comm;
  Inflight f;
  f.via = &via;
  f.out = std::move(out);
  ScopedTimer t(call.c.stats->comm_ns, "lionbit::issue");
  if (call.c.world_size == 1 && one_rank_copies()) {
    // A group of one rank: what every collective here gives it is its own
    // input (stream-ordered on the device), with no inner collective.
    f.out.copy_(in);
    return f;
  }
  if (staged) {
    at::Tensor host_in = in.cpu();
    f.host_out = byte_buffer(static_cast<size_t>(f.out.numel()));
    f.work = start(via, f.host_out, host_in);
  } else {
    at::Tensor send = in;
    f.work = start(via, f.out, send);
  }
  return f;
}
} // namespace

Inflight issue_alltoall(
    const SignCall& call,
    at::Tensor out,
    const at::Tensor& in,
    std::vector<int64_t> out_splits,
    std::vector<int64_t> in_splits) {
  return issue_data(
      call, std::move(out), in, [&](c10d::Backend& via, at::Tensor& dst, at::Tensor& src) {
        return via.alltoall_base(dst, src, out_splits, in_splits);
      });
}

Inflight issue_allgather(const SignCall& call, at::Tensor out, const at::Tensor& in) {
  const int64_t n = call.c.world_size;
  const bool direct = n > 2 && in.dim() == 1 &&
      static_cast<size_t>(n * in.numel() * in.element_size()) <= kDirectAllgatherBytes;
  const c10d::Backend* cpu = call.c.comm.get();
  return issue_data(
      call, std::move(out), in, [&](c10d::Backend& via, at::Tensor& dst, at::Tensor& src) {
        if (direct && &via == cpu) {
          // Every peer gets this rank's piece at once: one round trip, not
          // the ring's N - 1 in a row; the same bytes (count_allgather).
          std::vector<int64_t> splits(static_cast<size_t>(n), src.numel());
          at::Tensor copies = src.repeat({n});
          return via.alltoall_base(dst, copies, splits, splits);
        }
        return via._allgather_base(dst, src);
      });
}

at::Tensor wait_data(const SignCall& call, const char* step, Inflight& f) {
  if (f.work) { // (none for a group of one rank)
    wait_inner(call, step, *f.via, f.work);
    f.work = {};
  }
  if (f.host_out.defined()) {
    f.out.copy_(f.host_out);
    f.host_out = at::Tensor();
  }
  return f.out;
}

bool two_rank_exchange_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("LIONBIT_SIGN_EXCHANGE");
    return v == nullptr || std::string(v) != "0";
  }();
  return allowed;
}

uint32_t header_flags(const SignCall& call, uint64_t zero_capacity, uint64_t nans) {
  return (zero_capacity > 0 ? bits::kHasZero : 0u) | (nans > 0 ? bits::kHasNan : 0u) |
      (call.device.is_cpu() ? 0u : bits::kDevice) |
      (two_rank_exchange_allowed() ? 0u : bits::kTwoPhase);
}

namespace {
bits::HeaderSummary exchange_headers(
    const SignCall& call,
    const bits::WireHeader& mine,
    const std::vector<bits::ZeroCode>& to) {
  const SignComm& c = call.c;
  const size_t n = static_cast<size_t>(c.world_size);
  constexpr size_t kBytes = sizeof(bits::WireHeader);
  TORCH_CHECK(to.empty() || to.size() == n, where(call), "internal: a zero code per rank");
  std::vector<bits::WireHeader> addressed(n, mine);
  if (!to.empty()) {
    for (size_t j = 0; j < n; ++j) {
      addressed[j] = bits::address_header(mine, to[j]);
    }
  }
  at::Tensor in = byte_buffer(kBytes * n);
  std::memcpy(bytes_of(in), addressed.data(), kBytes * n);
  at::Tensor out = in; // a group of one rank: its own header, with no inner collective
  if (n > 1 || !one_rank_copies()) {
    out = byte_buffer(kBytes * n);
    std::vector<int64_t> splits(n, static_cast<int64_t>(kBytes));
    wait_inner(call, "header round", *c.comm, c.comm->alltoall_base(out, in, splits, splits));
  }
  count_allgather(c, kBytes); // the same bytes as an all-gather
  static const std::vector<int> kAsNumbered; // no names: as the group numbers its ranks
  bits::HeaderSummary hs = bits::check_headers(
      reinterpret_cast<const bits::WireHeader*>(bytes_of(out)), c.world_size,
      addressed[static_cast<size_t>(c.rank)], c.names ? c.names->table() : kAsNumbered);
  hs.sent.resize(n);
  for (size_t j = 0; j < n; ++j) {
    const bits::WireHeader& h = addressed[j];
    hs.sent[j] = bits::ZeroCode{h.zero_capacity, h.zero_runs, h.zero_packed};
  }
  return hs;
}
} // namespace

bits::HeaderSummary header_round(
    const SignCall& call,
    const bits::WireHeader& mine,
    const std::vector<bits::ZeroCode>& to) {
  bits::HeaderSummary hs = exchange_headers(call, mine, to);
  if (hs.error.empty()) {
    return hs;
  }
  const std::string msg = c10::str(where(call), hs.error);
  switch (hs.verdict) {
    case bits::HeaderVerdict::kNonFinite:
      throw NonFiniteInputError(hs.ranks, msg);
    case bits::HeaderVerdict::kRejected:
      throw PeerRejectedError(hs.ranks, msg);
    default:
      TORCH_CHECK_VALUE(false, msg);
  }
}

void reject_round(const SignCall& call) {
  const uint32_t flags = bits::kRejected |
      (call.kind == Collective::kReduceScatter ? bits::kReduceScatter : 0u);
  const uint64_t chunk = call.kind == Collective::kReduceScatter
      ? 0
      : bits::chunk_elems_for(
            requested_chunk_elems(call.c.world_size, call.device), call.c.world_size);
  bits::CallRule rule; // well-formed for the op: peers read "rejected", not "corrupt"
  if (call.op == bits::SignOp::kLevels) {
    rule.value_bits = bits::kMinLevelBits;
  }
  const auto mine = bits::make_header(
      call.op, bits::DType::kFloat32, call.c.rank, flags, call.seq, 0, {}, chunk, rule);
  exchange_headers(call, mine, {}); // its error is the caller's own: ignore it
}

std::vector<double> count_code_values(bits::SignOp op, int N, bool with_zeros, int planes) {
  std::vector<double> values(size_t{1} << planes);
  for (size_t code = 0; code < values.size(); ++code) {
    const int64_t c64 = static_cast<int64_t>(code);
    const int64_t sum = with_zeros ? c64 - N : 2 * c64 - N;
    if (sum < -N || sum > N) {
      values[code] = 0;
    } else {
      values[code] = op == bits::SignOp::kSum ? static_cast<double>(sum)
                                              : static_cast<double>(sum) / static_cast<double>(N);
    }
  }
  return values;
}

} // namespace lionbit
