#include "backend/sign_allreduce.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "signbits/count.h"
#include "signbits/pack.h"
#include "signbits/unpack.h"
#include "signbits/zeros.h"
#include "backend/call_trace.hpp"
#include "backend/phase1.hpp"
#include "backend/phase2.hpp"
#include "backend/sign_common.hpp"

namespace lionbit {
namespace {

// One pipelined chunk: elements [begin, begin + len) of the tensor.
struct Chunk {
  size_t group = 0; // its header round (Run::headers_)
  // Sent before its round: signs only, its zeros (if any rank has some)
  // following in Run::late_zeros_ (Run::stream_rest).
  bool signs_only = false;
  size_t begin = 0;
  size_t len = 0;
  size_t sw = 0; // words per shard
  size_t sb = 0; // bytes per shard plane
  at::Tensor sign_plane, zero_plane; // N * sw words each
  // phase 1
  Phase1 p1;
  at::Tensor decoded;
  // phase 2
  Phase2 fmt{};
  size_t msg = 0; // bytes each rank contributes to the all-gather
  at::Tensor mine_msg, mine_zero, gathered, tie_planes;
  at::Tensor local_ties; // the exchange: every shard's plane of zeros (kVoteSigns)
  Inflight ag;
};

// The whole collective on one tensor. The methods run in this order on every
// rank, so inner collectives are issued in the same order everywhere.
class Run {
 public:
  // `tensor` is packed here, or, with `packed`, its planes come from the
  // caller and `tensor` only receives the result.
  Run(const SignComm& c,
      at::Tensor& tensor,
      bits::SignOp op,
      const bits::CallRule& rule,
      uint64_t seq,
      const PackedSigns* packed = nullptr,
      const PackedLevels* levels = nullptr,
      bool planes = false,
      Agreement* agreed = nullptr)
      : c_(c),
        N_(c.world_size),
        op_(op),
        votes_(op == bits::SignOp::kVote || op == bits::SignOp::kLevels),
        rule_(rule),
        call_{c, op, Collective::kAllReduce, seq, tensor.device()},
        tensor_(tensor),
        packed_(packed),
        levels_(levels),
        planes_(planes),
        agreed_(agreed),
        exchange_(N_ == 2 && levels == nullptr && two_rank_exchange_allowed()),
        trace_(
            c.rank,
            c.world_size,
            bits::sign_op_name(op),
            seq,
            packed != nullptr ? packed->numel : static_cast<uint64_t>(tensor.numel())) {
    if (planes_) {
      // The result as planes (SignRequest::out_planes): formats other than
      // sign planes decode to bfloat16 values (-1, 0, +1 exactly), packed.
      TORCH_CHECK(packed != nullptr, where(call_), "internal: result planes without packed input");
      dtype_ = bits::DType::kBFloat16;
      buf_ = tensor;
      n_ = static_cast<size_t>(packed->numel);
    } else {
      const auto d = bits_dtype(tensor.scalar_type());
      TORCH_CHECK(d.has_value(), where(call_), "unsupported dtype ", tensor.scalar_type());
      dtype_ = *d;
      // Work on a contiguous 1-D buffer; for a non-contiguous input it is a
      // copy and the result is copied back at the end.
      buf_ = tensor.contiguous().view({-1});
      n_ = static_cast<size_t>(buf_.numel());
    }
    TORCH_CHECK(packed == nullptr || packed->numel == n_, where(call_), "packed size mismatch");
    TORCH_CHECK(levels == nullptr || levels->numel == n_, where(call_), "packed size mismatch");
    TORCH_CHECK(
        (op == bits::SignOp::kLevels) == (levels != nullptr), where(call_),
        "internal: levels without op l1");
    chunk_elems_ = bits::chunk_elems_for(requested_chunk_elems(N_, tensor.device()), N_);
    no_zeros_.zero_codes.assign(static_cast<size_t>(N_), bits::ZeroCode{});
    no_zeros_.sent = no_zeros_.zero_codes;
    no_zeros_.zero_most.assign(static_cast<size_t>(N_), 0);
  }

  void run() {
    const size_t chunks = n_ == 0 ? 0 : (n_ + chunk_elems_ - 1) / chunk_elems_;
    const size_t first = first_group(chunks);
    trace_.set_chunks(chunks);
    pack(first);
    trace_.mark("packed");
    header();
    trace_.mark("header");
    if (n_ == 0) {
      return;
    }
    // The exchange has no phase 2 to keep the link busy while a chunk is
    // counted: two of its chunks are in flight at once.
    const size_t ahead = exchange_ ? 2 : 1;
    if (first < chunks) {
      issue_upto(first); // the first chunk moves while the rest is packed
      stream_rest(chunks);
    }
    issue_upto(issued_ + ahead);
    for (size_t k = 0; k < chunks_.size(); ++k) {
      wait_shards(call_, chunks_[k].p1);
      Chunk& ch = chunks_[k];
      if (ch.signs_only && headers_[ch.group].any_zero) {
        if (!late_zeros_.recv.defined()) {
          wait_shards(call_, late_zeros_);
        }
        join_zeros(call_, headers_[ch.group], ch.p1, late_zeros_, k - late_first_);
      }
      trace_.mark("a2a_done", static_cast<int64_t>(k));
      issue_upto(k + 1 + ahead); // moves while this chunk is counted
      count_and_issue_phase2(k);
      if (k > 0) {
        finish(k - 1); // unpacks while chunk k moves
      }
    }
    finish(chunks_.size() - 1);
    if (votes_ && c_.tie_hint != nullptr && !exchange_) {
      // Same answer on every rank: every rank saw every shard's tie count.
      c_.tie_hint->store(dense_ties_);
    }
    if (buf_.data_ptr() != tensor_.data_ptr() || !tensor_.is_contiguous()) {
      ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
      tensor_.copy_(buf_.view(tensor_.sizes()));
    }
  }

 private:
  // Two ranks exchange whole chunks, so nothing can move before a header
  // round, and the round needs the packed chunks' NaN and zero counts: with
  // one round the link would wait for the whole pack. So the first chunk is
  // packed and announced alone and moves while the rest is packed
  // (stream_rest). Every rank decides alike (N, the op and the exchange
  // setting, which the first round checks).
  size_t first_group(size_t chunks) const { return exchange_ && chunks >= 2 ? 1 : chunks; }

  // The exchange's chunks after the first: the first half of them leave as
  // soon as each is packed, as signs only (their zeros' capacity is not
  // known yet), so the link never waits for the pack; the rest's round
  // follows them (a NaN anywhere raises there, on every rank, before any
  // result is written) and gives the capacities: the second half goes with
  // its zeros inline, and the first half's zeros, if any rank has some,
  // follow in one message of their own, ahead of the second half.
  void stream_rest(size_t chunks) {
    const size_t first = chunks_.size();
    const size_t half = first + (chunks - first) / 2;
    for (size_t i = first; i < chunks; ++i) {
      signs_only_ = i < half;
      pack(i + 1);
      if (signs_only_) {
        issue_upto(i + 1);
      }
    }
    signs_only_ = false;
    trace_.mark("packed_rest");
    header(); // a NaN anywhere raises here, on every rank: nothing is written yet
    trace_.mark("header_rest");
    const bits::HeaderSummary& hs = headers_.back();
    if (hs.any_zero && half > first) {
      std::vector<at::Tensor> planes; // full chunks: one shard size
      for (size_t i = first; i < half; ++i) {
        planes.push_back(chunks_[i].zero_plane);
      }
      late_first_ = first;
      late_zeros_ = send_zeros(call_, hs, planes, chunks_[first].sw);
      c_.stats->late_zero_chunks += half - first;
    }
    issue_upto(chunks);
  }

  // Packs chunks up to `end` (of the chunks_ not packed yet).
  void pack(size_t end) {
    ScopedTimer t(c_.stats->pack_ns, "lionbit::pack");
    const KernelSet& k = *call_.k;
    for (size_t begin = chunks_.size() * chunk_elems_; begin < n_ && chunks_.size() < end;
         begin += chunk_elems_) {
      Chunk ch;
      ch.group = headers_.size();
      ch.signs_only = signs_only_;
      ch.begin = begin;
      ch.len = std::min<size_t>(chunk_elems_, n_ - begin);
      ch.sw = bits::shard_words(ch.len, N_);
      ch.sb = ch.sw * 8;
      if (levels_ != nullptr) {
        pack_levels_chunk(ch);
        chunks_.push_back(std::move(ch));
        continue;
      }
      // Padding elements: sign 0, zero 0 (they vote -1 on every rank; their
      // results are never unpacked). Packed input: clean() writes every word
      // after the copy (the copied words cleaned, the rest zeroed), so the
      // planes need no zeros first.
      const int64_t total = static_cast<int64_t>(ch.sw * N_ * 8);
      const auto bytes = buf_.options().dtype(at::kByte);
      at::Tensor planes = packed_ == nullptr ? at::zeros({2 * total}, bytes)
                                             : at::empty({2 * total}, bytes);
      ch.sign_plane = planes.narrow(0, 0, total);
      ch.zero_plane = planes.narrow(0, total, total);
      if (packed_ == nullptr) {
        const bits::PackCounts pc = k.pack(
            buf_.narrow(0, static_cast<int64_t>(begin), static_cast<int64_t>(ch.len)),
            ch.sign_plane, ch.zero_plane, 0);
        nans_ += pc.nans;
        if (pc.zeros > 0) {
          add_zeros(k.zero_codes(ch.zero_plane, ch.sw));
        }
      } else {
        // Chunks start on word boundaries (a multiple of 64 * N elements).
        const int64_t used = static_cast<int64_t>(bits::words_for(ch.len) * 8);
        const int64_t from = static_cast<int64_t>(begin / 8);
        ch.sign_plane.narrow(0, 0, used).copy_(packed_->sign.narrow(0, from, used));
        ch.zero_plane.narrow(0, 0, used).copy_(packed_->zero.narrow(0, from, used));
        k.clean(ch.sign_plane, ch.zero_plane, ch.len);
        nans_ += begin == 0 ? packed_->nans : 0;
        // The shards' codes carry their zero counts: one read of the
        // device a chunk, not a count and then the codes.
        const std::vector<bits::ZeroCode> codes = k.zero_codes(ch.zero_plane, ch.sw);
        if (bits::max_code(codes).zeros > 0) {
          add_zeros(codes);
        }
      }
      chunks_.push_back(std::move(ch));
    }
  }

  // A packed chunk's zero codes (one a shard) join those announced at the
  // next round: shard k goes to rank k, or every shard to the other rank in
  // the exchange.
  void add_zeros(const std::vector<bits::ZeroCode>& shards) {
    if (to_.empty()) {
      to_.assign(static_cast<size_t>(N_), bits::ZeroCode{});
    }
    zero_code_ = bits::max_code(zero_code_, bits::max_code(shards));
    if (exchange_) {
      to_.assign(static_cast<size_t>(N_), zero_code_);
      return;
    }
    for (size_t k = 0; k < shards.size(); ++k) {
      to_[k] = bits::max_code(to_[k], shards[k]);
    }
  }

  // Levels: the caller's p planes of the chunk, rearranged shard by shard
  // ([shard k: plane 0 | plane 1 | ...], sw words each) so that phase 1
  // sends each owner its shard's planes as one block. Padding elements hold
  // level 0 (q = -s on every rank: never a tie; never unpacked).
  void pack_levels_chunk(Chunk& ch) {
    const int p = levels_->bits;
    const int64_t sw = static_cast<int64_t>(ch.sw);
    const int64_t block = p * sw; // words per shard
    ch.sign_plane = at::zeros({block * N_ * 8}, buf_.options().dtype(at::kByte));
    const int64_t first = static_cast<int64_t>(ch.begin / bits::kWordBits);
    const int64_t used = static_cast<int64_t>(bits::words_for(ch.begin + ch.len)) - first;
    const int64_t plane_words = static_cast<int64_t>(levels_->plane_words);
    // [shard k][plane b] <- plane b's words [first + k * sw, + sw), as bytes.
    for (int64_t k = 0; k < N_ && k * sw < used; ++k) {
      const int64_t nw = std::min(sw, used - k * sw);
      for (int b = 0; b < p; ++b) {
        ch.sign_plane.narrow(0, (k * block + b * sw) * 8, nw * 8)
            .copy_(levels_->planes.narrow(0, (b * plane_words + first + k * sw) * 8, nw * 8));
      }
    }
    // Bits past the tensor's last element: level 0, whatever the caller left.
    const unsigned tail = static_cast<unsigned>((ch.begin + ch.len) % bits::kWordBits);
    if (tail != 0) {
      const int64_t last = used - 1;
      const int64_t k = last / sw;
      const int64_t mask = static_cast<int64_t>((uint64_t{1} << tail) - 1);
      at::Tensor words = ch.sign_plane.view(at::kLong);
      for (int b = 0; b < p; ++b) {
        words.narrow(0, k * block + b * sw + (last - k * sw), 1).bitwise_and_(mask);
      }
    }
    if (ch.begin == 0) {
      nans_ += levels_->nans;
    }
  }

  // Every rank learns every rank's size, dtype, op, order, chunking and
  // zero/NaN flags (of the chunks packed since the last round), and all
  // raise together if they disagree.
  void header() {
    uint32_t flags = header_flags(call_, zero_code_.zeros, nans_);
    if (votes_ && c_.tie_hint != nullptr && c_.tie_hint->load()) {
      flags |= bits::kTieHint;
    }
    const auto mine = bits::make_header(
        op_, dtype_, c_.rank, flags, call_.seq, n_, zero_code_, chunk_elems_, rule_);
    headers_.push_back(header_round(call_, mine, to_));
    const bits::HeaderSummary& hs = headers_.back();
    zero_code_ = bits::ZeroCode{};
    to_.clear();
    nans_ = 0;
    if (agreed_ != nullptr && chunks_.size() * chunk_elems_ >= n_) {
      agreed_->agree(true); // the call's last round: every chunk announced, every rank agreed
    }
    if (headers_.size() > 1) {
      return; // the same call, announced in two groups
    }
    // No phase 2 moves in the exchange, so ties never ride inline (nor set the hint).
    inline_ties_ = votes_ && hs.inline_ties && !exchange_;
    c_.stats->sign_allreduce_calls += 1;
    c_.stats->elements += n_;
  }

  // Issues phase 1 of the chunks before `end` not yet issued.
  void issue_upto(size_t end) {
    for (; issued_ < std::min(end, chunks_.size()); ++issued_) {
      issue_phase1(issued_);
    }
  }

  // Phase 1 (backend/phase1.hpp): rank k gets every rank's shard k.
  void issue_phase1(size_t idx) {
    Chunk& ch = chunks_[idx];
    // Levels: a shard is p planes of sw words, and no rank sends zeros.
    const size_t block = levels_ != nullptr ? static_cast<size_t>(levels_->bits) * ch.sw : ch.sw;
    const bits::HeaderSummary& hs = ch.signs_only ? no_zeros_ : headers_[ch.group];
    ch.p1 = send_shards(call_, hs, ch.sign_plane, ch.zero_plane, block, exchange_);
    trace_.mark("a2a_issued", static_cast<int64_t>(idx));
  }

  // Phase 2 (backend/phase2.hpp): count and vote the own shard; start the
  // all-gather of every shard's result.
  void count_and_issue_phase2(size_t idx) {
    Chunk& ch = chunks_[idx];
    if (exchange_) {
      vote_every_shard(ch);
      trace_.mark("counted", static_cast<int64_t>(idx));
      return;
    }
    const bits::HeaderSummary& hs = headers_[ch.group];
    const std::vector<PlaneIn> in = receive_shards(call_, hs, ch.p1, ch.decoded);
    ch.fmt = Phase2::choose(op_, rule_, N_, ch.sw, inline_ties_, hs.zero_most);
    {
      ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
      ch.msg = ch.fmt.message_bytes();
      ch.mine_msg = call_.bytes(ch.msg);
      if (ch.fmt.format == Phase2Format::kVoteSigns) {
        ch.mine_zero = call_.bytes(ch.sb);
      }
      if (ch.fmt.format == Phase2Format::kVoteTrits) {
        c_.stats->inline_tie_chunks += 1;
      }
      const uint64_t first_word = ch.begin / bits::kWordBits +
          static_cast<uint64_t>(c_.rank) * ch.sw;
      const std::string error = ch.fmt.encode(*call_.k, in, first_word, ch.mine_msg, ch.mine_zero);
      TORCH_CHECK(error.empty(), where(call_), error);
    }
    trace_.mark("counted", static_cast<int64_t>(idx));
    ch.p1 = Phase1(); // phase-1 buffers are no longer needed
    ch.decoded = at::Tensor();
    count_allgather(c_, ch.msg);
    ch.ag = issue_allgather(call_, call_.bytes(ch.msg * N_), ch.mine_msg);
  }

  // The exchange: after it every rank holds both ranks' planes and writes
  // every shard's phase-2 message (and, for kVoteSigns, its plane of zeros)
  // itself, as the shard's owner would have: `gathered` then holds what the
  // all-gather would have brought, and `tie_planes` the zeros a tie round
  // would have fetched.
  void vote_every_shard(Chunk& ch) {
    const bits::HeaderSummary& hs = headers_[ch.group];
    ch.fmt = Phase2::choose(op_, rule_, N_, ch.sw, inline_ties_, hs.zero_most);
    ScopedTimer t(c_.stats->vote_ns, "lionbit::count");
    ch.msg = ch.fmt.message_bytes();
    ch.gathered = call_.bytes(ch.msg * N_);
    if (ch.fmt.format == Phase2Format::kVoteSigns) {
      ch.local_ties = call_.bytes(ch.sb * N_);
    }
    if (ch.fmt.format == Phase2Format::kVoteTrits) {
      c_.stats->inline_tie_chunks += 1;
    }
    for (int k = 0; k < N_; ++k) {
      const std::vector<PlaneIn> in = exchanged_shard(
          call_, hs, ch.p1, ch.sign_plane, ch.zero_plane, k, ch.decoded);
      at::Tensor msg = ch.gathered.narrow(0, k * static_cast<int64_t>(ch.msg), ch.msg);
      at::Tensor ties = ch.local_ties.defined()
          ? ch.local_ties.narrow(0, k * static_cast<int64_t>(ch.sb), ch.sb)
          : at::Tensor();
      const uint64_t first_word = ch.begin / bits::kWordBits + static_cast<uint64_t>(k) * ch.sw;
      const std::string error = ch.fmt.encode(*call_.k, in, first_word, msg, ties);
      TORCH_CHECK(error.empty(), where(call_), error);
    }
    ch.p1 = Phase1();
    ch.decoded = at::Tensor();
  }

  // Waits for the chunk's all-gather (and, for a vote with ties, fetches the
  // tie positions), then unpacks every shard into the buffer.
  void finish(size_t idx) {
    Chunk& ch = chunks_[idx];
    if (!exchange_) {
      ch.gathered = wait_data(call_, "all-gather of shard results (phase 2)", ch.ag);
    }
    trace_.mark("ag_done", static_cast<int64_t>(idx));
    bits::ZeroCode tie_code;
    if (ch.fmt.counts_ties()) {
      std::vector<bits::ZeroCode> ties;
      int sender = -1;
      const std::string corrupt = ch.fmt.ties_in(ch.gathered, ties, sender);
      TORCH_CHECK_VALUE(
          corrupt.empty(), where(call_), "rank ", call_.c.name(sender), " sent ", corrupt);
      for (const bits::ZeroCode& t : ties) {
        tie_code = bits::max_code(tie_code, t);
      }
      // A tie plane is the cheapest encoding of these ties: worth carrying
      // inline next time (kTieHint).
      dense_ties_ = dense_ties_ || bits::zero_form(tie_code, ch.sw) == bits::ZeroForm::kPlane;
      if (tie_code.zeros > 0 && ch.fmt.format == Phase2Format::kVoteSigns) {
        if (exchange_) {
          ch.tie_planes = ch.local_ties; // every shard's zeros are here already: no round
        } else {
          fetch_ties(ch, ties);
          trace_.mark("ties_done", static_cast<int64_t>(idx));
        }
      }
    }
    TORCH_CHECK(
        ch.fmt.planes <= bits::kMaxUnpackPlanes, where(call_), "world size ", N_,
        " is too large for op ", bits::sign_op_name(op_));
    {
      ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
      const bool tie_planes = ch.tie_planes.defined();
      const Phase2Decoder decoder(ch.fmt, op_, dtype_, tie_planes, call_.device);
      const size_t per_shard = ch.sw * bits::kWordBits;
      const int64_t msg = static_cast<int64_t>(ch.msg);
      const int64_t sb = static_cast<int64_t>(ch.sb);
      const int64_t plane = static_cast<int64_t>(bits::words_for(n_) * 8);
      at::Tensor sign = planes_ ? buf_.narrow(0, 0, plane) : at::Tensor();
      at::Tensor zero = planes_ ? buf_.narrow(0, plane, plane) : at::Tensor();
      for (int k = 0; k < N_ && static_cast<size_t>(k) * per_shard < ch.len; ++k) {
        const size_t begin = static_cast<size_t>(k) * per_shard;
        const size_t len = std::min(per_shard, ch.len - begin);
        const at::Tensor in = ch.gathered.narrow(0, k * msg, msg);
        const at::Tensor ties = tie_planes ? ch.tie_planes.narrow(0, k * sb, sb) : at::Tensor();
        std::string corrupt;
        if (planes_) {
          corrupt = decoder.decode_planes(*call_.k, in, ties, sign, zero, ch.begin + begin, len);
        } else {
          at::Tensor dst = buf_.narrow(
              0, static_cast<int64_t>(ch.begin + begin), static_cast<int64_t>(len));
          corrupt = decoder.decode(*call_.k, in, ties, dst);
        }
        TORCH_CHECK_VALUE(
            corrupt.empty(), where(call_), "rank ", call_.c.name(k), " sent ", corrupt);
      }
    }
    trace_.mark("unpacked", static_cast<int64_t>(idx));
    ch = Chunk(); // release the chunk's buffers
  }

  // Some shard of the chunk has a tie (or an all-zero element): its tie
  // positions are needed everywhere, as a list of positions or runs, or a
  // plane: each owner's at its own size (`ties`: their codes). Only then is
  // this round paid.
  void fetch_ties(Chunk& ch, const std::vector<bits::ZeroCode>& ties) {
    c_.stats->tie_rounds += 1;
    const size_t me = static_cast<size_t>(c_.rank);
    std::vector<int64_t> zb(ties.size());
    bool same = true;
    for (size_t k = 0; k < ties.size(); ++k) {
      zb[k] = static_cast<int64_t>(bits::zero_encoding_bytes(ties[k], ch.sw));
      same = same && zb[k] == zb[0];
    }
    // Owners whose encodings differ in size send theirs to every rank in an
    // all-to-all; all of one size (dense ties everywhere), an all-gather.
    at::Tensor mine_enc = call_.bytes(static_cast<size_t>(zb[me]));
    call_.k->encode_zeros(ch.mine_zero, ties[me], mine_enc);
    int64_t total = 0;
    for (const int64_t b : zb) {
      total += b;
    }
    at::Tensor recv = call_.bytes(static_cast<size_t>(total));
    Inflight f;
    if (same) {
      f = issue_allgather(call_, recv, mine_enc);
    } else {
      at::Tensor send = mine_enc.repeat({N_});
      f = issue_alltoall(call_, recv, send, zb, std::vector<int64_t>(ties.size(), zb[me]));
    }
    at::Tensor gathered_zero = wait_data(call_, "all-gather of tie positions (phase 2)", f);
    c_.stats->bytes_sent += static_cast<uint64_t>(zb[me] * (N_ - 1));
    c_.stats->bytes_received += static_cast<uint64_t>(total - zb[me]);
    count_zero_encodings(c_, ties[me], ch.sw, N_ - 1);
    const bool planes = std::all_of(ties.begin(), ties.end(), [&](const bits::ZeroCode& z) {
      return bits::zero_form(z, ch.sw) == bits::ZeroForm::kPlane;
    });
    if (planes) {
      ch.tie_planes = gathered_zero;
      return;
    }
    ScopedTimer t(c_.stats->unpack_ns, "lionbit::unpack");
    const int64_t sb = static_cast<int64_t>(ch.sb);
    ch.tie_planes = call_.bytes(ch.sb * N_);
    int64_t at = 0;
    for (int k = 0; k < N_; ++k) {
      const size_t q = static_cast<size_t>(k);
      at::Tensor plane = ch.tie_planes.narrow(0, k * sb, sb);
      const bits::ZeroForm form = bits::zero_form(ties[q], ch.sw);
      const at::Tensor enc = gathered_zero.narrow(0, at, zb[q]);
      at += zb[q];
      if (form == bits::ZeroForm::kNone) {
        plane.zero_();
      } else if (form == bits::ZeroForm::kPlane) {
        plane.copy_(enc);
      } else {
        TORCH_CHECK_VALUE(
            call_.k->decode_zeros(enc, ties[q], plane), where(call_), "rank ", call_.c.name(k),
            " sent a corrupt ", bits::zero_form_noun(form), " of ties");
      }
    }
  }

  const SignComm& c_;
  const int N_;
  const bits::SignOp op_;
  const bool votes_; // vote or levels: phase 2 is a vote's
  const bits::CallRule rule_;
  const SignCall call_;
  at::Tensor& tensor_;
  const PackedSigns* packed_;
  const PackedLevels* levels_;
  const bool planes_; // the result as planes into tensor_ (SignRequest::out_planes)
  Agreement* const agreed_; // resolved at the last header round (or null)
  bits::DType dtype_;
  at::Tensor buf_;
  size_t n_ = 0;
  uint64_t chunk_elems_ = 0;
  uint64_t nans_ = 0;
  bool inline_ties_ = false; // vote: phase-2 messages carry the ties (kVoteTrits)
  // Two ranks: each sends the other its whole planes and votes every shard
  // itself (the same encoders and decoders as the two phases, run locally):
  // the 1-bit figure's bytes, no second round. Every rank decides alike (the
  // header round checks kTwoPhase, LIONBIT_SIGN_EXCHANGE=0, on every rank).
  const bool exchange_;
  bool signs_only_ = false; // stream_rest: the chunks packed now leave as signs only
  bits::HeaderSummary no_zeros_; // their format: no rank sends zeros
  Phase1 late_zeros_; // their zeros, when the rest's round showed some
  size_t late_first_ = 0; // the first of them: late_zeros_ holds them in order
  bool dense_ties_ = false; // vote: some chunk's ties were cheapest as a plane
  bits::ZeroCode zero_code_; // of the chunks packed since the last round
  std::vector<bits::ZeroCode> to_; // the same, per receiver (empty: no zeros)
  std::vector<Chunk> chunks_;
  size_t issued_ = 0; // chunks whose phase 1 is issued
  std::vector<bits::HeaderSummary> headers_; // one a group of chunks (Chunk::group)
  CallTrace trace_; // LIONBIT_TRACE; its line is written when the run ends
};

} // namespace

void sign_allreduce(
    const SignComm& c,
    at::Tensor& tensor,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq) {
  Run(c, tensor, op, rule, seq).run();
}

void sign_allreduce_packed(
    const SignComm& c,
    const PackedSigns& in,
    at::Tensor& out,
    bits::SignOp op,
    const bits::CallRule& rule,
    uint64_t seq,
    Agreement* agreed) {
  Run(c, out, op, rule, seq, &in, nullptr, false, agreed).run();
}

void sign_allreduce_packed_planes(
    const SignComm& c,
    const PackedSigns& in,
    at::Tensor& out,
    const bits::TieRule& tie,
    uint64_t seq,
    Agreement* agreed) {
  Run(c, out, bits::SignOp::kVote, bits::CallRule{tie, 0}, seq, &in, nullptr, true, agreed).run();
}

void levels_allreduce_packed(
    const SignComm& c,
    const PackedLevels& in,
    at::Tensor& out,
    const bits::TieRule& tie,
    uint64_t seq,
    Agreement* agreed) {
  Run(c, out, bits::SignOp::kLevels, bits::CallRule{tie, in.bits}, seq, nullptr, &in, false, agreed)
      .run();
}

} // namespace lionbit
