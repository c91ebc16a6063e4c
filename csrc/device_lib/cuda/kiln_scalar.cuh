#pragma once
// Scalar helpers for kiln's generated kernels. 16-bit floats are stored as 16-bit structs and computed in
// float, like PyTorch's "opmath"; conversions go through the PTX cvt instructions, so no CUDA header is
// needed. Math functions are overloaded by compute type (float calls the float routine, double the double
// one); max/min propagate NaN like torch.maximum.
namespace kiln {

struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

__device__ __forceinline__ float load(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float load(bf16_t v) { return __uint_as_float(static_cast<unsigned>(v.bits) << 16); }
template <typename T>
__device__ __forceinline__ T load(T v) { return v; }

// The index of a gathered load (embedding, gather, index_select) or a scatter, checked: out of [0, extent) the kernel
// traps, as eager's device-side assert does, instead of reading or writing outside the tensor.
__device__ __forceinline__ long long gather_index(long long i, long long extent) {
  if (static_cast<unsigned long long>(i) >= static_cast<unsigned long long>(extent)) __trap();
  return i;
}

__device__ __forceinline__ half_t to_half(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
__device__ __forceinline__ bf16_t to_bf16(float f) {
  bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
  unsigned u = __float_as_uint(f);
  if (f != f) {
    h.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    h.bits = static_cast<unsigned short>(u >> 16);
  }
#endif
  return h;
}
__device__ __forceinline__ float round_half(float f) { return load(to_half(f)); }
__device__ __forceinline__ float round_bf16(float f) { return load(to_bf16(f)); }

template <typename T>
struct store_as {
  template <typename S>
  __device__ __forceinline__ static T from(S v) { return static_cast<T>(v); }
};
template <>
struct store_as<bool> {
  template <typename S>
  __device__ __forceinline__ static bool from(S v) { return v != 0; }
};
template <>
struct store_as<half_t> {
  template <typename S>
  __device__ __forceinline__ static half_t from(S v) { return to_half(static_cast<float>(v)); }
};
template <>
struct store_as<bf16_t> {
  template <typename S>
  __device__ __forceinline__ static bf16_t from(S v) { return to_bf16(static_cast<float>(v)); }
};

// N consecutive elements moved as one access (ld.global.v4 and friends): the address must be aligned to
// sizeof(vec), which kernels check at run time before taking their vector path.
template <typename T, int N>
struct __align__(sizeof(T) * N) vec { T v[N]; };

__device__ __forceinline__ bool aligned_to(const void* pointer, unsigned bytes) {
  return (reinterpret_cast<unsigned long long>(pointer) & (bytes - 1)) == 0;
}

#define KILN_FLOAT_FUNCTION(name, float_fn, double_fn)                          \
  __device__ __forceinline__ float name(float a) { return float_fn(a); }      \
  __device__ __forceinline__ double name(double a) { return double_fn(a); }
KILN_FLOAT_FUNCTION(exp_, expf, exp)
KILN_FLOAT_FUNCTION(log_, logf, log)
KILN_FLOAT_FUNCTION(sqrt_, sqrtf, sqrt)
KILN_FLOAT_FUNCTION(rsqrt_, rsqrtf, rsqrt)
KILN_FLOAT_FUNCTION(tanh_, tanhf, tanh)
KILN_FLOAT_FUNCTION(erf_, erff, erf)
KILN_FLOAT_FUNCTION(erfc_, erfcf, erfc)
KILN_FLOAT_FUNCTION(sin_, sinf, sin)
KILN_FLOAT_FUNCTION(cos_, cosf, cos)
KILN_FLOAT_FUNCTION(tan_, tanf, tan)
KILN_FLOAT_FUNCTION(asin_, asinf, asin)
KILN_FLOAT_FUNCTION(acos_, acosf, acos)
KILN_FLOAT_FUNCTION(atan_, atanf, atan)
KILN_FLOAT_FUNCTION(sinh_, sinhf, sinh)
KILN_FLOAT_FUNCTION(cosh_, coshf, cosh)
KILN_FLOAT_FUNCTION(asinh_, asinhf, asinh)
KILN_FLOAT_FUNCTION(acosh_, acoshf, acosh)
KILN_FLOAT_FUNCTION(atanh_, atanhf, atanh)
KILN_FLOAT_FUNCTION(log1p_, log1pf, log1p)
KILN_FLOAT_FUNCTION(expm1_, expm1f, expm1)
KILN_FLOAT_FUNCTION(log2_, log2f, log2)
KILN_FLOAT_FUNCTION(log10_, log10f, log10)
KILN_FLOAT_FUNCTION(exp2_, exp2f, exp2)
KILN_FLOAT_FUNCTION(lgamma_, lgammaf, lgamma)
KILN_FLOAT_FUNCTION(erfinv_, erfinvf, erfinv)
#undef KILN_FLOAT_FUNCTION


// Rounding keeps the dtype; integers are already whole. round_ rounds half to even, like torch.round.
#define KILN_ROUNDING(name, float_fn, double_fn)                                \
  __device__ __forceinline__ float name(float a) { return float_fn(a); }      \
  __device__ __forceinline__ double name(double a) { return double_fn(a); }   \
  template <typename T>                                                       \
  __device__ __forceinline__ T name(T a) { return a; }
KILN_ROUNDING(ceil_, ceilf, ceil)
KILN_ROUNDING(floor_, floorf, floor)
KILN_ROUNDING(round_, rintf, rint)
KILN_ROUNDING(trunc_, truncf, trunc)
#undef KILN_ROUNDING

#define KILN_FLOAT_FUNCTION2(name, float_fn, double_fn)                                  \
  __device__ __forceinline__ float name(float a, float b) { return float_fn(a, b); }    \
  __device__ __forceinline__ double name(double a, double b) { return double_fn(a, b); }
KILN_FLOAT_FUNCTION2(atan2_, atan2f, atan2)
KILN_FLOAT_FUNCTION2(hypot_, hypotf, hypot)
KILN_FLOAT_FUNCTION2(copysign_, copysignf, copysign)
KILN_FLOAT_FUNCTION2(nextafter_, nextafterf, nextafter)
#undef KILN_FLOAT_FUNCTION2

// fmod truncates like C (torch.fmod); fmax/fmin ignore NaN (torch.fmax/fmin).
__device__ __forceinline__ float fmod_(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double fmod_(double a, double b) { return fmod(a, b); }
template <typename T>
__device__ __forceinline__ T fmod_(T a, T b) { return a % b; }
__device__ __forceinline__ float fmax_(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double fmax_(double a, double b) { return fmax(a, b); }
template <typename T>
__device__ __forceinline__ T fmax_(T a, T b) { return a > b ? a : b; }
__device__ __forceinline__ float fmin_(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double fmin_(double a, double b) { return fmin(a, b); }
template <typename T>
__device__ __forceinline__ T fmin_(T a, T b) { return a < b ? a : b; }

__device__ __forceinline__ bool signbit_(float a) { return signbit(a); }
__device__ __forceinline__ bool signbit_(double a) { return signbit(a); }
template <typename T>
__device__ __forceinline__ bool signbit_(T a) { return a < 0; }

__device__ __forceinline__ bool bitwise_not_(bool a) { return !a; }
template <typename T>
__device__ __forceinline__ T bitwise_not_(T a) { return static_cast<T>(~a); }

__device__ __forceinline__ float abs_(float a) { return fabsf(a); }
__device__ __forceinline__ double abs_(double a) { return fabs(a); }
template <typename T>
__device__ __forceinline__ T abs_(T a) { return a < 0 ? -a : a; }

__device__ __forceinline__ float sigmoid_(float a) { return 1.0f / (1.0f + expf(-a)); }
__device__ __forceinline__ double sigmoid_(double a) { return 1.0 / (1.0 + exp(-a)); }

__device__ __forceinline__ float pow_(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_(double a, double b) { return pow(a, b); }
template <typename T>
__device__ __forceinline__ T pow_(T a, T b) { return static_cast<T>(pow(static_cast<double>(a), static_cast<double>(b))); }

template <typename T>
__device__ __forceinline__ T max_(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T>
__device__ __forceinline__ T min_(T a, T b) { return (a != a || a < b) ? a : b; }

template <typename T>
__device__ __forceinline__ T quiet_nan();
template <>
__device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <>
__device__ __forceinline__ double quiet_nan<double>() { return __longlong_as_double(0x7ff8000000000000ll); }
template <typename T>
__device__ __forceinline__ T infinity();
template <>
__device__ __forceinline__ float infinity<float>() { return __int_as_float(0x7f800000); }
template <>
__device__ __forceinline__ double infinity<double>() { return __longlong_as_double(0x7ff0000000000000ll); }

// digamma as ATen defines it at the poles (+-0 -> -+inf, negative integers -> NaN): reflection for negative
// arguments, the recurrence psi(x) = psi(x + 1) - 1/x up to x >= 10, then the asymptotic series
// ln x - 1/(2x) - sum B_2k / (2k x^2k) (7 terms). In the compute type, as ATen's CUDA kernel.
template <typename T>
__device__ __forceinline__ T digamma_impl(T x) {
  if (x == T(0)) return copysign_(infinity<T>(), -x);
  T result = 0;
  if (x < T(0)) {
    if (x == trunc_(x)) return quiet_nan<T>();
    const double pi = 3.14159265358979323846;
    result = static_cast<T>(-pi / tan(pi * static_cast<double>(x - trunc_(x))));
    x = T(1) - x;
  }
  for (; x < T(10); x += T(1)) result -= T(1) / x;
  const T z = T(1) / (x * x);
  const T series = z * (T(1.0 / 12) - z * (T(1.0 / 120) - z * (T(1.0 / 252) - z * (T(1.0 / 240) - z * (T(1.0 / 132) -
                                                                                z * (T(691.0 / 32760) - z / T(12)))))));
  return result + log_(x) - T(0.5) / x - series;
}
__device__ __forceinline__ float digamma_(float a) { return digamma_impl(a); }
__device__ __forceinline__ double digamma_(double a) { return digamma_impl(a); }

}  // namespace kiln
