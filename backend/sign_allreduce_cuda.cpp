#include "backend/sign_allreduce_cuda.hpp"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <map>
#include <vector>

#include "signbits/count.h"
#include "signbits/unpack.h"
#include "signbits/cuda/kernels.h"
#include "backend/sign_common.hpp"

namespace lionbit {

namespace {

// An event recorded on the current stream of a tensor's device.
struct CudaReady {
  at::cuda::CUDAEvent event;
};

std::shared_ptr<CudaReady> cuda_mark_ready(const at::Tensor& tensor) {
  auto ready = std::make_shared<CudaReady>();
  ready->event.record(at::cuda::getCurrentCUDAStream(tensor.device().index()));
  return ready;
}

// The worker's stream on a device: one per device for the worker thread's
// lifetime, so the worker's calls are ordered among themselves.
c10::cuda::CUDAStream worker_stream(c10::DeviceIndex device) {
  thread_local std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  auto it = streams.find(device);
  if (it == streams.end()) {
    it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  }
  return it->second;
}

uint64_t* dev_words(const at::Tensor& t) {
  return reinterpret_cast<uint64_t*>(t.data_ptr<uint8_t>());
}

at::Tensor dev_bytes(size_t n, const at::Device& device) {
  return at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(device));
}

// One collective on one device tensor. Runs on the worker thread with the
// worker's stream current.
class CudaRun {
 public:
  CudaRun(
      const SignComm& c,
      bits::SignOp op,
      const bits::TieRule& tie,
      uint64_t seq,
      at::Device device)
      : c_(c),
        N_(c.world_size),
        op_(op),
        tie_(tie),
        call_{c, op, Collective::kAllReduce, seq},
        device_(device),
        stream_(c10::cuda::getCurrentCUDAStream(device.index())) {}

  // Packs `buf` (contiguous) into the planes.
  void pack(const at::Tensor& buf) {
    dtype_ = *bits_dtype(buf.scalar_type());
    n_ = static_cast<size_t>(buf.numel());
    alloc_planes();
    if (n_ == 0) {
      return;
    }
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    cuda::pack_signs(
        dtype_, buf.data_ptr(), n_, dev_words(sign_), dev_words(zero_), 0,
        reinterpret_cast<cuda::Counts*>(counts_.data_ptr<int64_t>()), stream_.stream());
  }

  // Takes planes packed by the caller.
  void take_packed(
      bits::DType dtype,
      const at::Tensor& sign,
      const at::Tensor& zero,
      const at::Tensor& counts,
      size_t numel) {
    dtype_ = dtype;
    n_ = numel;
    alloc_planes();
    counts_.copy_(counts);
    if (n_ == 0) {
      return;
    }
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    const int64_t used = static_cast<int64_t>(bits::words_for(n_) * 8);
    sign_.narrow(0, 0, used).copy_(sign.narrow(0, 0, used));
    zero_.narrow(0, 0, used).copy_(zero.narrow(0, 0, used));
    auto s64 = sign_.view(at::kLong), z64 = zero_.view(at::kLong);
    const unsigned tail = static_cast<unsigned>(n_ % 64);
    if (tail != 0) { // bits past the end are not the caller's promise
      const int64_t mask = static_cast<int64_t>((uint64_t{1} << tail) - 1);
      const int64_t w = used / 8 - 1;
      s64.narrow(0, w, 1).bitwise_and_(mask);
      z64.narrow(0, w, 1).bitwise_and_(mask);
    }
    // A zero bit wins over a sign bit (an element is 0, +1 or -1).
    s64.bitwise_and_(z64.bitwise_not());
  }

  // Header round, phases 1 and 2; the result is unpacked into `out`
  // (contiguous, n elements of the run's dtype, on the device).
  void run(at::Tensor& out) {
    header();
    if (n_ == 0) {
      return;
    }
    const bool any_zero = hs_.any_zero;
    // Phase 1: rank k receives [sign_k | zero_k] (zero_k only if any rank
    // holds a zero) from every rank.
    const size_t per = any_zero ? 2 * sw_ : sw_; // words per destination
    at::Tensor send;
    if (any_zero) {
      send = dev_bytes(N_ * per * 8, device_);
      auto s3 = send.view(at::kLong).view({N_, 2, static_cast<int64_t>(sw_)});
      s3.select(1, 0).copy_(sign_.view(at::kLong).view({N_, static_cast<int64_t>(sw_)}));
      s3.select(1, 1).copy_(zero_.view(at::kLong).view({N_, static_cast<int64_t>(sw_)}));
    } else {
      send = sign_;
    }
    at::Tensor recv = exchange_a2a(send, per * 8, "all-to-all of packed signs (phase 1)");
    sign_ = zero_ = send = at::Tensor();
    const uint64_t* in_sign = dev_words(recv);
    const uint64_t* in_zero = any_zero ? in_sign + sw_ : nullptr;

    // Phase 2: count / vote the own shard, all-gather the results.
    int P = 0;
    at::Tensor mine;
    std::vector<double> values;
    {
      ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
      if (op_ == bits::SignOp::kVote) {
        // A tie is possible only with an even N or with zeros; a tie rule
        // other than "zero" answers it with a sign bit.
        const bool breaks = tie_.mode != bits::TieBreak::kZero;
        P = (!breaks && (N_ % 2 == 0 || any_zero)) ? 2 : 1;
        // [sign | tie]; with P == 1 the tie plane is scratch.
        mine = dev_bytes(2 * sw_ * 8, device_);
        cuda::vote(
            in_sign, in_zero, per, N_, sw_, dev_words(mine), dev_words(mine) + sw_,
            stream_.stream());
        if (breaks) {
          cuda::break_ties(
              dev_words(mine), dev_words(mine) + sw_, sw_, tie_,
              static_cast<uint64_t>(c_.rank) * sw_, stream_.stream());
        }
        if (P == 1) {
          mine = mine.narrow(0, 0, static_cast<int64_t>(sw_ * 8));
        }
        values = P == 2 ? std::vector<double>{-1, 1, 0, 0} : std::vector<double>{-1, 1};
      } else {
        P = bits::code_planes(N_, any_zero);
        TORCH_CHECK(
            P <= bits::kMaxUnpackPlanes, where(call_), "world size ", N_, " is too large for op ",
            bits::sign_op_name(op_));
        mine = dev_bytes(static_cast<size_t>(P) * sw_ * 8, device_);
        cuda::count_code(in_sign, in_zero, per, N_, sw_, dev_words(mine), stream_.stream());
        values = count_code_values(op_, N_, any_zero, P);
      }
    }
    recv = at::Tensor();
    at::Tensor gathered = exchange_allgather(mine, "all-gather of shard results (phase 2)");
    mine = at::Tensor();

    ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
    const size_t esize = bits::dtype_size(dtype_);
    at::Tensor lut_host = byte_buffer(values.size() * esize);
    bits::make_lut(dtype_, values.data(), values.size(), bytes_of(lut_host));
    at::Tensor lut = lut_host.to(device_);
    cuda::unpack(
        dtype_, cuda::ShardedPlanes{dev_words(gathered), P, sw_}, n_, lut.data_ptr(),
        out.data_ptr(), stream_.stream());
  }

 private:
  void alloc_planes() {
    sw_ = bits::shard_words(n_, N_);
    const size_t words = sw_ * N_;
    // Padding elements: sign 0, zero 0 (they vote -1 everywhere; never
    // unpacked). The pack kernels leave untouched bits as they are.
    at::Tensor planes = at::zeros(
        {static_cast<int64_t>(2 * words * 8)},
        at::TensorOptions().dtype(at::kByte).device(device_));
    sign_ = planes.narrow(0, 0, static_cast<int64_t>(words * 8));
    zero_ = planes.narrow(0, static_cast<int64_t>(words * 8), static_cast<int64_t>(words * 8));
    counts_ = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device_));
  }

  void header() {
    // The only host synchronisation: the tallies the header needs.
    at::Tensor host = counts_.cpu();
    const uint64_t zeros = static_cast<uint64_t>(host.data_ptr<int64_t>()[0]);
    const uint64_t nans = static_cast<uint64_t>(host.data_ptr<int64_t>()[1]);
    const uint64_t cap = std::min<uint64_t>(zeros, sw_ * bits::kWordBits);
    const auto mine = bits::make_header(
        op_, dtype_, c_.rank, bits::kDevice | header_flags(cap, nans), call_.seq, n_, cap, 0,
        bits::CallRule{tie_, 0});
    hs_ = header_round(call_, mine);
    c_.stats->sign_allreduce_calls += 1;
    c_.stats->elements += n_;
  }

  bool direct() const { return c_.device_comm.defined(); }

  // All-to-all with `bytes` per destination.
  at::Tensor exchange_a2a(at::Tensor& send, size_t bytes, const char* step) {
    c_.stats->bytes_sent += bytes * (N_ - 1);
    c_.stats->bytes_received += bytes * (N_ - 1);
    std::vector<int64_t> equal_out, equal_in; // empty: equal splits
    if (direct()) {
      at::Tensor recv = at::empty_like(send);
      wait_inner(
          call_, step, *c_.device_comm,
          c_.device_comm->alltoall_base(recv, send, equal_out, equal_in));
      return recv;
    }
    at::Tensor host_send = send.cpu();
    at::Tensor host_recv = byte_buffer(static_cast<size_t>(host_send.numel()));
    wait_inner(
        call_, step, *c_.comm, c_.comm->alltoall_base(host_recv, host_send, equal_out, equal_in));
    return host_recv.to(device_);
  }

  at::Tensor exchange_allgather(at::Tensor& mine, const char* step) {
    const size_t bytes = static_cast<size_t>(mine.numel());
    count_allgather(c_, bytes);
    if (direct()) {
      at::Tensor out = dev_bytes(bytes * N_, device_);
      wait_inner(call_, step, *c_.device_comm, c_.device_comm->_allgather_base(out, mine));
      return out;
    }
    at::Tensor host_mine = mine.cpu();
    at::Tensor host_out = byte_buffer(bytes * N_);
    wait_inner(call_, step, *c_.comm, c_.comm->_allgather_base(host_out, host_mine));
    return host_out.to(device_);
  }

  const SignComm& c_;
  const int N_;
  const bits::SignOp op_;
  const bits::TieRule tie_;
  const SignCall call_;
  const at::Device device_;
  c10::cuda::CUDAStream stream_;
  bits::DType dtype_ = bits::DType::kFloat32;
  size_t n_ = 0;
  size_t sw_ = 0;
  at::Tensor sign_, zero_, counts_;
  bits::HeaderSummary hs_;
};

// Makes the worker's stream current on the tensor's device and orders it
// after the caller's work.
class OnWorkerStream {
 public:
  OnWorkerStream(const at::Tensor& t, const std::shared_ptr<CudaReady>& ready)
      : guard_(t.device()), stream_(worker_stream(t.device().index())) {
    // Current for the rest of this worker thread's life: the Work's future
    // records its completion events on the current stream.
    c10::cuda::setCurrentCUDAStream(stream_);
    ready->event.block(stream_);
  }
  // The caching allocator must not hand `t`'s memory to another stream
  // before this one is done with it.
  void uses(const at::Tensor& t) const {
    if (t.defined() && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
  }

 private:
  c10::cuda::CUDAGuard guard_;
  c10::cuda::CUDAStream stream_;
};

void run_allreduce(
    const SignComm& c,
    at::Tensor& tensor,
    bits::SignOp op,
    const TieSpec& tie,
    uint64_t seq,
    const std::shared_ptr<CudaReady>& ready) {
  OnWorkerStream on(tensor, ready);
  on.uses(tensor);
  at::Tensor buf = tensor.contiguous();
  CudaRun r(c, op, tie.at(seq), seq, tensor.device());
  r.pack(buf);
  r.run(buf);
  if (!buf.is_same(tensor)) {
    tensor.copy_(buf);
  }
}

void run_allreduce_packed(
    const SignComm& c,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const at::Tensor& counts,
    int64_t numel,
    at::Tensor& out,
    bits::SignOp op,
    const TieSpec& tie,
    uint64_t seq,
    const std::shared_ptr<CudaReady>& ready) {
  OnWorkerStream on(out, ready);
  on.uses(out);
  on.uses(sign);
  on.uses(zero);
  on.uses(counts);
  CudaRun r(c, op, tie.at(seq), seq, out.device());
  r.take_packed(*bits_dtype(out.scalar_type()), sign, zero, counts, static_cast<size_t>(numel));
  r.run(out);
}

} // namespace

SignJob cuda_allreduce_job(at::Tensor tensor, bits::SignOp op, const TieSpec& tie) {
  auto ready = cuda_mark_ready(tensor);
  return [tensor, op, tie, ready](const SignComm& comm, uint64_t seq) mutable {
    run_allreduce(comm, tensor, op, tie, seq, ready);
  };
}

SignJob cuda_allreduce_packed_job(
    at::Tensor sign,
    at::Tensor zero,
    at::Tensor counts,
    int64_t numel,
    at::Tensor out,
    bits::SignOp op,
    const TieSpec& tie) {
  auto ready = cuda_mark_ready(out);
  return
      [sign, zero, counts, numel, out, op, tie, ready](const SignComm& comm, uint64_t seq) mutable {
        run_allreduce_packed(comm, sign, zero, counts, numel, out, op, tie, seq, ready);
      };
}

} // namespace lionbit
