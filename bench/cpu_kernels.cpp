// Suite 2: throughput of lionbit's CPU kernels (Google Benchmark), one core,
// against the memory-read bandwidth of one core measured in the same run.
//
//   build/bench/lionbit_bench_cpu [--benchmark_format=json] [--benchmark_min_time=0.2s]
//
// Every kernel reports bytes_per_second over the bytes it must read (the
// "input" the goals talk about): pack reads 4 bytes per float32 element; vote
// reads N packed sign planes (d/8 bytes each); unpack reads its 1-2 planes and
// writes 4 bytes per element (reported: bytes written); lion_direction reads g
// and m and writes m (reported: bytes read, 8 per element). read_bw is a
// plain sum of 64-bit words over a buffer of the same size as the kernels'
// input, compiled -O3 for this machine: the one-core read bandwidth.
// The L1 levels (aggregation "l1", p bits): lion_level_sum and
// lion_pack_levels read g and m (8 bytes per element; the pack writes p
// bits), pack_levels reads c (4 bytes), vote_levels reads N ranks' p planes
// of a shard (the owner's exact sum).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "signbits/count.h"
#include "signbits/packed_runs.h"
#include "signbits/pack.h"
#include "signbits/trits.h"
#include "signbits/unpack.h"
#include "signbits/zeros.h"
#include "optimizer/lion.h"
#include "optimizer/lion_levels.h"
#include "signbits/levels.h"

namespace bits = lionbit::bits;
namespace optim = lionbit::optim;

namespace {

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::vector<float> v(n);
  std::mt19937 g(seed);
  std::normal_distribution<float> nd;
  for (auto& x : v) x = nd(g);
  return v;
}

std::vector<uint64_t> random_words(size_t n, uint32_t seed) {
  std::vector<uint64_t> v(n);
  std::mt19937_64 g(seed);
  for (auto& x : v) x = g();
  return v;
}

// One core's read bandwidth: the sum of a buffer of `bytes` bytes.
void BM_read_bw(benchmark::State& st) {
  const size_t bytes = static_cast<size_t>(st.range(0)) * 4;
  std::vector<uint64_t> buf = random_words(bytes / 8, 1);
  for (auto _ : st) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    const uint64_t* p = buf.data();
    for (size_t i = 0; i + 4 <= buf.size(); i += 4) {
      s0 += p[i];
      s1 += p[i + 1];
      s2 += p[i + 2];
      s3 += p[i + 3];
    }
    uint64_t s = s0 + s1 + s2 + s3;
    benchmark::DoNotOptimize(s);
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * bytes);
}

// Two streams read side by side, as the fused Lion passes read g and m: a
// sum of the 64-bit words of two buffers of n float32 each (8n bytes).
void BM_read_bw2(benchmark::State& st) {
  const size_t words = static_cast<size_t>(st.range(0)) / 2;
  std::vector<uint64_t> a = random_words(words, 8), b = random_words(words, 9);
  for (auto _ : st) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 2 <= words; i += 2) {
      s0 += a[i];
      s1 += a[i + 1];
      s2 += b[i];
      s3 += b[i + 1];
    }
    uint64_t s = s0 + s1 + s2 + s3;
    benchmark::DoNotOptimize(s);
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * words * 16);
}

void BM_pack(benchmark::State& st) {
  const size_t n = st.range(0);
  auto src = random_floats(n, 2);
  std::vector<uint64_t> sign(bits::words_for(n)), zero(bits::words_for(n));
  for (auto _ : st) {
    auto c = bits::pack_signs(bits::DType::kFloat32, src.data(), n, sign.data(), zero.data());
    benchmark::DoNotOptimize(c);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
}

// vote over N ranks' shards of `n` elements each (what one rank counts in phase 1).
void BM_vote(benchmark::State& st) {
  const size_t n = st.range(0);
  const int N = static_cast<int>(st.range(1));
  const size_t w = bits::words_for(n);
  // One buffer, rank r's plane at word r * w: the layout the all-to-all
  // receives into (so planes are a multiple of 4 KB apart, as in the backend).
  std::vector<uint64_t> planes = random_words(w * N, 10 + N);
  std::vector<bits::Contribution> in;
  for (int r = 0; r < N; ++r) in.push_back({planes.data() + r * w, nullptr});
  std::vector<uint64_t> out_sign(w), out_zero(w);
  for (auto _ : st) {
    bool ties = bits::vote(in.data(), N, w, out_sign.data(), out_zero.data());
    benchmark::DoNotOptimize(ties);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * N * w * 8);
}

// unpack a vote (sign + tie planes) into float32: reported over bytes written.
void BM_unpack(benchmark::State& st) {
  const size_t n = st.range(0);
  const size_t w = bits::words_for(n);
  auto s = random_words(w, 3), z = random_words(w, 4);
  const uint64_t* planes[2] = {s.data(), z.data()};
  const double values[4] = {-1, 1, 0, 0};
  float lut[4];
  bits::make_lut(bits::DType::kFloat32, values, 4, lut);
  std::vector<float> dst(n);
  for (auto _ : st) {
    bits::unpack(bits::DType::kFloat32, planes, 2, n, lut, dst.data());
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
}

// unpack P count planes (avg / sum at larger N: N = 8 with zeros needs 5,
// N = 16 6) into float32, from a table of 2^P values; GB/s of output.
void BM_unpack_counts(benchmark::State& st) {
  const size_t n = st.range(0);
  const int np = static_cast<int>(st.range(1));
  const size_t w = bits::words_for(n);
  std::vector<std::vector<uint64_t>> words;
  std::vector<const uint64_t*> planes;
  for (int b = 0; b < np; ++b) {
    words.push_back(random_words(w, 10 + b));
  }
  for (auto& p : words) {
    planes.push_back(p.data());
  }
  std::vector<double> values(size_t{1} << np);
  for (size_t e = 0; e < values.size(); ++e) {
    values[e] = static_cast<double>(e) / 8.0 - 1.0;
  }
  std::vector<float> lut(values.size());
  bits::make_lut(bits::DType::kFloat32, values.data(), values.size(), lut.data());
  std::vector<float> dst(n);
  for (auto _ : st) {
    bits::unpack(bits::DType::kFloat32, planes.data(), np, n, lut.data(), dst.data());
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
}

// A vote with dense ties as phase 2 sends it (inline ties): results in base
// 3, 13 bytes a word, decoded into float32. GB/s of output, as unpack.
void BM_unpack_trits(benchmark::State& st) {
  const size_t n = st.range(0);
  const size_t w = bits::words_for(n);
  auto s = random_words(w, 3), z = random_words(w, 4);
  std::vector<uint8_t> trits(w * bits::kTritBytesPerWord);
  bits::encode_trits(s.data(), z.data(), w, trits.data());
  const float lut[3] = {-1, 1, 0};
  std::vector<float> dst(n);
  for (auto _ : st) {
    bool ok = bits::decode_trits(bits::DType::kFloat32, trits.data(), n, lut, dst.data());
    benchmark::DoNotOptimize(ok);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
}

// Fused Lion step, part 1 (direction + momentum).
void BM_lion_direction(benchmark::State& st) {
  const size_t n = st.range(0);
  auto g = random_floats(n, 5), m = random_floats(n, 6);
  std::vector<uint64_t> sign(bits::words_for(n)), zero(bits::words_for(n));
  for (auto _ : st) {
    auto c = optim::lion_direction(
        bits::DType::kFloat32, g.data(), bits::DType::kFloat32, m.data(), n, 0.9f, 0.1f, 0.99f,
        0.01f, sign.data(), zero.data());
    benchmark::DoNotOptimize(c);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 8);
}

// L1, pass 1: sum |c| of c = b1 m + omb1 g (lion_levels.h).
void BM_lion_level_sum(benchmark::State& st) {
  const size_t n = st.range(0);
  auto g = random_floats(n, 5), m = random_floats(n, 6);
  for (auto _ : st) {
    double s = optim::lion_level_abs_sum(
        bits::DType::kFloat32, g.data(), bits::DType::kFloat32, m.data(), n, 0.9f, 0.1f);
    benchmark::DoNotOptimize(s);
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 8);
}

// L1, pass 2: the p-bit levels of c straight from g and m (m only read).
void BM_lion_pack_levels(benchmark::State& st) {
  const size_t n = st.range(0);
  const int p = static_cast<int>(st.range(1));
  auto g = random_floats(n, 5), m = random_floats(n, 6);
  const size_t w = bits::words_for(n);
  std::vector<uint64_t> planes(w * p);
  const double factor = bits::level_span(p) / 2.0;
  for (auto _ : st) {
    auto bad = optim::lion_pack_levels(
        bits::DType::kFloat32, g.data(), bits::DType::kFloat32, m.data(), n, 0.9f, 0.1f, 0.99f,
        0.01f, false, factor, optim::LevelPlanes{planes.data(), w, 0, p});
    benchmark::DoNotOptimize(bad);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 8);
}

// The levels of a float32 c (bits::pack_levels), 4 bytes read per element.
void BM_pack_levels(benchmark::State& st) {
  const size_t n = st.range(0);
  const int p = static_cast<int>(st.range(1));
  auto c = random_floats(n, 7);
  const size_t w = bits::words_for(n);
  std::vector<uint64_t> planes(w * p);
  const double factor = bits::level_span(p) / 2.0;
  for (auto _ : st) {
    auto bad = bits::pack_levels(c.data(), n, factor, p, planes.data(), w, 0);
    benchmark::DoNotOptimize(bad);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * n * 4);
}

// The owner's exact sum of N ranks' p-bit levels of a 16M-element shard:
// GB/s of packed input (N * p planes of d/8 bytes).
void BM_vote_levels(benchmark::State& st) {
  const size_t n = st.range(0);
  const int N = static_cast<int>(st.range(1));
  const int p = static_cast<int>(st.range(2));
  const size_t w = bits::words_for(n);
  std::vector<uint64_t> planes = random_words(w * p * N, 20 + N);
  std::vector<const uint64_t*> in;
  for (int r = 0; r < N; ++r) in.push_back(planes.data() + static_cast<size_t>(r) * p * w);
  std::vector<uint64_t> sign(w), tie(w);
  for (auto _ : st) {
    bits::vote_levels(in.data(), N, p, w, sign.data(), tie.data());
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations()) * N * p * w * 8);
}

// A plane of exact zeros as dead ReLU units leave them: 4 row-major (3072,
// 768) weight gradients, 13 % of the input units dead in each (a zero
// column: 9.4M elements, about a million runs of one). The packed runs'
// work a chunk, in the order a vote does it: the offer (zero_code_of: the
// bits and runs counted, the packed size found), its encoding (found
// afresh), its decoding, and the offer with the encoding after it (the
// tokens the offer found kept for it: what a vote that sends the plane
// pays). Items: runs.
std::vector<uint64_t> dead_columns_plane() {
  const size_t rows = 3072, cols = 768, layers = 4;
  std::vector<uint64_t> plane(bits::words_for(rows * cols * layers), 0);
  std::mt19937_64 rng(5);
  for (size_t l = 0; l < layers; ++l) {
    std::vector<bool> dead(cols);
    for (size_t c = 0; c < cols; ++c) dead[c] = rng() % 100 < 13;
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c = 0; c < cols; ++c) {
        const size_t i = (l * rows + r) * cols + c;
        plane[i / 64] |= dead[c] ? uint64_t{1} << (i % 64) : 0;
      }
    }
  }
  return plane;
}

void BM_packed_runs(benchmark::State& st) {
  const int step = static_cast<int>(st.range(0)); // 0 offer, 1 encode, 2 decode, 3 offer + encode
  const std::vector<uint64_t> plane = dead_columns_plane();
  const bits::ZeroCode code = bits::zero_code_of(plane.data(), plane.size());
  std::vector<uint8_t> wire(code.packed);
  bits::encode_packed_runs(plane.data(), plane.size(), wire.data(), wire.size());
  std::vector<uint64_t> back(plane.size());
  for (auto _ : st) {
    if (step == 0 || step == 3) {
      benchmark::DoNotOptimize(bits::zero_code_of(plane.data(), plane.size()));
    }
    if (step == 0) {
      bits::drop_kept_packed_runs(); // (not encoded: its kept tokens would pile up)
    } else if (step == 1 || step == 3) {
      bits::encode_packed_runs(plane.data(), plane.size(), wire.data(), wire.size());
    } else {
      benchmark::DoNotOptimize(
          bits::decode_packed_runs(wire.data(), wire.size(), back.size(), back.data()));
    }
    benchmark::ClobberMemory();
  }
  st.SetItemsProcessed(static_cast<int64_t>(st.iterations()) * static_cast<int64_t>(code.runs));
}

constexpr int64_t k16M = 16 << 20;

} // namespace

BENCHMARK(BM_read_bw)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_pack)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
// Vote input: N packed planes of a shard; 16M elements per plane = 2 MB each.
BENCHMARK(BM_vote)
    ->ArgsProduct({{k16M}, {2, 4, 8, 16}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_unpack)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_unpack_trits)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_unpack_counts)
    ->Args({k16M, 3})
    ->Args({k16M, 5})
    ->Args({k16M, 8})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_lion_direction)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_read_bw2)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_lion_level_sum)->Arg(k16M)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_lion_pack_levels)
    ->ArgsProduct({{k16M}, {2, 4, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_pack_levels)->Args({k16M, 4})->Unit(benchmark::kMillisecond)->UseRealTime();
// The owner's shard: 16M elements, N ranks' p planes (p = 4: 8 MB at N = 4).
BENCHMARK(BM_vote_levels)
    ->ArgsProduct({{k16M}, {2, 4, 8, 16}, {2, 4, 8}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
// Packed runs of a dead-columns plane: the offer, encoding, decoding, offer + encoding.
BENCHMARK(BM_packed_runs)->DenseRange(0, 3)->Unit(benchmark::kMillisecond)->UseRealTime();
// The read bandwidth once more, last: a run whose first benchmark is
// disturbed (a build finishing, another job) would otherwise divide every
// kernel by a low figure. The report takes the larger of the two.
BENCHMARK(BM_read_bw)
    ->Name("BM_read_bw_again")
    ->Arg(k16M)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
