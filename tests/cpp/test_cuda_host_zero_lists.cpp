// The zero-list kernels of signbits/cuda/zero_lists.cu run on the host: the
// per-word logic of zero_lists.cuh compiled by g++, the kernels' tiles,
// threads and scans emulated with plain loops in the same order, checked
// against the CPU coder (bits::count_bits / count_runs, encode_zeros,
// decode_zeros) on planes from one stray bit to dense runs, and on
// corrupted lists.
#include "signbits/cuda/zero_lists.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "signbits/zeros.h"

namespace lionbit::cuda_test {
namespace {

namespace cd = lionbit::cuda::detail;
using Words = std::vector<uint64_t>;
using Bytes = std::vector<uint8_t>;

// count_blocks_kernel: every tile, every thread's words in order, a block's
// tallies flushed when the thread's words cross into the next block.
std::vector<uint64_t> emu_count_blocks(const Words& plane, size_t block_words, size_t blocks) {
  std::vector<uint64_t> out(2 * blocks, 0);
  const size_t words = blocks * block_words;
  for (size_t base = 0; base < words; base += cd::kTileWords) {
    const size_t end = std::min(base + cd::kTileWords, words);
    for (unsigned t = 0; t < cd::kTileThreads; ++t) {
      const size_t first = base + static_cast<size_t>(t) * cd::kTileWordsPerThread;
      uint64_t bits = 0, starts = 0;
      size_t cur = first / block_words;
      for (unsigned j = 0; j < cd::kTileWordsPerThread && first + j < end; ++j) {
        const size_t i = first + j;
        if (i / block_words != cur) {
          out[2 * cur] += bits;
          out[2 * cur + 1] += starts;
          bits = starts = 0;
          cur = i / block_words;
        }
        bits += static_cast<uint64_t>(cd::popc64z(plane[i]));
        starts += static_cast<uint64_t>(
            cd::popc64z(cd::edge_word(cd::Edge::kRunFirst, plane.data(), words, block_words, i)));
      }
      if (first < end) {
        out[2 * cur] += bits;
        out[2 * cur + 1] += starts;
      }
    }
  }
  return out;
}

uint64_t thread_count(const Words& plane, cd::Edge edge, size_t first) {
  uint64_t c = 0;
  for (unsigned j = 0; j < cd::kTileWordsPerThread && first + j < plane.size(); ++j) {
    c += static_cast<uint64_t>(
        cd::popc64z(cd::edge_word(edge, plane.data(), plane.size(), plane.size(), first + j)));
  }
  return c;
}

// positions(): tile counts, their exclusive offsets, then each tile's
// threads from their exclusive offsets.
void emu_positions(
    const Words& plane,
    cd::Edge edge,
    uint32_t add,
    unsigned width,
    unsigned lane,
    uint64_t cap,
    uint8_t* out) {
  const size_t words = plane.size();
  const size_t tiles = (words + cd::kTileWords - 1) / cd::kTileWords;
  std::vector<uint64_t> offsets(tiles, 0);
  for (size_t tile = 0; tile < tiles; ++tile) {
    for (unsigned t = 0; t < cd::kTileThreads; ++t) {
      offsets[tile] += thread_count(
          plane, edge, tile * cd::kTileWords + t * cd::kTileWordsPerThread);
    }
  }
  uint64_t carry = 0;
  for (uint64_t& o : offsets) {
    const uint64_t c = o;
    o = carry;
    carry += c;
  }
  for (size_t tile = 0; tile < tiles; ++tile) {
    uint64_t before = 0;
    for (unsigned t = 0; t < cd::kTileThreads; ++t) {
      const size_t first = tile * cd::kTileWords + t * cd::kTileWordsPerThread;
      uint64_t index = offsets[tile] + before;
      before += thread_count(plane, edge, first);
      for (unsigned j = 0; j < cd::kTileWordsPerThread && first + j < words && index < cap; ++j) {
        const size_t i = first + j;
        index = cd::emit_positions(
            cd::edge_word(edge, plane.data(), words, words, i), i, index, add, width, lane, cap,
            out);
      }
    }
  }
}

// encode_entries of backend/kernels_cuda.cpp: padding, then the positions.
Bytes emu_encode(const Words& plane, const bits::ZeroCode& code) {
  const size_t words = plane.size();
  Bytes out(bits::zero_encoding_bytes(code, words), 0xff);
  if (bits::zero_form(code, words) == bits::ZeroForm::kList) {
    emu_positions(plane, cd::Edge::kBits, 0, 1, 0, code.zeros, out.data());
  } else {
    emu_positions(plane, cd::Edge::kRunFirst, 0, 2, 0, code.runs, out.data());
    emu_positions(plane, cd::Edge::kRunLast, 1, 2, 1, code.runs, out.data());
  }
  return out;
}

// decode_entries_kernel: each entry checked and set on its own, a run's by
// a warp's lanes (in reverse, so no lane relies on another having run first).
bool emu_decode(const Bytes& in, const bits::ZeroCode& code, Words& plane) {
  const bool list = bits::zero_form(code, plane.size()) == bits::ZeroForm::kList;
  const uint64_t entries = list ? (code.zeros + 1) & ~uint64_t{1} : code.runs;
  const uint64_t count = list ? code.zeros : code.runs;
  const unsigned width = list ? 1 : 2;
  const uint64_t limit = static_cast<uint64_t>(plane.size()) * 64;
  std::fill(plane.begin(), plane.end(), 0);
  bool bad = false;
  for (uint64_t k = 0; k < entries; ++k) {
    bad = bad || cd::entry_corrupt(in.data(), entries, count, width, limit, k);
    const unsigned lanes = width == 2 ? cd::kEntryLanes : 1;
    for (unsigned lane = lanes; lane-- > 0;) {
      cd::set_entry(in.data(), width, limit, k, plane.data(), lane, lanes);
    }
  }
  return !bad;
}

void set_bit(Words& p, size_t i) {
  p[i / 64] |= uint64_t{1} << (i % 64);
}

// Planes of `words` words: k scattered bits, or runs of random lengths, or
// runs across word edges, or the last bit, or everything.
std::vector<Words> planes_of(size_t words, std::mt19937_64& rng) {
  std::vector<Words> out;
  const size_t n = words * 64;
  for (size_t k : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{100}, n / 3}) {
    Words p(words, 0);
    for (size_t j = 0; j < k; ++j) {
      set_bit(p, rng() % n);
    }
    out.push_back(p);
  }
  for (size_t len : {size_t{1}, size_t{5}, size_t{63}, size_t{64}, size_t{65}, size_t{300}}) {
    Words p(words, 0);
    for (size_t at = rng() % 50; at + len <= n; at += len + 1 + rng() % (3 * len + 10)) {
      for (size_t i = at; i < at + len; ++i) {
        set_bit(p, i);
      }
    }
    out.push_back(p);
  }
  Words last(words, 0);
  set_bit(last, n - 1);
  set_bit(last, 0);
  out.push_back(last);
  out.push_back(Words(words, ~uint64_t{0}));
  return out;
}

const std::vector<size_t> kWords = {1, 3, 64, 2047, 2048, 2049, 5000};

TEST(CudaHostZeroLists, BlockTalliesAreBitsAndRuns) {
  std::mt19937_64 rng(7);
  for (size_t words : kWords) {
    for (const Words& p : planes_of(words, rng)) {
      for (size_t block : {size_t{1}, size_t{2}, size_t{5}, size_t{8}, size_t{2048}, words}) {
        const size_t blocks = words / block;
        const std::vector<uint64_t> got = emu_count_blocks(p, block, blocks);
        for (size_t k = 0; k < blocks; ++k) {
          ASSERT_EQ(got[2 * k], bits::count_bits(p.data() + k * block, block))
              << "words=" << words << " block=" << block << " k=" << k;
          ASSERT_EQ(got[2 * k + 1], bits::count_runs(p.data() + k * block, block))
              << "words=" << words << " block=" << block << " k=" << k;
        }
      }
    }
  }
}

// The codes encode_zeros may see: exact, with room to spare, and a cap
// below the plane's bits (the first ones are written).
std::vector<bits::ZeroCode> codes_for(const Words& p) {
  const uint64_t z = bits::count_bits(p.data(), p.size());
  const uint64_t r = bits::count_runs(p.data(), p.size());
  std::vector<bits::ZeroCode> out{
      bits::ZeroCode{z, r}, bits::ZeroCode{z + 1, r + 1}, bits::ZeroCode::at_most(z),
      bits::ZeroCode::at_most(z + 3)};
  return out;
}

TEST(CudaHostZeroLists, ListsAndRunsEncodeAsTheCpu) {
  std::mt19937_64 rng(11);
  int checked = 0;
  for (size_t words : kWords) {
    for (const Words& p : planes_of(words, rng)) {
      for (const bits::ZeroCode& code : codes_for(p)) {
        const bits::ZeroForm form = bits::zero_form(code, words);
        if (form != bits::ZeroForm::kList && form != bits::ZeroForm::kRuns) {
          continue;
        }
        Bytes want(bits::zero_encoding_bytes(code, words));
        bits::encode_zeros(p.data(), words, code, want.data());
        ASSERT_EQ(emu_encode(p, code), want) << "words=" << words << " code=(" << code.zeros << ", "
                                             << code.runs << ") " << bits::zero_form_name(form);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(CudaHostZeroLists, DecodeAcceptsAndRefusesAsTheCpu) {
  std::mt19937_64 rng(13);
  int refused = 0, accepted = 0;
  for (size_t words : {size_t{1}, size_t{3}, size_t{64}, size_t{2049}}) {
    for (const Words& p : planes_of(words, rng)) {
      for (const bits::ZeroCode& code : codes_for(p)) {
        const bits::ZeroForm form = bits::zero_form(code, words);
        if (form != bits::ZeroForm::kList && form != bits::ZeroForm::kRuns) {
          continue;
        }
        Bytes enc(bits::zero_encoding_bytes(code, words));
        bits::encode_zeros(p.data(), words, code, enc.data());
        std::vector<Bytes> variants{enc};
        const size_t slots = enc.size() / 4;
        for (int v = 0; v < 24; ++v) {
          Bytes bad = enc;
          const size_t s = rng() % slots;
          uint32_t x;
          std::memcpy(&x, bad.data() + 4 * s, 4);
          switch (v % 6) {
            case 0:
              x += 1;
              break;
            case 1:
              x -= 1;
              break;
            case 2:
              x = bits::kNoIndex;
              break;
            case 3:
              x = static_cast<uint32_t>(words * 64);
              break;
            case 4:
              x = static_cast<uint32_t>(rng());
              break;
            default: {
              const size_t t = rng() % slots;
              uint32_t y;
              std::memcpy(&y, bad.data() + 4 * t, 4);
              std::memcpy(bad.data() + 4 * t, &x, 4);
              x = y;
            }
          }
          std::memcpy(bad.data() + 4 * s, &x, 4);
          variants.push_back(bad);
        }
        for (const Bytes& in : variants) {
          Words want(words, 0x5a5a), got(words, 0xa5a5);
          const bool ok_want = bits::decode_zeros(in.data(), words, code, want.data());
          const bool ok_got = emu_decode(in, code, got);
          ASSERT_EQ(ok_got, ok_want) << "words=" << words << " code=(" << code.zeros << ", "
                                     << code.runs << ") " << bits::zero_form_name(form);
          if (ok_want) {
            ASSERT_EQ(got, want);
            ++accepted;
          } else {
            ++refused;
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 100);
}

TEST(CudaHostZeroLists, CleanClearsPastTheEndAndZerosWin) {
  std::mt19937_64 rng(17);
  for (size_t words : {size_t{1}, size_t{3}}) {
    for (uint64_t limit :
         {uint64_t{0}, uint64_t{1}, uint64_t{63}, uint64_t{64}, uint64_t{65},
          uint64_t{words * 64 - 1}, uint64_t{words * 64}}) {
      if (limit > words * 64) {
        continue;
      }
      Words sign(words), zero(words);
      for (size_t k = 0; k < words; ++k) {
        sign[k] = rng();
        zero[k] = rng() & rng();
      }
      Words s = sign, z = zero;
      for (size_t k = 0; k < words; ++k) {
        cd::clean_word(s.data(), z.data(), k, limit);
      }
      for (uint64_t i = 0; i < words * 64; ++i) {
        const bool zi = i < limit && ((zero[i / 64] >> (i % 64)) & 1);
        const bool si = i < limit && !zi && ((sign[i / 64] >> (i % 64)) & 1);
        ASSERT_EQ(((z[i / 64] >> (i % 64)) & 1) != 0, zi) << "limit=" << limit << " i=" << i;
        ASSERT_EQ(((s[i / 64] >> (i % 64)) & 1) != 0, si) << "limit=" << limit << " i=" << i;
      }
    }
  }
}

} // namespace
} // namespace lionbit::cuda_test
