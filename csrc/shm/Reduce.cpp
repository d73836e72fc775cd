#include "shm/Reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace hsdp::shm {

size_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
      return 1;
  }
  return 1;
}

const char* dtypeName(DType dtype) {
  static const char* names[] = {
      "float32", "float64", "bfloat16", "float16", "int8", "uint8", "int16", "int32", "int64"};
  return names[static_cast<int>(dtype)];
}

const char* redOpName(RedOp op) {
  static const char* names[] = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  return names[static_cast<int>(op)];
}

bool isFloating(DType dtype) {
  return dtype == DType::F32 || dtype == DType::F64 || dtype == DType::BF16 || dtype == DType::F16;
}

bool reduceSupported(DType dtype, RedOp op) {
  const bool bitwise = op == RedOp::BAnd || op == RedOp::BOr || op == RedOp::BXor;
  return !(bitwise && isFloating(dtype));
}

namespace {

// Storage type <-> accumulation type conversions.
struct BF16 {
  uint16_t bits;
};
struct F16 {
  _Float16 value;
};

template <typename T>
struct Acc {
  using type = T;
  static inline type load(T v) {
    return v;
  }
  static inline T store(type v) {
    return v;
  }
};

template <>
struct Acc<BF16> {
  using type = float;
  static inline float load(BF16 v) {
    uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline BF16 store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) { // NaN: keep it a quiet NaN
      return BF16{static_cast<uint16_t>((u >> 16) | 0x40)};
    }
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest, ties to even
    return BF16{static_cast<uint16_t>(u >> 16)};
  }
};

template <>
struct Acc<F16> {
  using type = float;
  static inline float load(F16 v) {
    return static_cast<float>(v.value);
  }
  static inline F16 store(float f) {
    return F16{static_cast<_Float16>(f)};
  }
};

template <RedOp op, typename A>
inline A combine(A a, A b) {
  if constexpr (std::is_integral_v<A> && (op == RedOp::Sum || op == RedOp::Prod)) {
    // Wrap around like torch's integer arithmetic, without the undefined
    // behaviour of signed overflow: compute in the unsigned type.
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(
        op == RedOp::Sum ? static_cast<U>(static_cast<U>(a) + static_cast<U>(b))
                         : static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else if constexpr (op == RedOp::Sum) {
    return a + b;
  } else if constexpr (op == RedOp::Prod) {
    return a * b;
  } else if constexpr (op == RedOp::Min) {
    // NaN propagates, as torch.minimum does.
    return (a != a || a < b) ? a : b;
  } else if constexpr (op == RedOp::Max) {
    return (a != a || a > b) ? a : b;
  } else if constexpr (op == RedOp::BAnd) {
    return a & b;
  } else if constexpr (op == RedOp::BOr) {
    return a | b;
  } else {
    return a ^ b;
  }
}

// Integers scale as int64 (truncating, as torch does): a divisor wider than
// the element type must not be narrowed into it.
template <typename T>
using Factor =
    std::conditional_t<std::is_integral_v<typename Acc<T>::type>, int64_t, typename Acc<T>::type>;

// Scales a combined value and narrows it to storage: the result's one rounding.
template <typename T, Scale::Kind kind>
__attribute__((always_inline)) inline T finish(typename Acc<T>::type v, Factor<T> factor) {
  using A = typename Acc<T>::type;
  if constexpr (kind == Scale::Kind::Multiply) {
    v = static_cast<A>(v * factor);
  } else if constexpr (kind == Scale::Kind::Divide) {
    v = static_cast<A>(v / factor); // integers: truncation toward zero
  }
  return Acc<T>::store(v);
}

// Writes dst[i] = value(i) for i < count. Streaming: whole 64-byte lines
// with non-temporal stores, each computed into a line-sized buffer first
// (kept in registers) so that loads and stores stay interleaved, as they
// must for the stores to overlap the loads; the unaligned head and the tail
// through the cache.
template <typename T, Store store, typename Value>
__attribute__((always_inline)) inline void storeEach(T* dst, size_t count, Value value) {
#if defined(__x86_64__)
  if constexpr (store == Store::Streaming) {
    constexpr size_t kLine = 64 / sizeof(T);
    const size_t misaligned = reinterpret_cast<uintptr_t>(dst) % 64;
    size_t i = 0;
    if (misaligned % sizeof(T) == 0) {
      const size_t head = std::min(count, misaligned == 0 ? 0 : (64 - misaligned) / sizeof(T));
      for (; i < head; ++i) {
        dst[i] = value(i);
      }
      for (; i + kLine <= count; i += kLine) {
        alignas(64) T line[kLine];
        for (size_t j = 0; j < kLine; ++j) {
          line[j] = value(i + j);
        }
        auto* out = reinterpret_cast<__m128i*>(dst + i);
        const auto* in = reinterpret_cast<const __m128i*>(line);
        _mm_stream_si128(out, _mm_load_si128(in));
        _mm_stream_si128(out + 1, _mm_load_si128(in + 1));
        _mm_stream_si128(out + 2, _mm_load_si128(in + 2));
        _mm_stream_si128(out + 3, _mm_load_si128(in + 3));
      }
    }
    for (; i < count; ++i) {
      dst[i] = value(i);
    }
    return;
  }
#endif
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) {
    dst[i] = value(i);
  }
}

// Every element is s0 op s1 op ... in rank order, then scaled and stored
// once, whichever loop computes it, so results are bitwise the same for any
// number of sources and any split of the count.
//
// dst may be one of the sources (in-place all-reduce, a reduce-scatter whose
// output is its own chunk), never a shifted view of one: element i of dst
// depends only on element i of the sources, read before it is written, so
// no loop below carries a dependence (ivdep lets them vectorise without the
// alias checks that would send an in-place call down the scalar loop).
// Two sources (two ranks; a pair of hosts) take one pass over memory;
// more go through an accumulator block in L1, the first two and the last
// fused into its first and last pass: nsrcs - 1 passes over the block.
template <typename T, RedOp op, Scale::Kind kind, Store store>
__attribute__((always_inline)) inline void
reduceFused(T* dst, const T* const* srcs, int nsrcs, size_t count, Factor<T> factor) {
  using A = typename Acc<T>::type;
  const T* s0 = srcs[0];
  const T* s1 = srcs[1];
  if (nsrcs == 2) {
    storeEach<T, store>(dst, count, [&](size_t i) {
      return finish<T, kind>(combine<op, A>(Acc<T>::load(s0[i]), Acc<T>::load(s1[i])), factor);
    });
    return;
  }
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  const T* last = srcs[nsrcs - 1];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    for (size_t i = 0; i < n; ++i) {
      acc[i] = combine<op, A>(Acc<T>::load(s0[base + i]), Acc<T>::load(s1[base + i]));
    }
    for (int r = 2; r < nsrcs - 1; ++r) {
      const T* s = srcs[r] + base;
      for (size_t i = 0; i < n; ++i) {
        acc[i] = combine<op, A>(acc[i], Acc<T>::load(s[i]));
      }
    }
    const T* z = last + base;
    storeEach<T, store>(dst + base, n, [&](size_t i) {
      return finish<T, kind>(combine<op, A>(acc[i], Acc<T>::load(z[i])), factor);
    });
  }
}

// The same order and rounding for any op and source count: `count` elements
// in blocks through a local accumulator, which keeps the loops vectorisable
// although dst may alias a source, at the cost of a pass over the block per
// source plus the store.
template <typename T, RedOp op>
__attribute__((always_inline)) inline void
reduceGeneric(T* dst, const T* const* srcs, int nsrcs, size_t count, Scale scale) {
  using A = typename Acc<T>::type;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  const auto factor = static_cast<Factor<T>>(scale.value);
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const T* s0 = srcs[0] + base;
    for (size_t i = 0; i < n; ++i) {
      acc[i] = Acc<T>::load(s0[i]);
    }
    for (int r = 1; r < nsrcs; ++r) {
      const T* s = srcs[r] + base;
      for (size_t i = 0; i < n; ++i) {
        acc[i] = combine<op, A>(acc[i], Acc<T>::load(s[i]));
      }
    }
    if (scale.kind == Scale::Kind::Multiply) {
      for (size_t i = 0; i < n; ++i) {
        acc[i] = static_cast<A>(acc[i] * factor);
      }
    } else if (scale.kind == Scale::Kind::Divide) {
      for (size_t i = 0; i < n; ++i) {
        acc[i] = static_cast<A>(acc[i] / factor); // integers: truncation toward zero
      }
    }
    T* d = dst + base;
    for (size_t i = 0; i < n; ++i) {
      d[i] = Acc<T>::store(acc[i]);
    }
  }
}

template <typename T, RedOp op, Store store>
__attribute__((always_inline)) inline void
reduceFusedScaled(T* dst, const T* const* srcs, int nsrcs, size_t count, Scale scale) {
  const auto factor = static_cast<Factor<T>>(scale.value);
  switch (scale.kind) {
    case Scale::Kind::None:
      return reduceFused<T, op, Scale::Kind::None, store>(dst, srcs, nsrcs, count, factor);
    case Scale::Kind::Multiply:
      return reduceFused<T, op, Scale::Kind::Multiply, store>(dst, srcs, nsrcs, count, factor);
    case Scale::Kind::Divide:
      return reduceFused<T, op, Scale::Kind::Divide, store>(dst, srcs, nsrcs, count, factor);
  }
}

// SUM (every FSDP2 reduction) takes the fused loops above; the other ops,
// rare in training, the generic ones, which keep this file quick to build.
template <typename T, RedOp op>
__attribute__((always_inline)) inline void
reduceBlocks(T* dst, const T* const* srcs, int nsrcs, size_t count, Scale scale, Store store) {
  if constexpr (op != RedOp::Sum) {
    return reduceGeneric<T, op>(dst, srcs, nsrcs, count, scale);
  } else {
    if (nsrcs < 2) {
      return reduceGeneric<T, op>(dst, srcs, nsrcs, count, scale);
    }
    // Streaming for the floating types gradients come in; integer outputs
    // go through the cache (half the instances to build).
    if constexpr (std::is_floating_point_v<typename Acc<T>::type>) {
      if (store == Store::Streaming) {
        return reduceFusedScaled<T, op, Store::Streaming>(dst, srcs, nsrcs, count, scale);
      }
    }
    return reduceFusedScaled<T, op, Store::Cached>(dst, srcs, nsrcs, count, scale);
  }
}

template <typename T>
__attribute__((always_inline)) inline void reduceTyped(
    void* dst,
    const void* const* srcs,
    int nsrcs,
    size_t count,
    RedOp op,
    Scale scale,
    Store store) {
  auto* d = static_cast<T*>(dst);
  auto* s = reinterpret_cast<const T* const*>(srcs);
  switch (op) {
    case RedOp::Sum:
      return reduceBlocks<T, RedOp::Sum>(d, s, nsrcs, count, scale, store);
    case RedOp::Prod:
      return reduceBlocks<T, RedOp::Prod>(d, s, nsrcs, count, scale, store);
    case RedOp::Min:
      return reduceBlocks<T, RedOp::Min>(d, s, nsrcs, count, scale, store);
    case RedOp::Max:
      return reduceBlocks<T, RedOp::Max>(d, s, nsrcs, count, scale, store);
    default:
      if constexpr (std::is_integral_v<T>) {
        if (op == RedOp::BAnd) {
          return reduceBlocks<T, RedOp::BAnd>(d, s, nsrcs, count, scale, store);
        }
        if (op == RedOp::BOr) {
          return reduceBlocks<T, RedOp::BOr>(d, s, nsrcs, count, scale, store);
        }
        return reduceBlocks<T, RedOp::BXor>(d, s, nsrcs, count, scale, store);
      }
  }
}

#if defined(__SANITIZE_THREAD__)
// The ifunc resolvers that multi-versioning generates run while the dynamic
// loader relocates the binary, before ThreadSanitizer's runtime is up, and
// crash there (they are instrumented too). TSan builds check the baseline
// kernel: the versions are one source compiled for three instruction sets.
#define HSDP_MULTIVERSION
#else
#define HSDP_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#define HSDP_KERNEL(NAME, T)                                                                       \
  HSDP_MULTIVERSION void NAME(                                                                     \
      void* dst,                                                                                   \
      const void* const* srcs,                                                                     \
      int nsrcs,                                                                                   \
      size_t count,                                                                                \
      RedOp op,                                                                                    \
      Scale scale,                                                                                 \
      Store store) {                                                                               \
    reduceTyped<T>(dst, srcs, nsrcs, count, op, scale, store);                                     \
  }

HSDP_KERNEL(reduceF32, float)
HSDP_KERNEL(reduceF64, double)
HSDP_KERNEL(reduceBF16, BF16)
HSDP_KERNEL(reduceF16, F16)
HSDP_KERNEL(reduceI8, int8_t)
HSDP_KERNEL(reduceU8, uint8_t)
HSDP_KERNEL(reduceI16, int16_t)
HSDP_KERNEL(reduceI32, int32_t)
HSDP_KERNEL(reduceI64, int64_t)

#undef HSDP_KERNEL
#undef HSDP_MULTIVERSION

} // namespace

void reduce(
    void* dst,
    const void* const* srcs,
    int nsrcs,
    size_t count,
    DType dtype,
    RedOp op,
    Scale scale,
    Store store) {
  auto* kernel = reduceF32;
  switch (dtype) {
    case DType::F32:
      break;
    case DType::F64:
      kernel = reduceF64;
      break;
    case DType::BF16:
      kernel = reduceBF16;
      break;
    case DType::F16:
      kernel = reduceF16;
      break;
    case DType::I8:
      kernel = reduceI8;
      break;
    case DType::U8:
      kernel = reduceU8;
      break;
    case DType::I16:
      kernel = reduceI16;
      break;
    case DType::I32:
      kernel = reduceI32;
      break;
    case DType::I64:
      kernel = reduceI64;
      break;
  }
  kernel(dst, srcs, nsrcs, count, op, scale, store);
#if defined(__x86_64__)
  if (store == Store::Streaming) {
    // Non-temporal stores are weakly ordered: fence them before whatever
    // publishes the result (a release store on x86 does not order them).
    _mm_sfence();
  }
#endif
}

void copy(void* dst, const void* src, size_t n, Store store) {
  if (n == 0) { // an empty tensor's pointer may be null: memcpy(null, ..., 0) is undefined
    return;
  }
#if defined(__x86_64__)
  if (store == Store::Streaming && n >= 128) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const auto* in = reinterpret_cast<const __m128i*>(s + i);
      auto* out = reinterpret_cast<__m128i*>(d + i);
      const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1);
      const __m128i c = _mm_loadu_si128(in + 2), e = _mm_loadu_si128(in + 3);
      _mm_stream_si128(out, a);
      _mm_stream_si128(out + 1, b);
      _mm_stream_si128(out + 2, c);
      _mm_stream_si128(out + 3, e);
    }
    std::memcpy(d + i, s + i, n - i);
    // Weakly ordered: fenced before the release store that publishes them.
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

} // namespace hsdp::shm
