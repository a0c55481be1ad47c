// The Lion kernels, written once and compiled once per instruction set.
//
// The including file defines LIONBIT_OPTIM_NS (the namespace of this copy) and
// LIONBIT_OPTIM_ISA (its bits::Isa enumerator) and is compiled with that ISA's
// flags (cmake/isa.cmake) plus -ffp-contract=off for the whole
// library. Everything here lives in an anonymous namespace inside the per-ISA
// namespace, so no inline function compiled with one ISA's flags can be
// picked by the linker for another.
//
// The loops are written once over a vector type V (optimizer/lion_vec.h);
// whole 64-element words go through Vec, the last partial word through Sc.
#include <cstring>

#include "optimizer/lion_kernels.h"
#include "optimizer/lion_levels_impl.h"
#include "optimizer/lion_vec.h"
#include "signbits/float16.h"
#include "signbits/levels.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if !defined(LIONBIT_OPTIM_NS) || !defined(LIONBIT_OPTIM_ISA)
#error "define LIONBIT_OPTIM_NS and LIONBIT_OPTIM_ISA before including lion_impl.h"
#endif

// Nothing here calls an fmadd intrinsic, and -ffp-contract=off (set for the
// whole library in optimizer/CMakeLists.txt) keeps the compiler from fusing a
// separate mul and add even where the ISA's flags enable FMA (AVX-512F does).

namespace lionbit::optim::detail::LIONBIT_OPTIM_NS {
namespace {

using bits::DType;
using bits::kWordBits;
using bits::PackCounts;

// Loads, stores and the vector types Sc and Vec: optimizer/lion_vec.h.
using vec::load1;
using vec::Sc;
using vec::store1;
using vec::Vec;

// --------------------------------------------------------- direction ----

struct WordBits {
  uint64_t sign = 0;
  uint64_t zero = 0;
  uint64_t nan = 0;
  uint64_t nonfinite = 0;
};

// cnt (<= 64, a multiple of V::kW) elements from i0: new momentum stored
// into m_out (if Update; m_out may be m), the bits of c returned (bit j for
// element i0 + j).
template <class V, DType G, DType M, bool Update>
inline WordBits direction_run(
    const void* g,
    const void* m,
    void* m_out,
    size_t i0,
    unsigned cnt,
    const LionCoefs& k) {
  const typename V::F b1 = V::set1(k.b1);
  const typename V::F omb1 = V::set1(k.omb1);
  const typename V::F b2 = V::set1(k.b2);
  const typename V::F omb2 = V::set1(k.omb2);
  WordBits r;
  for (unsigned j = 0; j < cnt; j += V::kW) {
    const typename V::F gv = V::template load<G>(g, i0 + j);
    const typename V::F mv = V::template load<M>(m, i0 + j);
    const typename V::F c = V::add(V::mul(b1, mv), V::mul(omb1, gv));
    if constexpr (Update) {
      const typename V::F mn = V::add(V::mul(b2, mv), V::mul(omb2, gv));
      V::template store<M>(m_out, i0 + j, mn);
    }
    r.sign |= V::gt0(c) << j;
    r.zero |= V::eq0(c) << j;
    r.nan |= V::nan(c) << j;
    r.nonfinite |= V::nan(V::sub(c, c)) << j; // c - c is NaN iff c is NaN or +-Inf
  }
  return r;
}

inline void count_word(const WordBits& b, PackCounts& c) {
  if (b.zero != 0) {
    c.zeros += static_cast<uint64_t>(__builtin_popcountll(b.zero));
  }
  if (b.nan != 0) {
    c.nans += static_cast<uint64_t>(__builtin_popcountll(b.nan));
  }
  if (b.nonfinite != 0) {
    c.nonfinite += static_cast<uint64_t>(__builtin_popcountll(b.nonfinite));
  }
}

template <DType G, DType M, bool Update>
PackCounts direction_typed(
    const void* g,
    const void* m,
    void* m_out,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero) {
  PackCounts c;
  const size_t full = n / kWordBits;
  for (size_t w = 0; w < full; ++w) {
    const WordBits b = direction_run<Vec, G, M, Update>(g, m, m_out, w * kWordBits, kWordBits, k);
    sign[w] = b.sign;
    zero[w] = b.zero;
    count_word(b, c);
  }
  const unsigned rest = static_cast<unsigned>(n - full * kWordBits);
  if (rest != 0) {
    const WordBits b = direction_run<Sc, G, M, Update>(g, m, m_out, full * kWordBits, rest, k);
    sign[full] = b.sign;
    zero[full] = b.zero;
    count_word(b, c);
  }
  return c;
}

template <DType G>
PackCounts direction_grad(
    const void* g,
    DType md,
    const void* m,
    void* m_out,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero) {
  switch (md) {
    case DType::kFloat32:
      return m_out != nullptr
          ? direction_typed<G, DType::kFloat32, true>(g, m, m_out, n, k, sign, zero)
          : direction_typed<G, DType::kFloat32, false>(g, m, nullptr, n, k, sign, zero);
    case DType::kBFloat16:
      return m_out != nullptr
          ? direction_typed<G, DType::kBFloat16, true>(g, m, m_out, n, k, sign, zero)
          : direction_typed<G, DType::kBFloat16, false>(g, m, nullptr, n, k, sign, zero);
    default:
      return {};
  }
}

PackCounts direction(
    DType gd,
    const void* g,
    DType md,
    const void* m,
    void* m_out,
    size_t n,
    const LionCoefs& k,
    uint64_t* sign,
    uint64_t* zero) {
  switch (gd) {
    case DType::kFloat32:
      return direction_grad<DType::kFloat32>(g, md, m, m_out, n, k, sign, zero);
    case DType::kBFloat16:
      return direction_grad<DType::kBFloat16>(g, md, m, m_out, n, k, sign, zero);
    case DType::kFloat16:
      return direction_grad<DType::kFloat16>(g, md, m, m_out, n, k, sign, zero);
    default:
      return {};
  }
}

// ------------------------------------------------------------- apply ----

template <class V, DType X, DType D>
inline void apply_dense_one(
    void* x,
    const void* delta,
    size_t i,
    typename V::F lr,
    typename V::F decay) {
  const typename V::F xv = V::template load<X>(x, i);
  const typename V::F dv = V::template load<D>(delta, i);
  V::template store<X>(x, i, V::sub(V::mul(xv, decay), V::mul(lr, dv)));
}

template <DType X, DType D>
void apply_dense_typed(void* x, const void* delta, size_t n, float lr, float decay) {
  size_t i = 0;
  {
    const Vec::F lrv = Vec::set1(lr);
    const Vec::F dv = Vec::set1(decay);
    constexpr unsigned kW = Vec::kW;
    for (; i + 4 * kW <= n; i += 4 * kW) {
      apply_dense_one<Vec, X, D>(x, delta, i, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + kW, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + 2 * kW, lrv, dv);
      apply_dense_one<Vec, X, D>(x, delta, i + 3 * kW, lrv, dv);
    }
    for (; i + kW <= n; i += kW) {
      apply_dense_one<Vec, X, D>(x, delta, i, lrv, dv);
    }
  }
  for (; i < n; ++i) {
    apply_dense_one<Sc, X, D>(x, delta, i, lr, decay);
  }
}

template <DType X>
void apply_dense_param(void* x, DType dd, const void* delta, size_t n, float lr, float decay) {
  switch (dd) {
    case DType::kFloat32:
      return apply_dense_typed<X, DType::kFloat32>(x, delta, n, lr, decay);
    case DType::kBFloat16:
      return apply_dense_typed<X, DType::kBFloat16>(x, delta, n, lr, decay);
    case DType::kFloat16:
      return apply_dense_typed<X, DType::kFloat16>(x, delta, n, lr, decay);
    default:
      return;
  }
}

void apply_dense(DType xd, void* x, DType dd, const void* delta, size_t n, float lr, float decay) {
  switch (xd) {
    case DType::kFloat32:
      return apply_dense_param<DType::kFloat32>(x, dd, delta, n, lr, decay);
    case DType::kBFloat16:
      return apply_dense_param<DType::kBFloat16>(x, dd, delta, n, lr, decay);
    case DType::kFloat16:
      return apply_dense_param<DType::kFloat16>(x, dd, delta, n, lr, decay);
    default:
      return;
  }
}

// ------------------------------------------------------------ levels ----
// level_abs_sum and pack_levels: optimizer/lion_levels_impl.h.

} // namespace

const LionKernels& table() {
  static const LionKernels k{
      bits::Isa::LIONBIT_OPTIM_ISA, &direction, &apply_dense, &level_abs_sum, &pack_levels};
  return k;
}

} // namespace lionbit::optim::detail::LIONBIT_OPTIM_NS
