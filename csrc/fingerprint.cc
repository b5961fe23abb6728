// Fingerprints and byte comparisons of arrays: the keys of an op's kept states (jaxbind/_state.py).
//
// A kept state is found again by the exact values of the inputs it was made
// for: a fingerprint picks the candidate, a comparison of every byte decides.
// Both read memory once at its speed, so finding a state costs about what
// copying its inputs would.

#include "internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace {

// Accumulates each 8 bytes, xor a key, as the product of their 32-bit halves,
// in independent lanes: SSE2's (AVX2's) unsigned 32x32->64 multiply does two
// (four) at once, so the loop runs about as fast as memory is read. x86-64
// always has SSE2; AVX2 is used where the processor has it; elsewhere the
// same arithmetic runs on 64-bit words. Not a cryptographic hash, and weak
// where a word's keyed half is zero: a collision costs a byte comparison,
// never a wrong state.
constexpr uint64_t kKeys[8] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                               0x082EFA98EC4E6C89ull, 0x452821E638D01377ull, 0xBE5466CF34E90C6Cull,
                               0xC0AC29B7C97C50DDull, 0x3F84D5B5B5470917ull};

uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 33);
}

// Adds the 64-byte blocks of data[0, blocks * 64) into acc[8].
void AccumulatePortable(const unsigned char* data, size_t blocks, uint64_t* acc) {
  for (size_t b = 0; b < blocks; ++b) {
    for (int k = 0; k < 8; ++k) {
      uint64_t word;
      std::memcpy(&word, data + 64 * b + 8 * k, 8);
      const uint64_t keyed = word ^ kKeys[k];
      acc[k] += (keyed & 0xFFFFFFFFull) * (keyed >> 32);
    }
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
void AccumulateSse2(const unsigned char* data, size_t blocks, uint64_t* acc) {
  __m128i sums[4], keys[4];
  for (int k = 0; k < 4; ++k) {
    sums[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + 2 * k));
    keys[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kKeys + 2 * k));
  }
  for (size_t b = 0; b < blocks; ++b) {
    for (int k = 0; k < 4; ++k) {
      const __m128i keyed = _mm_xor_si128(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 64 * b + 16 * k)), keys[k]);
      sums[k] = _mm_add_epi64(sums[k], _mm_mul_epu32(keyed, _mm_srli_epi64(keyed, 32)));
    }
  }
  for (int k = 0; k < 4; ++k) _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + 2 * k), sums[k]);
}

__attribute__((target("avx2"))) void AccumulateAvx2(const unsigned char* data, size_t blocks,
                                                    uint64_t* acc) {
  __m256i sums[2], keys[2];
  for (int k = 0; k < 2; ++k) {
    sums[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4 * k));
    keys[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kKeys + 4 * k));
  }
  for (size_t b = 0; b < blocks; ++b) {
    for (int k = 0; k < 2; ++k) {
      const __m256i keyed = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + 64 * b + 32 * k)), keys[k]);
      sums[k] = _mm256_add_epi64(sums[k], _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32)));
    }
  }
  for (int k = 0; k < 2; ++k) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4 * k), sums[k]);
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#endif

uint64_t MixWords(const unsigned char* data, size_t size, uint64_t seed) {
  uint64_t acc[8];
  for (int k = 0; k < 8; ++k) acc[k] = seed ^ kKeys[(k + 3) % 8];
  const size_t blocks = size / 64;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (kHasAvx2) {
    AccumulateAvx2(data, blocks, acc);
  } else {
    AccumulateSse2(data, blocks, acc);
  }
#else
  AccumulatePortable(data, blocks, acc);
#endif
  uint64_t h = seed ^ (size * 0x9E3779B97F4A7C15ull);
  for (int k = 0; k < 8; ++k) h = Avalanche(h ^ acc[k]) + static_cast<uint64_t>(k);
  for (size_t i = 64 * blocks; i < size; ++i) h = (h ^ data[i]) * 0x100000001B3ull;
  return Avalanche(h);
}

PyArrayObject* ContiguousArray(nb::handle obj) {
  if (!PyArray_Check(obj.ptr())) throw nb::type_error("a NumPy array expected");
  auto* array = reinterpret_cast<PyArrayObject*>(obj.ptr());
  if (!PyArray_IS_C_CONTIGUOUS(array)) throw nb::value_error("a C-contiguous array expected");
  return array;
}

// Of a sequence of C-contiguous arrays: their dtypes, shapes and bytes.
int64_t Fingerprint(nb::sequence arrays) {
  uint64_t h = 0x6A09E667F3BCC908ull;
  for (nb::handle obj : arrays) {
    PyArrayObject* array = ContiguousArray(obj);
    const int ndim = PyArray_NDIM(array);
    int64_t layout[2 + NPY_MAXDIMS];
    layout[0] = PyArray_DESCR(array)->type_num;
    layout[1] = ndim;
    for (int d = 0; d < ndim; ++d) layout[2 + d] = PyArray_DIM(array, d);
    h = MixWords(reinterpret_cast<const unsigned char*>(layout), sizeof(int64_t) * (2 + ndim), h);
    h = MixWords(static_cast<const unsigned char*>(PyArray_DATA(array)),
                 static_cast<size_t>(PyArray_NBYTES(array)), h);
  }
  return static_cast<int64_t>(h >> 1);
}

// Whether two sequences of C-contiguous arrays hold the same dtypes, shapes and bytes.
bool SameBytes(nb::sequence first, nb::sequence second) {
  const size_t n = nb::len(first);
  if (nb::len(second) != n) return false;
  for (size_t i = 0; i < n; ++i) {
    PyArrayObject* a = ContiguousArray(first[i]);
    PyArrayObject* b = ContiguousArray(second[i]);
    if (PyArray_DESCR(a)->type_num != PyArray_DESCR(b)->type_num ||
        !PyArray_EquivTypes(PyArray_DESCR(a), PyArray_DESCR(b)) || !PyArray_SAMESHAPE(a, b)) {
      return false;
    }
    if (std::memcmp(PyArray_DATA(a), PyArray_DATA(b), static_cast<size_t>(PyArray_NBYTES(a))) !=
        0) {
      return false;
    }
  }
  return true;
}

void AddFingerprints(nb::module_& m) {
  m.def("fingerprint", &Fingerprint, nb::arg("arrays"),
        "A 63-bit fingerprint of C-contiguous arrays' dtypes, shapes and bytes (not "
        "cryptographic: compare with same_bytes before trusting a match).");
  m.def("same_bytes", &SameBytes, nb::arg("first"), nb::arg("second"),
        "Whether two sequences of C-contiguous arrays hold the same dtypes, shapes and bytes.");
}

}  // namespace
