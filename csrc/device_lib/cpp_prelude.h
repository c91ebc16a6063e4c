#pragma once
// The helper code every generated C++ translation unit starts with, embedded as a string so that the
// generated source is self-contained (its hash is the cache key). Half and bfloat16 are stored as 16-bit
// structs and computed in float, like PyTorch's "opmath"; max/min propagate NaN like torch.maximum.
namespace kiln::device_lib {

inline const char* cpp_prelude() {
  return R"KILN(// ---- kiln C++ prelude ----
// No standard headers: g++ takes about 0.2 s to parse <cmath> and its company, most of a small graph's compile.
// Instead, the integer types, and in namespace std the functions and limits kernels use, as GCC builtins (the
// same libm entry points <cmath> reaches) with <cmath>'s overloads: float and double arguments keep their type,
// integers compute in double.
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
#define INT64_MIN (-__INT64_MAX__ - 1)
#define INT64_C(c) __INT64_C(c)
namespace std {
#define KILN_MATH1(name)                                                         \
  inline float name(float x) { return __builtin_##name##f(x); }                  \
  inline double name(double x) { return __builtin_##name(x); }                   \
  template <typename T> inline double name(T x) { return __builtin_##name(static_cast<double>(x)); }
#define KILN_MATH2(name)                                                                   \
  inline float name(float x, float y) { return __builtin_##name##f(x, y); }               \
  inline double name(double x, double y) { return __builtin_##name(x, y); }               \
  template <typename T, typename U> inline double name(T x, U y) {                         \
    return __builtin_##name(static_cast<double>(x), static_cast<double>(y));               \
  }
KILN_MATH1(exp) KILN_MATH1(exp2) KILN_MATH1(expm1) KILN_MATH1(log) KILN_MATH1(log2) KILN_MATH1(log10)
KILN_MATH1(log1p) KILN_MATH1(sqrt) KILN_MATH1(sin) KILN_MATH1(cos) KILN_MATH1(tan) KILN_MATH1(asin)
KILN_MATH1(acos) KILN_MATH1(atan) KILN_MATH1(sinh) KILN_MATH1(cosh) KILN_MATH1(tanh) KILN_MATH1(asinh)
KILN_MATH1(acosh) KILN_MATH1(atanh) KILN_MATH1(erf) KILN_MATH1(erfc) KILN_MATH1(lgamma) KILN_MATH1(ceil)
KILN_MATH1(floor) KILN_MATH1(nearbyint) KILN_MATH1(trunc) KILN_MATH1(fabs)
KILN_MATH2(pow) KILN_MATH2(atan2) KILN_MATH2(fmod) KILN_MATH2(hypot) KILN_MATH2(copysign) KILN_MATH2(fmax)
KILN_MATH2(fmin) KILN_MATH2(nextafter)
#undef KILN_MATH1
#undef KILN_MATH2
inline float abs(float x) { return __builtin_fabsf(x); }
inline double abs(double x) { return __builtin_fabs(x); }
template <typename T> inline T abs(T x) { return x < 0 ? static_cast<T>(-x) : x; }
inline bool signbit(float x) { return __builtin_signbitf(x) != 0; }
inline bool signbit(double x) { return __builtin_signbit(x) != 0; }
template <typename T> inline bool signbit(T x) { return __builtin_signbit(static_cast<double>(x)) != 0; }
inline void* memcpy(void* to, const void* from, __SIZE_TYPE__ bytes) { return __builtin_memcpy(to, from, bytes); }
template <typename T> constexpr const T& min(const T& a, const T& b) { return b < a ? b : a; }
template <typename T> constexpr const T& max(const T& a, const T& b) { return a < b ? b : a; }
template <typename T> struct numeric_limits {  // integers and bool
  static constexpr bool is_signed = T(-1) < T(0);
  static constexpr T max() { return is_signed ? T((1ull << (sizeof(T) * 8 - 1)) - 1) : T(~0ull); }
  static constexpr T lowest() { return is_signed ? T(-max() - 1) : T(0); }
  static constexpr T infinity() { return T(0); }
  static constexpr T quiet_NaN() { return T(0); }
};
template <> struct numeric_limits<bool> {
  static constexpr bool lowest() { return false; }
  static constexpr bool max() { return true; }
  static constexpr bool infinity() { return false; }
  static constexpr bool quiet_NaN() { return false; }
};
template <> struct numeric_limits<float> {
  static constexpr float lowest() { return -__FLT_MAX__; }
  static constexpr float max() { return __FLT_MAX__; }
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
};
template <> struct numeric_limits<double> {
  static constexpr double lowest() { return -__DBL_MAX__; }
  static constexpr double max() { return __DBL_MAX__; }
  static constexpr double infinity() { return __builtin_inf(); }
  static constexpr double quiet_NaN() { return __builtin_nan(""); }
};
}  // namespace std

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

// Set when a gathered load (embedding, gather, index_select) or a checked index (scatter) met an index outside its
// dim; the run plan reads it after each such kernel and raises the error eager would have. The load then reads
// element 0, never outside.
extern "C" { __attribute__((visibility("default"))) int kiln_index_error = 0; }
static inline int64_t kiln_gather_index(int64_t i, int64_t extent) {
  if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(extent)) {
    __atomic_store_n(&kiln_index_error, 1, __ATOMIC_RELAXED);
    return 0;
  }
  return i;
}

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
// tanh in straight-line arithmetic so loops that call it vectorise (std::tanh is a libm call: a fused GRU cell ran
// slower than ATen's). |x| < 0.625: Cephes' odd polynomial x + x^3 P(x^2) (~1 ulp); beyond, 1 - 2 / (e^(2|x|) + 1)
// with x's sign (|x| capped at 44, where it is 1 in float). NaN -> NaN, +-inf -> +-1. Double keeps std::tanh.
static inline float kiln_tanh(float x) {
  const float a = std::fabs(x), z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float e = kiln_exp(2.0f * (a < 44.0f ? a : 44.0f));
  const float large = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return x != x || a == 0.0f ? x : (a < 0.625f ? small : large);  // -0 stays -0
}
template <typename T> static inline auto kiln_tanh(T x) -> decltype(std::tanh(x)) { return std::tanh(x); }
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
// its reads and its writes both run along whole cache lines. Four 8 x 8 blocks of eight 8-wide loads, 24 shuffles
// and eight 8-wide stores each, in GCC's vector extensions: the compiler picks the AVX / AVX-512 shuffles, and
// <immintrin.h> (0.3 s of every compile with -march=native) stays out.
typedef float kiln_v8f __attribute__((vector_size(32)));
typedef int kiln_v8i __attribute__((vector_size(32)));
static inline void kiln_store_transposed16x16(const float* tile, float* dst, int64_t dst_stride) {
  for (int a = 0; a < 16; a += 8) {
    for (int b = 0; b < 16; b += 8) {
      const float* src = tile + b * 16 + a;
      float* out = dst + a * dst_stride + b;
      kiln_v8f r[8];
      for (int k = 0; k < 8; ++k) std::memcpy(&r[k], src + k * 16, sizeof(kiln_v8f));
      const kiln_v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
      const kiln_v8i even_pairs = {0, 1, 8, 9, 4, 5, 12, 13}, odd_pairs = {2, 3, 10, 11, 6, 7, 14, 15};
      const kiln_v8i low_halves = {0, 1, 2, 3, 8, 9, 10, 11}, high_halves = {4, 5, 6, 7, 12, 13, 14, 15};
      kiln_v8f t[8], s[8];
      for (int k = 0; k < 8; k += 2) {
        t[k] = __builtin_shuffle(r[k], r[k + 1], lo);
        t[k + 1] = __builtin_shuffle(r[k], r[k + 1], hi);
      }
      for (int k = 0; k < 8; k += 4) {
        s[k] = __builtin_shuffle(t[k], t[k + 2], even_pairs);
        s[k + 1] = __builtin_shuffle(t[k], t[k + 2], odd_pairs);
        s[k + 2] = __builtin_shuffle(t[k + 1], t[k + 3], even_pairs);
        s[k + 3] = __builtin_shuffle(t[k + 1], t[k + 3], odd_pairs);
      }
      for (int k = 0; k < 4; ++k) {
        const kiln_v8f low = __builtin_shuffle(s[k], s[k + 4], low_halves);
        const kiln_v8f high = __builtin_shuffle(s[k], s[k + 4], high_halves);
        std::memcpy(out + k * dst_stride, &low, sizeof(kiln_v8f));
        std::memcpy(out + (k + 4) * dst_stride, &high, sizeof(kiln_v8f));
      }
    }
  }
}
// ---- end of prelude ----
)KILN";
}

}  // namespace kiln::device_lib
