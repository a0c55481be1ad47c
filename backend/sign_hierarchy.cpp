#include "backend/sign_hierarchy.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "signbits/count.h"
#include "signbits/trits.h"
#include "signbits/unpack.h"
#include "backend/code_sum.hpp"
#include "backend/phase1.hpp"
#include "backend/phase2.hpp"
#include "backend/sign_common.hpp"
#include "backend/torch_adapter.hpp"

namespace lionbit {

const char* hierarchy_name(HierarchyMode mode) {
  switch (mode) {
    case HierarchyMode::kExact:
      return "node";
    case HierarchyMode::kNodeVote:
      return "node_vote";
    default:
      return "flat";
  }
}

namespace {

constexpr int64_t kCountBytes = 8; // a vote shard's number of zeros, ahead of its sign plane

// One hierarchical call on one rank. The steps run in this order on every
// rank, so each communicator sees its collectives in the same order.
class HierRun {
 public:
  HierRun(
      const SignComm& c,
      const Hierarchy& h,
      HierarchyMode mode,
      Collective kind,
      bits::SignOp op,
      const bits::CallRule& rule,
      uint64_t seq,
      const c10::Device& device)
      : c_(c),
        h_(h),
        mode_(mode),
        op_(op),
        rule_(rule),
        N_(c.world_size),
        L_(h.node.world_size),
        M_(h.cross.world_size),
        call_(c, op, kind, seq, device),
        node_(h.node, op, kind, seq, device),
        cross_(h.cross, op, kind, seq, device) {
    TORCH_CHECK(
        mode != HierarchyMode::kFlat && L_ * M_ == N_ &&
            h.order.size() == static_cast<size_t>(N_) &&
            h.node_ranks.size() == static_cast<size_t>(L_) &&
            h.order[static_cast<size_t>(h.node.rank * M_ + h.cross.rank)] == c.rank &&
            h.node_ranks[static_cast<size_t>(h.node.rank)] == c.rank,
        where(call_), "internal: the hierarchy (", L_, " ranks a node, ", M_,
        " nodes) does not match the group of ", N_, " ranks");
    TORCH_CHECK_VALUE(
        mode != HierarchyMode::kNodeVote || op == bits::SignOp::kVote, where(call_),
        "hierarchy 'node_vote' is a vote of node votes: op must be 'vote'");
  }

  // --- loading this rank's direction bits (N shards of sw words) ---------

  void load_tensor(const at::Tensor& buf) {
    n_ = static_cast<size_t>(buf.numel());
    shape(bits::shard_words(n_, N_));
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    const bits::PackCounts pc = call_.k->pack(buf, sign_, zero_, 0);
    loaded(pc.zeros, pc.nans);
  }

  void load_packed(const PackedSigns& in) {
    n_ = static_cast<size_t>(in.numel);
    shape(bits::shard_words(n_, N_));
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    const int64_t used = static_cast<int64_t>(bits::words_for(n_) * 8);
    sign_.narrow(0, 0, used).copy_(in.sign.narrow(0, 0, used));
    zero_.narrow(0, 0, used).copy_(in.zero.narrow(0, 0, used));
    call_.k->clean(sign_, zero_, n_);
    loaded(zeros_in(zero_), in.nans);
  }

  void load_shards(const PackedShards& in) {
    const size_t S = static_cast<size_t>(in.shard_numel);
    n_ = S * static_cast<size_t>(N_);
    shape(bits::words_for(S));
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    sign_.copy_(in.sign.narrow(0, 0, N_ * sb_));
    zero_.copy_(in.zero.narrow(0, 0, N_ * sb_));
    for (int r = 0; r < N_; ++r) {
      at::Tensor s = sign_.narrow(0, r * sb_, sb_);
      at::Tensor z = zero_.narrow(0, r * sb_, sb_);
      call_.k->clean(s, z, S);
    }
    loaded(zeros_in(zero_), in.nans);
  }

  // --- 0. the header round over every rank ---------------------------------

  void header(bits::DType dtype, uint32_t flags) {
    flags |= header_flags(call_, zero_code_.zeros, nans_) |
        (mode_ == HierarchyMode::kExact ? bits::kHierExact : bits::kHierNodeVote);
    const auto mine = bits::make_header(
        op_, dtype, c_.rank, flags, call_.seq, n_, zero_code_, 0, rule_);
    hs_ = header_round(call_, mine);
    c_.stats->elements += n_;
  }

  bool empty() const { return n_ == 0; }

  // --- 1, 2. this rank's shard of the result -------------------------------

  // Its planes: a vote's sign and zeros, or avg / sum's count code.
  std::vector<at::Tensor> reduce() {
    std::vector<PlaneIn> in = exchange_in_node();
    return mode_ == HierarchyMode::kExact ? count_across_nodes(in) : vote_across_nodes(in);
  }

  // The values of the result's codes (bit b of a code: plane b).
  std::vector<double> values(int planes) const {
    if (op_ == bits::SignOp::kVote) {
      return {-1, 1, 0, 0}; // sign bit + 2 * zero bit
    }
    return count_code_values(op_, N_, hs_.any_zero, planes);
  }

  // Writes this rank's shard of the result into `out` (the reduce-scatter).
  void unpack_own(const std::vector<at::Tensor>& planes, bits::DType dtype, at::Tensor& out) {
    ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
    at::Tensor flat = out.view({-1});
    call_.k->unpack(
        planes, lut_tensor(dtype, values(static_cast<int>(planes.size())), call_.device), flat);
  }

  // --- 3. every shard's result to every rank (the all-reduce) --------------

  void gather_and_unpack(const std::vector<at::Tensor>& mine, bits::DType dtype, at::Tensor& buf) {
    const bool votes = op_ == bits::SignOp::kVote;
    if (votes && rule_.tie.mode == bits::TieBreak::kZero && N_ % 2 == 0) {
      gather_trits(mine, dtype, buf);
      return;
    }
    const int64_t msg = votes ? kCountBytes + sb_ : static_cast<int64_t>(mine.size()) * sb_;
    at::Tensor out = call_.bytes(static_cast<size_t>(msg));
    if (votes) {
      const uint64_t zeros = call_.k->count_bits(mine[1], sw_).at(0);
      at::Tensor head = at::empty({kCountBytes}, at::TensorOptions().dtype(at::kByte));
      std::memcpy(bytes_of(head), &zeros, sizeof zeros);
      out.narrow(0, 0, kCountBytes).copy_(head);
      out.narrow(0, kCountBytes, sb_).copy_(mine[0]);
    } else {
      for (size_t b = 0; b < mine.size(); ++b) {
        out.narrow(0, static_cast<int64_t>(b) * sb_, sb_).copy_(mine[b]);
      }
    }
    const at::Tensor all = gather_twice(out, "all-gather of shard results");
    // all: [node rank j][cross rank c][msg], the shard of order[j * M + c].
    at::Tensor zero_planes;
    if (votes) {
      const at::Tensor counts =
          all.view({N_, msg}).narrow(1, 0, kCountBytes).to(at::kCPU).contiguous();
      const auto* z = reinterpret_cast<const uint64_t*>(bytes_of(counts));
      uint64_t total = 0;
      for (int i = 0; i < N_; ++i) {
        TORCH_CHECK_VALUE(
            z[i] <= sw_ * bits::kWordBits, where(call_), "rank ",
            call_.c.name(h_.order[static_cast<size_t>(i)]), " sent a corrupt vote message (", z[i],
            " zeros in a shard of ", sw_ * bits::kWordBits, " elements)");
        total += z[i];
      }
      if (total > 0) {
        zero_planes = gather_twice(mine[1].contiguous(), "all-gather of the result's zeros");
        c_.stats->tie_rounds += 1;
      }
    }
    ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
    const int planes = votes ? 2 : static_cast<int>(mine.size());
    const at::Tensor lut = lut_tensor(dtype, values(planes), call_.device);
    const at::Tensor none = votes && !zero_planes.defined() ? at::zeros({sb_}, all.options())
                                                            : at::Tensor();
    const size_t per_shard = sw_ * bits::kWordBits;
    for (int i = 0; i < N_; ++i) {
      const size_t begin = static_cast<size_t>(h_.order[static_cast<size_t>(i)]) * per_shard;
      if (begin >= n_) {
        continue;
      }
      const at::Tensor m = all.narrow(0, i * msg, msg);
      std::vector<at::Tensor> in;
      if (votes) {
        in = {
            m.narrow(0, kCountBytes, sb_),
            zero_planes.defined() ? zero_planes.narrow(0, i * sb_, sb_) : none};
      } else {
        for (int b = 0; b < planes; ++b) {
          in.push_back(m.narrow(0, b * sb_, sb_));
        }
      }
      at::Tensor dst = buf.narrow(
          0, static_cast<int64_t>(begin), static_cast<int64_t>(std::min(per_shard, n_ - begin)));
      call_.k->unpack(in, lut, dst);
    }
  }

 private:
  // A vote under "zero" at even N: ties are common (3/8 of the elements of
  // random signs at N = 4), so the results travel in base 3 with their zeros
  // (signbits/trits.h, 1.625 bits an element), as the flat vote's phase 2
  // does once it has seen dense ties, in one round.
  void gather_trits(const std::vector<at::Tensor>& mine, bits::DType dtype, at::Tensor& buf) {
    const int64_t msg = static_cast<int64_t>(sw_ * bits::kTritBytesPerWord);
    at::Tensor out = call_.bytes(static_cast<size_t>(msg));
    call_.k->encode_trits(mine[0], mine[1], out);
    c_.stats->inline_tie_chunks += 1;
    const at::Tensor all = gather_twice(out, "all-gather of shard results");
    ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
    const at::Tensor lut = lut_tensor(dtype, {-1, 1, 0}, call_.device);
    const size_t per_shard = sw_ * bits::kWordBits;
    for (int i = 0; i < N_; ++i) {
      const int sender = h_.order[static_cast<size_t>(i)];
      const size_t begin = static_cast<size_t>(sender) * per_shard;
      if (begin >= n_) {
        continue;
      }
      const size_t len = std::min(per_shard, n_ - begin);
      at::Tensor dst = buf.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(len));
      const int64_t used = static_cast<int64_t>(bits::words_for(len) * bits::kTritBytesPerWord);
      TORCH_CHECK_VALUE(
          call_.k->decode_trits(all.narrow(0, i * msg, used), lut, dst), where(call_), "rank ",
          call_.c.name(sender), " sent a corrupt vote message (a base-3 byte above 242)");
    }
  }

  void shape(size_t sw) {
    sw_ = sw;
    sb_ = static_cast<int64_t>(sw * 8);
    at::Tensor planes = at::zeros(
        {2 * N_ * sb_}, at::TensorOptions().dtype(at::kByte).device(call_.device));
    sign_ = planes.narrow(0, 0, N_ * sb_);
    zero_ = planes.narrow(0, N_ * sb_, N_ * sb_);
  }

  // Set bits of a plane of this call's planes (none when it is empty).
  uint64_t zeros_in(const at::Tensor& plane) const {
    return plane.numel() == 0 ? 0 : call_.k->count_bits(plane, plane_words(plane)).at(0);
  }

  void loaded(uint64_t zeros, uint64_t nans) {
    nans_ = nans;
    zero_code_ = zeros > 0 ? max_shard_zeros(call_, zero_, sw_) : bits::ZeroCode{};
  }

  // Step 1: the node's all-to-all; returns the L contributions to this
  // rank's slice (M * sw words, the shards of order[l * M ..]).
  std::vector<PlaneIn> exchange_in_node() {
    at::Tensor perm = at::tensor(
                          std::vector<int64_t>(h_.order.begin(), h_.order.end()),
                          at::TensorOptions().dtype(at::kLong))
                          .to(call_.device);
    at::Tensor sign = sign_.view({N_, sb_}).index_select(0, perm).view({-1});
    at::Tensor zero = hs_.any_zero ? zero_.view({N_, sb_}).index_select(0, perm).view({-1}) : zero_;
    sign_ = zero_ = at::Tensor();
    // A slice holds M shards: at most M times the zeros and runs of the
    // rank's announced code.
    bits::HeaderSummary hs;
    hs.any_zero = hs_.any_zero;
    const uint64_t slice_elems = static_cast<uint64_t>(M_) * sw_ * bits::kWordBits;
    for (int j = 0; j < L_; ++j) {
      const bits::ZeroCode& one =
          hs_.zero_codes[static_cast<size_t>(h_.node_ranks[static_cast<size_t>(j)])];
      const uint64_t zeros = std::min(one.zeros * static_cast<uint64_t>(M_), slice_elems);
      hs.zero_codes.push_back(
          bits::ZeroCode{zeros, std::min(one.runs * static_cast<uint64_t>(M_), zeros)});
    }
    hs.sent.assign(static_cast<size_t>(L_), hs.zero_codes[static_cast<size_t>(node_.c.rank)]);
    Phase1 p = send_shards(node_, hs, sign, zero, static_cast<size_t>(M_) * sw_);
    wait_shards(node_, p);
    std::vector<PlaneIn> in = receive_shards(node_, hs, p, node_scratch_);
    node_recv_ = p.recv; // the contributions are views of it
    return in;
  }

  // Step 2a: the node's counts across nodes, summed and voted exactly.
  std::vector<at::Tensor> count_across_nodes(std::vector<PlaneIn>& in) {
    const KernelSet& k = *call_.k;
    const bool zeros = hs_.any_zero;
    const bool votes = op_ == bits::SignOp::kVote;
    const int P = bits::code_planes(L_, zeros);
    const int Q = bits::code_planes(N_, zeros);
    TORCH_CHECK(
        Q <= bits::kMaxUnpackPlanes, where(call_), "world size ", N_, " is too large for op ",
        bits::sign_op_name(op_));
    const int64_t slice = M_ * sb_;
    at::Tensor send;
    {
      ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
      // Every node's code must be the zero-aware one once any rank sent a zero.
      std::vector<PlaneIn> counted = in;
      const bool node_zero = std::any_of(
          in.begin(), in.end(), [](const PlaneIn& p) { return p.zero.defined(); });
      if (zeros && !node_zero) {
        counted[0].zero = at::zeros({slice}, in[0].sign.options());
      }
      at::Tensor codes = node_.bytes(static_cast<size_t>(P * slice));
      k.count_code(counted, codes);
      if (votes && zeros && node_zero) {
        // Elements the whole node sent 0 for: the all-ones code (never a count).
        at::Tensor still = node_.bytes(static_cast<size_t>(slice));
        k.all_zero(in, 0, still);
        codes.view(at::kLong).view({P, -1}).bitwise_or_(still.view(at::kLong));
      }
      // [plane][shard of the slice] -> [shard][plane]: one block per peer.
      send = codes.view({P, M_, sb_}).transpose(0, 1).contiguous().view({-1});
    }
    in.clear();
    node_recv_ = node_scratch_ = at::Tensor();
    const int64_t block = P * sb_;
    h_.cross.stats->bytes_sent += static_cast<uint64_t>((M_ - 1) * block);
    h_.cross.stats->bytes_received += static_cast<uint64_t>((M_ - 1) * block);
    Inflight f = issue_alltoall(
        cross_, cross_.bytes(static_cast<size_t>(M_ * block)), send, {}, {});
    const at::Tensor recv =
        wait_data(cross_, "all-to-all of node counts (across nodes)", f).view(at::kLong);

    ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
    // A node whose ranks all sent 0 counts as L zeros: code 2 * 0 + L.
    const CodeSum sum = sum_codes(
        recv.view({M_, P, static_cast<int64_t>(sw_)}), Q, votes && zeros ? L_ : -1);
    if (!votes) {
      std::vector<at::Tensor> planes;
      for (int b = 0; b < Q; ++b) {
        planes.push_back(sum.total[b].view(at::kByte));
      }
      return planes;
    }
    // Sum = code - N with zeros, 2 code - N without.
    Comparison cmp = compare_code(sum.total, zeros ? N_ : N_ / 2);
    if (!zeros && N_ % 2 == 1) {
      cmp.eq.zero_(); // code == (N - 1) / 2 is no tie
    }
    at::Tensor sign = cmp.gt.view(at::kByte);
    at::Tensor tie = cmp.eq.view(at::kByte);
    if (rule_.tie.mode == bits::TieBreak::kZero) {
      return {sign, tie};
    }
    at::Tensor still = zeros ? sum.still.view(at::kByte) : at::zeros_like(tie);
    k.break_ties(sign, tie, still, rule_.tie, static_cast<uint64_t>(c_.rank) * sw_);
    return {sign, still};
  }

  // Step 2b: the node's vote, then a vote of the node votes across nodes.
  std::vector<at::Tensor> vote_across_nodes(std::vector<PlaneIn>& in) {
    const KernelSet& k = *call_.k;
    const int l = h_.node.rank;
    at::Tensor sign = node_.bytes(static_cast<size_t>(M_ * sb_));
    at::Tensor zero = node_.bytes(static_cast<size_t>(M_ * sb_));
    {
      ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
      for (int c = 0; c < M_; ++c) {
        std::vector<PlaneIn> part(in.size());
        for (size_t j = 0; j < in.size(); ++j) {
          part[j].sign = in[j].sign.narrow(0, c * sb_, sb_);
          if (in[j].zero.defined()) {
            part[j].zero = in[j].zero.narrow(0, c * sb_, sb_);
          }
        }
        at::Tensor s = sign.narrow(0, c * sb_, sb_);
        at::Tensor z = zero.narrow(0, c * sb_, sb_);
        const int owner = h_.order[static_cast<size_t>(l * M_ + c)];
        Phase2::vote_shard(k, op_, rule_, part, static_cast<uint64_t>(owner) * sw_, s, z);
      }
    }
    in.clear();
    node_recv_ = node_scratch_ = at::Tensor();
    // A node's vote is 0 where its ranks tie under "zero" (L even) or all
    // sent 0: then every node sends its plane of zeros (the sizes are known
    // on every rank without a further round).
    const bool can_zero = hs_.any_zero || (rule_.tie.mode == bits::TieBreak::kZero && L_ % 2 == 0);
    bits::HeaderSummary hs;
    hs.any_zero = can_zero;
    hs.zero_codes.assign(
        static_cast<size_t>(M_),
        can_zero ? bits::ZeroCode::at_most(sw_ * bits::kWordBits) : bits::ZeroCode{});
    hs.sent = hs.zero_codes;
    Phase1 p = send_shards(cross_, hs, sign, zero, sw_);
    wait_shards(cross_, p);
    at::Tensor scratch;
    const std::vector<PlaneIn> votes = receive_shards(cross_, hs, p, scratch);
    ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
    at::Tensor s = call_.bytes(static_cast<size_t>(sb_));
    at::Tensor z = call_.bytes(static_cast<size_t>(sb_));
    Phase2::vote_shard(k, op_, rule_, votes, static_cast<uint64_t>(c_.rank) * sw_, s, z);
    return {s, z};
  }

  // An all-gather of `mine` across nodes, then of the gathered slice inside
  // the node: [node rank j][cross rank c][mine's bytes].
  at::Tensor gather_twice(const at::Tensor& mine, const char* step) {
    const int64_t b = mine.numel();
    Inflight f = issue_allgather(cross_, cross_.bytes(static_cast<size_t>(M_ * b)), mine);
    count_allgather(h_.cross, static_cast<size_t>(b));
    const at::Tensor slice = wait_data(cross_, step, f);
    Inflight g = issue_allgather(node_, node_.bytes(static_cast<size_t>(N_ * b)), slice);
    count_allgather(h_.node, static_cast<size_t>(M_ * b));
    return wait_data(node_, step, g);
  }

  const SignComm& c_;
  const Hierarchy& h_;
  const HierarchyMode mode_;
  const bits::SignOp op_;
  const bits::CallRule rule_;
  const int N_, L_, M_;
  const SignCall call_; // over every rank (the header round)
  const SignCall node_; // inside the node
  const SignCall cross_; // across nodes
  size_t n_ = 0; // elements in all
  size_t sw_ = 0; // words a shard
  int64_t sb_ = 0; // bytes a shard plane
  at::Tensor sign_, zero_; // N shards of sw words, shard r at r * sw
  at::Tensor node_recv_, node_scratch_;
  bits::ZeroCode zero_code_;
  uint64_t nans_ = 0;
  bits::HeaderSummary hs_;
};

bits::DType dtype_of(const SignCall& call, const at::Tensor& t) {
  const auto d = bits_dtype(t.scalar_type());
  TORCH_CHECK(d.has_value(), where(call), "unsupported dtype ", t.scalar_type());
  return *d;
}

} // namespace

void sign_allreduce_hierarchical(
    const SignComm& c,
    const Hierarchy& h,
    HierarchyMode mode,
    at::Tensor& tensor,
    const PackedSigns* packed,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq) {
  HierRun run(c, h, mode, Collective::kAllReduce, op, rule, seq, tensor.device());
  const bits::DType dtype = dtype_of(SignCall(c, op, Collective::kAllReduce, seq), tensor);
  at::Tensor buf = tensor.contiguous().view({-1});
  if (packed != nullptr) {
    TORCH_CHECK(
        packed->numel == static_cast<uint64_t>(buf.numel()), "lionbit all_reduce_sign on ",
        c.here(), ": packed size mismatch");
    run.load_packed(*packed);
  } else {
    run.load_tensor(buf);
  }
  run.header(dtype, 0);
  c.stats->sign_allreduce_calls += 1;
  if (run.empty()) {
    return;
  }
  run.gather_and_unpack(run.reduce(), dtype, buf);
  if (buf.data_ptr() != tensor.data_ptr() || !tensor.is_contiguous()) {
    tensor.copy_(buf.view(tensor.sizes()));
  }
}

void sign_reduce_scatter_hierarchical(
    const SignComm& c,
    const Hierarchy& h,
    HierarchyMode mode,
    const PackedShards& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::TieRule& tie,
    uint64_t seq) {
  HierRun run(
      c, h, mode, Collective::kReduceScatter, op, bits::CallRule{tie, 0}, seq, out.device());
  const bits::DType dtype = dtype_of(SignCall(c, op, Collective::kReduceScatter, seq), out);
  TORCH_CHECK(
      static_cast<uint64_t>(out.numel()) == in.shard_numel && out.is_contiguous(),
      "lionbit reduce_scatter_sign on ", c.here(), ": output must be contiguous with ",
      in.shard_numel, " elements");
  run.load_shards(in);
  run.header(dtype, bits::kReduceScatter);
  c.stats->sign_reduce_scatter_calls += 1;
  if (run.empty()) {
    return;
  }
  run.unpack_own(run.reduce(), dtype, out);
}

} // namespace lionbit
