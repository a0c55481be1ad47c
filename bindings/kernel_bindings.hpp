// Tensor-level entry points to the bit kernels for Python (lionbit._C): what
// the optimizer uses to pack many parameters' direction bits into one flat
// buffer for a single collective.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "signbits/types.h"

namespace lionbit {

// Raises ValueError "lionbit.<op>: <problem>" when a check of
// backend/torch_adapter.hpp found one.
inline void require(const char* op, const std::string& problem) {
  TORCH_CHECK_VALUE(problem.empty(), "lionbit.", op, ": ", problem);
}

// Packs the signs of `t` (contiguous, a sign all-reduce dtype) into the uint8
// planes `sign` / `zero` at bit offset `bit_offset`, with the kernel set of
// t's device (backend/kernel_set.hpp: kernels_for); the planes must be on the
// same device. Returns (zeros, nans) counted in `t`, on the host (on a GPU:
// after the kernel ran on the device's current stream).
std::tuple<int64_t, int64_t> pack_signs_into(
    const at::Tensor& t,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset);

// Lion Cub's L1 levels (signbits/levels.h): quantizes `c` (contiguous
// float32) with q = clamp(rint(c * factor), -s, s) and ORs the p = `bits`
// bit-planes of q + s into `planes` (uint8 on c's device: `bits` planes of
// equal size, plane b at byte b * planes.numel() / bits) at bit
// `bit_offset`, with the kernel set of c's device. Returns the number of
// non-finite values in `c` (on the host).
int64_t pack_levels_into(
    const at::Tensor& c,
    double factor,
    int64_t bits,
    at::Tensor& planes,
    int64_t bit_offset);

// Lion Cub's L1 levels straight from g and m (optimizer/lion_levels.h), with
// the kernel set of g's device: lion_level_abs_sum returns sum |c| (float64,
// on the host) of c = b1 m + omb1 g; lion_pack_levels_into ORs the `bits`
// planes of c's levels with `factor` into `planes` (as pack_levels_into)
// and, with update_momentum, sets m = b2 m + omb2 g in the same pass.
// Returns the number of non-finite c.
double lion_level_abs_sum(const at::Tensor& g, const at::Tensor& m, double b1, double omb1);
int64_t lion_pack_levels_into(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    double factor,
    int64_t bits,
    at::Tensor& planes,
    int64_t bit_offset,
    bool update_momentum);

// The signs the tie rule `tie_break` ("alternate" / "random") with `seed`
// gives words [first_word, first_word + words) of a tensor
// (signbits/ties.h), as int64 words (bit set: +1).
at::Tensor tie_words(int64_t words, const std::string& tie_break, int64_t seed, int64_t first_word);

// Fused Lion direction (optimizer/lion.h): reads g and m once, writes the new
// m in place (unless update_momentum is false; with `m_out`, into m_out, m only
// read: lion_direction_to) and the direction's bits into the planes at
// `bit_offset`. Returns the number of non-finite directions (NaN or +-Inf: a
// non-finite g or m). Coefficients as in lion.h.
int64_t lion_direction_into(
    const at::Tensor& g,
    at::Tensor& m,
    double b1,
    double omb1,
    double b2,
    double omb2,
    at::Tensor& sign,
    at::Tensor& zero,
    int64_t bit_offset,
    bool update_momentum,
    const std::optional<at::Tensor>& m_out = std::nullopt);

// The elements a list call takes of its pair i: [start, start + count).
struct Span {
  size_t start, count;
};

// A direction list's spans: every pair whole (starts and lengths None), or
// pair i's elements [starts[i], starts[i] + lengths[i]), so that a caller
// passes the pieces of a tensor without making a view of each (FSDP's
// chunks of a parameter). Raises ValueError naming `op` and the entry
// (`name`: the list's argument).
std::vector<Span> list_spans(
    const char* op,
    const std::vector<at::Tensor>& gs,
    const std::optional<std::vector<int64_t>>& starts,
    const std::optional<std::vector<int64_t>>& lengths,
    const char* name = "gs");

// lion_direction_into over a list of CPU tensors in one call (the step of a
// model of many small tensors pays one call, not one a tensor): pair i's bits
// (of its span, list_spans) at bit_offsets[i]; with sign and zero None, the
// momentum update alone (update_momentum must be true); with `m_outs`, pair
// i's new momentum (of its span) goes to the same elements of m_outs[i], ms
// only read. The pairs' dtypes may differ. Every pair is checked before any
// momentum changes. Returns the non-finite count of all.
int64_t lion_direction_list(
    const std::vector<at::Tensor>& gs,
    std::vector<at::Tensor>& ms,
    double b1,
    double omb1,
    double b2,
    double omb2,
    const std::optional<at::Tensor>& sign,
    const std::optional<at::Tensor>& zero,
    const std::vector<int64_t>& bit_offsets,
    bool update_momentum,
    const std::optional<std::vector<int64_t>>& starts = std::nullopt,
    const std::optional<std::vector<int64_t>>& lengths = std::nullopt,
    const std::optional<std::vector<at::Tensor>>& m_outs = std::nullopt);

// x = x * decay - lr * delta, in place (optimizer/lion.h); the list form
// updates xs[i] from deltas[i], every pair checked first.
void lion_apply(at::Tensor& x, const at::Tensor& delta, double lr, double decay);
void lion_apply_list(
    std::vector<at::Tensor>& xs,
    const std::vector<at::Tensor>& deltas,
    double lr,
    double decay);

// x = x * decay - lr * Delta, in place, Delta from a vote's result planes:
// bits [bit_offset, bit_offset + x.numel()) of `sign` and `zero`
// (optimizer/lion.h lion_apply_planes); the list form updates xs[i] (its
// span, list_spans: FSDP1's segments of a flat shard) from the bits at
// bit_offsets[i] of the same planes, every one checked first.
void lion_apply_planes(
    at::Tensor& x,
    const at::Tensor& sign,
    const at::Tensor& zero,
    int64_t bit_offset,
    double lr,
    double decay);
void lion_apply_planes_list(
    std::vector<at::Tensor>& xs,
    const at::Tensor& sign,
    const at::Tensor& zero,
    const std::vector<int64_t>& bit_offsets,
    double lr,
    double decay,
    const std::optional<std::vector<int64_t>>& starts = std::nullopt,
    const std::optional<std::vector<int64_t>>& lengths = std::nullopt);

// Whether the fused kernels take these dtypes.
bool lion_fused_supported(at::ScalarType param, at::ScalarType grad, at::ScalarType momentum);

// backend/kernel_check.hpp's check of `candidate` against `reference` on
// `device` with inputs from `seed`: (kernel, case) per mismatch.
std::vector<std::tuple<std::string, std::string>> check_kernel_sets(
    const std::string& candidate,
    const std::string& reference,
    const std::string& device,
    int64_t seed);

// The name of the set the sign collectives use on `device`
// (kernels_for(device).name(): LIONBIT_KERNELS applied).
std::string kernel_set_name(const std::string& device);

} // namespace lionbit
