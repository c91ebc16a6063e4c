#pragma once
// The helper code every generated C++ translation unit starts with, embedded as a string so that the
// generated source is self-contained (its hash is the cache key). Half and bfloat16 are stored as 16-bit
// structs and computed in float, like PyTorch's "opmath"; max/min propagate NaN like torch.maximum.
namespace kiln::device_lib {

inline const char* cpp_prelude() {
  return R"KILN(// ---- kiln C++ prelude ----
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX__)
#include <immintrin.h>
#endif

struct kiln_half { uint16_t bits; };
struct kiln_bf16 { uint16_t bits; };

static inline float kiln_bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t kiln_float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

static inline float kiln_load(kiln_bf16 v) { return kiln_bits_to_float(static_cast<uint32_t>(v.bits) << 16); }
static inline kiln_bf16 kiln_to_bf16(float f) {
  uint32_t u = kiln_float_to_bits(f);
  if (f != f) return kiln_bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return kiln_bf16{static_cast<uint16_t>(u >> 16)};
}

static inline float kiln_load(kiln_half v) {
  const uint32_t h = v.bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1fu) return kiln_bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return kiln_bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  const float m = static_cast<float>(mant) * 5.9604644775390625e-08f;  // subnormal: mant * 2^-24
  return sign ? -m : m;
}
static inline kiln_half kiln_to_half(float f) {
  const uint32_t u = kiln_float_to_bits(f), sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return kiln_half{static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  if (abs >= 0x477ff000u) return kiln_half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // subnormal or zero: round |f| * 2^24 to nearest even
    const float scaled = kiln_bits_to_float(abs) * 16777216.0f;
    return kiln_half{static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)))};
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return kiln_half{static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

template <typename T> static inline T kiln_load(T v) { return v; }

template <typename T> struct kiln_store_as { template <typename S> static T from(S v) { return static_cast<T>(v); } };
template <> struct kiln_store_as<bool> { template <typename S> static bool from(S v) { return v != 0; } };
template <> struct kiln_store_as<kiln_bf16> { template <typename S> static kiln_bf16 from(S v) { return kiln_to_bf16(static_cast<float>(v)); } };
template <> struct kiln_store_as<kiln_half> { template <typename S> static kiln_half from(S v) { return kiln_to_half(static_cast<float>(v)); } };

static inline float kiln_round_bf16(float v) { return kiln_load(kiln_to_bf16(v)); }
static inline float kiln_round_half(float v) { return kiln_load(kiln_to_half(v)); }

template <typename T> static inline T kiln_max(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> static inline T kiln_min(T a, T b) { return (a != a || a < b) ? a : b; }
// exp in straight-line arithmetic so loops that call it vectorise (std::exp is a libm call that GCC only
// vectorises under -ffast-math). Range reduction x = k ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r
// (Cephes' coefficients, ~1 ulp), 2^k built from the exponent bits in two halves so subnormal results survive.
// Edge cases as std::exp: NaN -> NaN, +inf and overflow -> inf, -inf and underflow -> 0.
static inline float kiln_exp(float x) {
  const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
  const float k = std::nearbyint(xc * 1.44269504088896341f);
  const float r = (xc - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  const int32_t ki = static_cast<int32_t>(k), k1 = ki / 2, k2 = ki - k1;
  float result = er * kiln_bits_to_float(static_cast<uint32_t>(k1 + 127) << 23) *
                 kiln_bits_to_float(static_cast<uint32_t>(k2 + 127) << 23);
  result = x > 88.72283935546875f ? std::numeric_limits<float>::infinity() : result;
  result = x < -103.972084f ? 0.0f : result;
  return x != x ? x : result;
}
static inline double kiln_exp(double x) { return std::exp(x); }
template <typename T> static inline double kiln_exp(T x) { return std::exp(static_cast<double>(x)); }
// erf in straight-line arithmetic so loops that call it vectorise (std::erf is a libm call: a fused gelu ran
// 16x slower than ATen's). |x| < 1: the Taylor series 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)) to n = 10
// (truncation < 2e-9, keeps tiny arguments' relative accuracy: erf(1e-30) = 1.13e-30); |x| >= 1: Abramowitz &
// Stegun 7.1.26, 1 - t (a1 + a2 t + ... + a5 t^4) e^(-x^2) with t = 1 / (1 + p|x|), absolute error <= 1.5e-7,
// the approximation ATen's vectorised float gelu uses. Both are computed and one selected (no branch, so the
// loop stays vectorised). NaN -> NaN, +-inf -> +-1. Double keeps std::erf.
static inline float kiln_erf(float x) {
  const float a = std::fabs(x), x2 = x * x;
  float s = 1.4807192816e-08f;
  s = s * x2 - 1.6365844691e-07f;
  s = s * x2 + 1.6462114366e-06f;
  s = s * x2 - 1.4925650358e-05f;
  s = s * x2 + 1.2055332982e-04f;
  s = s * x2 - 8.5483270235e-04f;
  s = s * x2 + 5.2239776254e-03f;
  s = s * x2 - 2.6866170645e-02f;
  s = s * x2 + 1.1283791671e-01f;
  s = s * x2 - 3.7612638903e-01f;
  s = s * x2 + 1.1283791671e+00f;
  const float t = 1.0f / (0.3275911f * a + 1.0f);
  float r = 1.061405429f;
  r = r * t - 1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t - 0.284496736f;
  r = r * t + 0.254829592f;
  const float tail = std::copysign(1.0f - r * t * kiln_exp(-x2), x);
  return a < 1.0f ? s * x : tail;
}
template <typename T> static inline auto kiln_erf(T x) -> decltype(std::erf(x)) { return std::erf(x); }
template <typename T> static inline T kiln_sigmoid(T a) { return T(1) / (T(1) + kiln_exp(-a)); }
template <typename T> static inline T kiln_rsqrt(T a) { return T(1) / std::sqrt(a); }
// ~ on integers; on bool it is logical not (~true is -2, which would store as true).
template <typename T> static inline T kiln_bitwise_not(T a) { return static_cast<T>(~a); }
static inline bool kiln_bitwise_not(bool a) { return !a; }
// digamma as ATen defines it at the poles (+-0 -> -+inf, negative integers -> NaN): negative arguments reflect
// (psi(x) = psi(1 - x) - pi / tan(pi frac(x))), the recurrence psi(x) = psi(x + 1) - 1/x lifts x to 10 or more,
// where the asymptotic series ln x - 1/(2x) - sum B_2k / (2k x^2k) (7 terms) is exact to double precision.
// Computed in double and rounded once.
static inline double kiln_digamma(double x) {
  if (x == 0) return std::copysign(std::numeric_limits<double>::infinity(), -x);
  double result = 0;
  if (x < 0) {
    if (x == std::trunc(x)) return std::numeric_limits<double>::quiet_NaN();
    const double pi = 3.14159265358979323846;
    result = -pi / std::tan(pi * (x - std::trunc(x)));
    x = 1 - x;
  }
  for (; x < 10; x += 1) result -= 1 / x;
  const double z = 1 / (x * x);
  const double series =
      z * (1.0 / 12 - z * (1.0 / 120 - z * (1.0 / 252 - z * (1.0 / 240 - z * (1.0 / 132 - z * (691.0 / 32760 - z / 12))))));
  return result + std::log(x) - 0.5 / x - series;
}
static inline float kiln_digamma(float x) { return static_cast<float>(kiln_digamma(static_cast<double>(x))); }
// erfinv: Winitzki's closed form (relative error ~2e-3) as the start, then three Newton steps on erf(x) = y,
// each squaring the error. |y| > 1 -> NaN, +-1 -> +-inf, as ATen. Computed in double and rounded once.
static inline double kiln_erfinv(double y) {
  const double magnitude = std::fabs(y);
  if (magnitude > 1) return std::numeric_limits<double>::quiet_NaN();
  if (magnitude == 1) return std::copysign(std::numeric_limits<double>::infinity(), y);
  const double a = 0.147, two_over_pi_a = 2 / (3.14159265358979323846 * a);
  const double l = std::log((1 - y) * (1 + y));
  const double t = two_over_pi_a + l / 2;
  double x = std::copysign(std::sqrt(std::sqrt(t * t - l / a) - t), y);
  for (int step = 0; step < 3; ++step) x -= (std::erf(x) - y) / (1.1283791670955126 * std::exp(-x * x));
  return x;
}
static inline float kiln_erfinv(float y) { return static_cast<float>(kiln_erfinv(static_cast<double>(y))); }
// Writes a 16 x 16 tile of float32 transposed: dst[a * dst_stride + i] = tile[i * 16 + a]. A transposing
// kernel computes a tile in the order its transposed input is contiguous in, then writes it through this, so that
// its reads and its writes both run along whole cache lines. With AVX, four 8 x 8 blocks of eight 8-wide loads,
// 24 shuffles and eight 8-wide stores each.
static inline void kiln_store_transposed16x16(const float* tile, float* dst, int64_t dst_stride) {
#if defined(__AVX__)
  for (int a = 0; a < 16; a += 8) {
    for (int b = 0; b < 16; b += 8) {
      const float* src = tile + b * 16 + a;
      float* out = dst + a * dst_stride + b;
      __m256 r[8];
      for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * 16);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      _mm256_storeu_ps(out + 0 * dst_stride, _mm256_permute2f128_ps(s0, s4, 0x20));
      _mm256_storeu_ps(out + 1 * dst_stride, _mm256_permute2f128_ps(s1, s5, 0x20));
      _mm256_storeu_ps(out + 2 * dst_stride, _mm256_permute2f128_ps(s2, s6, 0x20));
      _mm256_storeu_ps(out + 3 * dst_stride, _mm256_permute2f128_ps(s3, s7, 0x20));
      _mm256_storeu_ps(out + 4 * dst_stride, _mm256_permute2f128_ps(s0, s4, 0x31));
      _mm256_storeu_ps(out + 5 * dst_stride, _mm256_permute2f128_ps(s1, s5, 0x31));
      _mm256_storeu_ps(out + 6 * dst_stride, _mm256_permute2f128_ps(s2, s6, 0x31));
      _mm256_storeu_ps(out + 7 * dst_stride, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
  }
#else
  for (int a = 0; a < 16; ++a)
    for (int i = 0; i < 16; ++i) dst[a * dst_stride + i] = tile[i * 16 + a];
#endif
}
// ---- end of prelude ----
)KILN";
}

}  // namespace kiln::device_lib
