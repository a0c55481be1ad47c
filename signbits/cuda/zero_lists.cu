// Zero and tie planes on the GPU: their per-block tallies, their lists of
// positions or runs (bits::encode_zeros' list and runs forms) and those lists
// read back (bits::decode_zeros), so that a plane with a few zeros costs a
// few small launches instead of a host round trip per step of the coder.
//
// Tiles: a block of kTileThreads threads covers kTileWords consecutive words,
// each thread kTileWordsPerThread of them in order. A list of positions is an
// ordered stream compaction: (1) each tile counts its selected bits, (2) one
// block turns the tile counts into exclusive offsets, (3) each tile scans its
// threads' counts and every thread writes its bits' positions from its
// offset on. The per-word logic is zero_lists.cuh's.
#include "signbits/cuda/kernels.h"
#include "signbits/cuda/launch.cuh"
#include "signbits/cuda/zero_lists.cuh"

namespace lionbit::cuda {
namespace detail {
namespace {

constexpr int kTileWarps = kTileThreads / 32;

// The block-wide exclusive prefix sum of one value a thread (and the block's
// total in *total). Every thread of the block must call it.
__device__ __forceinline__ unsigned long long block_exclusive_sum(
    unsigned long long v,
    unsigned long long* total) {
  __shared__ unsigned long long warp_sums[kTileWarps];
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x / 32;
  unsigned long long inclusive = v;
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long up = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= static_cast<unsigned>(d)) {
      inclusive += up;
    }
  }
  if (lane == 31) {
    warp_sums[warp] = inclusive;
  }
  __syncthreads();
  unsigned long long before = 0, all = 0;
  for (int w = 0; w < kTileWarps; ++w) {
    before += w < static_cast<int>(warp) ? warp_sums[w] : 0;
    all += warp_sums[w];
  }
  __syncthreads(); // warp_sums is reused by the next call
  *total = all;
  return before + inclusive - v;
}

// Per-block tallies: out[2k] += set bits, out[2k + 1] += run starts of block
// k (blocks of block_words words; words past blocks * block_words ignored).
__global__ void __launch_bounds__(kTileThreads) count_blocks_kernel(
    const uint64_t* __restrict__ plane,
    size_t block_words,
    size_t words,
    unsigned long long* __restrict__ out) {
  for (size_t tile = blockIdx.x; tile * kTileWords < words; tile += gridDim.x) {
    const size_t base = tile * kTileWords;
    const size_t end = base + kTileWords < words ? base + kTileWords : words;
    const bool one_block = base / block_words == (end - 1) / block_words;
    unsigned long long bits = 0, starts = 0;
    const size_t first = base + static_cast<size_t>(threadIdx.x) * kTileWordsPerThread;
    size_t cur = first / block_words;
    for (unsigned j = 0; j < kTileWordsPerThread; ++j) {
      const size_t i = first + j;
      if (i >= end) {
        break;
      }
      if (!one_block && i / block_words != cur) {
        if (bits != 0) {
          atomicAdd(&out[2 * cur], bits);
          atomicAdd(&out[2 * cur + 1], starts);
        }
        bits = starts = 0;
        cur = i / block_words;
      }
      bits += static_cast<unsigned long long>(popc64z(plane[i]));
      starts += static_cast<unsigned long long>(
          popc64z(edge_word(Edge::kRunFirst, plane, words, block_words, i)));
    }
    if (one_block) {
      unsigned long long all_bits = 0, all_starts = 0;
      block_exclusive_sum(bits, &all_bits);
      block_exclusive_sum(starts, &all_starts);
      if (threadIdx.x == 0 && all_bits != 0) {
        const size_t k = base / block_words;
        atomicAdd(&out[2 * k], all_bits);
        atomicAdd(&out[2 * k + 1], all_starts);
      }
    } else if (bits != 0) {
      atomicAdd(&out[2 * cur], bits);
      atomicAdd(&out[2 * cur + 1], starts);
    }
  }
}

__global__ void __launch_bounds__(kBlockThreads)
    clean_kernel(uint64_t* sign, uint64_t* zero, size_t words, uint64_t limit) {
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t k = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < words;
       k += step) {
    clean_word(sign, zero, k, limit);
  }
}

// The selected bits of one thread's words of a tile.
__device__ __forceinline__ unsigned long long thread_count(
    const uint64_t* plane,
    size_t words,
    Edge edge,
    size_t first) {
  unsigned long long c = 0;
  for (unsigned j = 0; j < kTileWordsPerThread && first + j < words; ++j) {
    c += static_cast<unsigned long long>(popc64z(edge_word(edge, plane, words, words, first + j)));
  }
  return c;
}

// (1) tile_counts[t] = the selected bits of tile t.
__global__ void __launch_bounds__(kTileThreads) tile_count_kernel(
    const uint64_t* __restrict__ plane,
    size_t words,
    Edge edge,
    unsigned long long* __restrict__ tile_counts) {
  for (size_t tile = blockIdx.x; tile * kTileWords < words; tile += gridDim.x) {
    const size_t first = tile * kTileWords + static_cast<size_t>(threadIdx.x) * kTileWordsPerThread;
    unsigned long long total = 0;
    block_exclusive_sum(thread_count(plane, words, edge, first), &total);
    if (threadIdx.x == 0) {
      tile_counts[tile] = total;
    }
  }
}

// (2) tile_counts -> exclusive offsets, in place, by one block.
__global__ void __launch_bounds__(kTileThreads)
    tile_offsets_kernel(unsigned long long* tile_counts, size_t tiles) {
  unsigned long long carry = 0;
  for (size_t at = 0; at < tiles; at += kTileThreads) {
    const size_t t = at + threadIdx.x;
    const unsigned long long v = t < tiles ? tile_counts[t] : 0;
    unsigned long long total = 0;
    const unsigned long long before = block_exclusive_sum(v, &total);
    if (t < tiles) {
      tile_counts[t] = carry + before;
    }
    carry += total;
  }
}

// (3) every selected bit's position (+ add) into slot width * index + lane.
__global__ void __launch_bounds__(kTileThreads) positions_kernel(
    const uint64_t* __restrict__ plane,
    size_t words,
    Edge edge,
    const unsigned long long* __restrict__ tile_offsets,
    uint32_t add,
    unsigned width,
    unsigned lane,
    uint64_t cap,
    uint8_t* __restrict__ out) {
  for (size_t tile = blockIdx.x; tile * kTileWords < words; tile += gridDim.x) {
    const size_t first = tile * kTileWords + static_cast<size_t>(threadIdx.x) * kTileWordsPerThread;
    unsigned long long total = 0;
    uint64_t index = tile_offsets[tile] +
        block_exclusive_sum(thread_count(plane, words, edge, first), &total);
    for (unsigned j = 0; j < kTileWordsPerThread && first + j < words && index < cap; ++j) {
      const size_t i = first + j;
      index = emit_positions(
          edge_word(edge, plane, words, words, i), i, index, add, width, lane, cap, out);
    }
  }
}

// Checks entry k of a received list (a corrupt one sets *bad) and sets what
// it names.
__global__ void __launch_bounds__(kBlockThreads) decode_entries_kernel(
    const uint8_t* __restrict__ in,
    uint64_t entries,
    uint64_t count,
    unsigned width,
    uint64_t limit,
    uint64_t* plane,
    unsigned* bad) {
  // A thread an offset; a warp a run (its lanes share the run's inner words).
  const unsigned lanes = width == 2 ? kEntryLanes : 1;
  const unsigned lane = threadIdx.x % lanes;
  const size_t thread = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t step = static_cast<size_t>(gridDim.x) * blockDim.x / lanes;
  for (size_t k = thread / lanes; k < entries; k += step) {
    if (lane == 0 && entry_corrupt(in, entries, count, width, limit, k)) {
      *bad = 1u;
    }
    set_entry(in, width, limit, k, plane, lane, lanes);
  }
}

unsigned tile_grid(size_t words) {
  const size_t tiles = (words + kTileWords - 1) / kTileWords;
  const size_t cap = static_cast<size_t>(sm_count()) * 8;
  return static_cast<unsigned>(tiles < cap ? (tiles == 0 ? 1 : tiles) : cap);
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(
        std::string("lionbit: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

} // namespace
} // namespace detail

void count_blocks(
    const uint64_t* plane,
    size_t block_words,
    size_t blocks,
    unsigned long long* out,
    cudaStream_t stream) {
  if (blocks == 0) {
    return;
  }
  detail::check_cuda(
      cudaMemsetAsync(out, 0, 2 * blocks * sizeof(unsigned long long), stream),
      "cudaMemsetAsync (count_blocks)");
  if (block_words == 0) {
    return;
  }
  const size_t words = blocks * block_words;
  detail::count_blocks_kernel<<<detail::tile_grid(words), detail::kTileThreads, 0, stream>>>(
      plane, block_words, words, out);
  detail::check_launch("count_blocks");
}

void clean(uint64_t* sign, uint64_t* zero, size_t words, uint64_t limit, cudaStream_t stream) {
  if (words == 0) {
    return;
  }
  static const int resident = detail::resident_blocks(detail::clean_kernel);
  detail::clean_kernel<<<
      detail::grid_for(words, detail::kBlockThreads, resident), detail::kBlockThreads, 0, stream>>>(
      sign, zero, words, limit);
  detail::check_launch("clean");
}

size_t positions_scratch(size_t words) {
  return (words + detail::kTileWords - 1) / detail::kTileWords;
}

void positions(
    const uint64_t* plane,
    size_t words,
    PlaneEdge edge,
    uint32_t add,
    unsigned width,
    unsigned lane,
    uint64_t cap,
    uint8_t* out,
    unsigned long long* scratch,
    cudaStream_t stream) {
  if (words == 0 || cap == 0) {
    return;
  }
  const auto e = static_cast<detail::Edge>(static_cast<int>(edge));
  const unsigned grid = detail::tile_grid(words);
  detail::tile_count_kernel<<<grid, detail::kTileThreads, 0, stream>>>(plane, words, e, scratch);
  detail::check_launch("positions (tile counts)");
  detail::tile_offsets_kernel<<<1, detail::kTileThreads, 0, stream>>>(
      scratch, positions_scratch(words));
  detail::check_launch("positions (tile offsets)");
  detail::positions_kernel<<<grid, detail::kTileThreads, 0, stream>>>(
      plane, words, e, scratch, add, width, lane, cap, out);
  detail::check_launch("positions");
}

void decode_entries(
    const uint8_t* in,
    uint64_t entries,
    uint64_t count,
    unsigned width,
    size_t words,
    uint64_t* plane,
    unsigned* bad,
    cudaStream_t stream) {
  detail::check_cuda(cudaMemsetAsync(plane, 0, words * 8, stream), "cudaMemsetAsync (decode)");
  detail::check_cuda(cudaMemsetAsync(bad, 0, sizeof(unsigned), stream), "cudaMemsetAsync (decode)");
  if (entries == 0) {
    return;
  }
  static const int resident = detail::resident_blocks(detail::decode_entries_kernel);
  const size_t units = width == 2 ? entries * detail::kEntryLanes : entries;
  detail::decode_entries_kernel<<<
      detail::grid_for(units, detail::kBlockThreads, resident), detail::kBlockThreads, 0, stream>>>(
      in, entries, count, width, static_cast<uint64_t>(words) * 64, plane, bad);
  detail::check_launch("decode_entries");
}

} // namespace lionbit::cuda
