#include "zeros.h"

#include <cstring>

#include "bit_runs.h"
#include "kernels.h"
#include "packed_runs.h"

namespace lionbit::bits {

namespace {

// Each form's name and how a message names it, by ZeroForm value.
struct FormNames {
  const char* name;
  const char* noun;
};
constexpr FormNames kFormNames[] = {
    {"none", "nothing"}, {"list", "list of positions"}, {"runs", "list of runs"},
    {"plane", "plane"},  {"packed", "packed runs"},
};

const FormNames* names_of(ZeroForm f) {
  const auto i = static_cast<size_t>(f);
  return i < sizeof kFormNames / sizeof kFormNames[0] ? &kFormNames[i] : nullptr;
}

} // namespace

const char* zero_form_name(ZeroForm f) {
  const FormNames* n = names_of(f);
  return n != nullptr ? n->name : "unknown";
}

const char* zero_form_noun(ZeroForm f) {
  const FormNames* n = names_of(f);
  return n != nullptr ? n->noun : "encoding";
}

uint64_t count_bits(const uint64_t* words, size_t n_words, Isa isa) {
  return detail::kernels_for(isa).count_bits(words, n_words);
}

uint64_t count_runs(const uint64_t* words, size_t n_words, Isa isa) {
  return detail::kernels_for(isa).count_runs(words, n_words);
}

namespace {

// List slots: the count rounded up to an even number, so that a list is a
// whole number of 64-bit words and every plane after it stays aligned.
uint64_t list_slots(uint64_t zeros) {
  return (zeros + 1) & ~uint64_t{1};
}

void put_u32(uint8_t* out, uint64_t slot, uint32_t v) {
  std::memcpy(out + 4 * slot, &v, 4);
}

uint32_t get_u32(const uint8_t* in, uint64_t slot) {
  uint32_t v;
  std::memcpy(&v, in + 4 * slot, 4);
  return v;
}

} // namespace

uint64_t packed_offer(const uint64_t* plane, size_t words, uint64_t runs) {
  if (runs == 0 || static_cast<uint64_t>(words) * kWordBits >= static_cast<uint64_t>(kNoIndex)) {
    return 0;
  }
  return packed_runs_bytes(plane, words, runs, static_cast<uint64_t>(words) * 8 * 3 / 4 / 8 * 8);
}

bool packed_worth_a_copy(uint64_t zeros, uint64_t runs, size_t words) {
  const size_t sparse = zero_encoding_bytes(ZeroCode{zeros, runs, 0}, words);
  return sparse * 32 > words * 8;
}

ZeroCode zero_code_of(const uint64_t* plane, size_t words) {
  const uint64_t zeros = count_bits(plane, words);
  if (zeros == 0) {
    return ZeroCode{};
  }
  const uint64_t runs = count_runs(plane, words);
  return ZeroCode{zeros, runs, packed_offer(plane, words, runs)};
}

ZeroForm zero_form(const ZeroCode& code, size_t words) {
  if (code.zeros == 0) {
    return ZeroForm::kNone;
  }
  const uint64_t plane = static_cast<uint64_t>(words) * 8;
  if (static_cast<uint64_t>(words) * kWordBits >= static_cast<uint64_t>(kNoIndex)) {
    return ZeroForm::kPlane; // 32-bit offsets cannot index it
  }
  const uint64_t list = list_slots(code.zeros) * 4;
  // runs <= zeros, so this never overflows for a list that could win.
  const uint64_t runs = code.runs <= code.zeros ? code.runs * 8 : plane;
  const uint64_t packed = code.packed > 0 && code.packed % 8 == 0 ? code.packed : plane;
  if (list < plane && list <= runs && list <= packed) {
    return ZeroForm::kList;
  }
  if (runs < plane && runs <= packed) {
    return ZeroForm::kRuns;
  }
  return packed < plane ? ZeroForm::kPacked : ZeroForm::kPlane;
}

size_t zero_encoding_bytes(const ZeroCode& code, size_t words) {
  switch (zero_form(code, words)) {
    case ZeroForm::kNone:
      return 0;
    case ZeroForm::kList:
      return static_cast<size_t>(list_slots(code.zeros)) * 4;
    case ZeroForm::kRuns:
      return static_cast<size_t>(code.runs) * 8;
    case ZeroForm::kPacked:
      return static_cast<size_t>(code.packed);
    case ZeroForm::kPlane:
      break;
  }
  return words * 8;
}

void encode_zeros(const uint64_t* plane, size_t words, const ZeroCode& code, uint8_t* out) {
  const ZeroForm form = zero_form(code, words);
  if (form == ZeroForm::kNone) {
    return;
  }
  if (form == ZeroForm::kPlane) {
    std::memcpy(out, plane, words * 8);
    return;
  }
  if (form == ZeroForm::kPacked) {
    encode_packed_runs(plane, words, out, static_cast<size_t>(code.packed));
    return;
  }
  uint64_t k = 0;
  if (form == ZeroForm::kList) {
    for (size_t w = 0; w < words && k < code.zeros; ++w) {
      uint64_t bits = plane[w];
      while (bits != 0 && k < code.zeros) {
        put_u32(out, k++, static_cast<uint32_t>(w * kWordBits + __builtin_ctzll(bits)));
        bits &= bits - 1;
      }
    }
    for (; k < list_slots(code.zeros); ++k) {
      put_u32(out, k, kNoIndex);
    }
    return;
  }
  const uint64_t limit = static_cast<uint64_t>(words) * kWordBits;
  for (uint64_t at = next_bit(plane, words, 0, true); at < limit && k < code.runs;
       at = next_bit(plane, words, at, true)) {
    const uint64_t end = next_bit(plane, words, at, false);
    put_u32(out, 2 * k, static_cast<uint32_t>(at));
    put_u32(out, 2 * k + 1, static_cast<uint32_t>(end));
    ++k;
    at = end;
  }
  for (; k < code.runs; ++k) {
    put_u32(out, 2 * k, kNoIndex);
    put_u32(out, 2 * k + 1, kNoIndex);
  }
}

bool decode_zeros(const uint8_t* in, size_t words, const ZeroCode& code, uint64_t* plane) {
  const ZeroForm form = zero_form(code, words);
  if (form == ZeroForm::kPlane) {
    std::memcpy(plane, in, words * 8);
    return true;
  }
  if (form == ZeroForm::kPacked) {
    return decode_packed_runs(in, static_cast<size_t>(code.packed), words, plane);
  }
  std::memset(plane, 0, words * 8);
  if (form == ZeroForm::kNone) {
    return true;
  }
  const uint64_t limit = static_cast<uint64_t>(words) * kWordBits;
  // Entries (an offset, or a run's two ends) of `width` slots: padding only
  // after the last one, `count` at most.
  const uint64_t width = form == ZeroForm::kList ? 1 : 2;
  const uint64_t entries = form == ZeroForm::kList ? list_slots(code.zeros) : code.runs;
  const uint64_t count = form == ZeroForm::kList ? code.zeros : code.runs;
  int64_t last = -1; // the last offset set, or the last run's end
  for (uint64_t k = 0; k < entries; ++k) {
    const uint32_t a = get_u32(in, width * k);
    const uint32_t b = width == 2 ? get_u32(in, width * k + 1) : a;
    if (a == kNoIndex) {
      if (b != kNoIndex) {
        return false;
      }
      for (uint64_t r = width * (k + 1); r < width * entries; ++r) {
        if (get_u32(in, r) != kNoIndex) {
          return false; // an entry after padding
        }
      }
      return true;
    }
    if (k >= count) {
      return false;
    }
    if (width == 1) {
      if (a >= limit || static_cast<int64_t>(a) <= last) {
        return false;
      }
      plane[a / kWordBits] |= uint64_t{1} << (a % kWordBits);
      last = a;
      continue;
    }
    // A run [a, b): not empty, inside the plane, after the last one's end
    // with a gap (runs are maximal).
    if (b <= a || b > limit || static_cast<int64_t>(a) <= last) {
      return false;
    }
    set_bit_range(plane, a, b);
    last = b;
  }
  return true;
}

} // namespace lionbit::bits
