// The prim table: one row per PrimOp with everything kiln knows about the prim (decomp/prims.h). The scheduler
// reads its result kind, the C++ and CUDA code generators its two spellings; keeping them in one row means a new
// prim cannot be half added.
#include "decomp/prims.h"

#include "common/error.h"

namespace kiln::decomp {

namespace {

constexpr PrimKind kValue = PrimKind::kValue;
constexpr PrimKind kPredicate = PrimKind::kPredicate;
constexpr PrimKind kComparison = PrimKind::kComparison;

// Rows in PrimOp's order (checked below), so that a row is found by indexing. The C++ spellings call the standard
// library or device_lib/cpp_prelude.h's kiln_* helpers; the CUDA ones call device_lib/cuda/kiln_scalar.cuh's, whose
// two-operand functions take both operands in one type: hence the casts to $T there.
constexpr PrimFacts kPrims[] = {
    // unary
    {PrimOp::Neg, "neg", kValue, "(-$a)", "(-$a)"},
    {PrimOp::Abs, "abs", kValue, "std::abs($a)", "kiln::abs_($a)"},
    {PrimOp::Exp, "exp", kValue, "kiln_exp($a)", "kiln::exp_($a)"},
    {PrimOp::Log, "log", kValue, "std::log($a)", "kiln::log_($a)"},
    {PrimOp::Sqrt, "sqrt", kValue, "std::sqrt($a)", "kiln::sqrt_($a)"},
    {PrimOp::Rsqrt, "rsqrt", kValue, "kiln_rsqrt($a)", "kiln::rsqrt_($a)"},
    {PrimOp::Tanh, "tanh", kValue, "kiln_tanh($a)", "kiln::tanh_($a)"},
    {PrimOp::Sigmoid, "sigmoid", kValue, "kiln_sigmoid($a)", "kiln::sigmoid_($a)"},
    {PrimOp::Erf, "erf", kValue, "kiln_erf($a)", "kiln::erf_($a)"},
    {PrimOp::LogicalNot, "not", kPredicate, "(!$a)", "(!$a)"},
    // binary
    {PrimOp::Add, "add", kValue, "($a + $b)", "($a + $b)"},
    {PrimOp::Sub, "sub", kValue, "($a - $b)", "($a - $b)"},
    {PrimOp::Mul, "mul", kValue, "($a * $b)", "($a * $b)"},
    {PrimOp::Div, "div", kValue, "($a / $b)", "($a / $b)"},
    {PrimOp::Maximum, "max", kValue, "kiln_max<$T>($a, $b)", "kiln::max_<$T>($a, $b)"},
    {PrimOp::Minimum, "min", kValue, "kiln_min<$T>($a, $b)", "kiln::min_<$T>($a, $b)"},
    {PrimOp::Pow, "pow", kValue, "std::pow($a, $b)", "kiln::pow_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Lt, "lt", kComparison, "($a < $b)", "($a < $b)"},
    {PrimOp::Le, "le", kComparison, "($a <= $b)", "($a <= $b)"},
    {PrimOp::Gt, "gt", kComparison, "($a > $b)", "($a > $b)"},
    {PrimOp::Ge, "ge", kComparison, "($a >= $b)", "($a >= $b)"},
    {PrimOp::Eq, "eq", kComparison, "($a == $b)", "($a == $b)"},
    {PrimOp::Ne, "ne", kComparison, "($a != $b)", "($a != $b)"},
    {PrimOp::LogicalAnd, "and", kPredicate, "($a && $b)", "($a && $b)"},
    {PrimOp::LogicalOr, "or", kPredicate, "($a || $b)", "($a || $b)"},
    // ternary
    {PrimOp::Where, "where", kValue, "($a ? $b : $c)", "($a ? $b : $c)"},
    // unary math (float compute types; rounding ops keep the dtype)
    {PrimOp::Sin, "sin", kValue, "std::sin($a)", "kiln::sin_($a)"},
    {PrimOp::Cos, "cos", kValue, "std::cos($a)", "kiln::cos_($a)"},
    {PrimOp::Tan, "tan", kValue, "std::tan($a)", "kiln::tan_($a)"},
    {PrimOp::Asin, "asin", kValue, "std::asin($a)", "kiln::asin_($a)"},
    {PrimOp::Acos, "acos", kValue, "std::acos($a)", "kiln::acos_($a)"},
    {PrimOp::Atan, "atan", kValue, "std::atan($a)", "kiln::atan_($a)"},
    {PrimOp::Sinh, "sinh", kValue, "std::sinh($a)", "kiln::sinh_($a)"},
    {PrimOp::Cosh, "cosh", kValue, "std::cosh($a)", "kiln::cosh_($a)"},
    {PrimOp::Asinh, "asinh", kValue, "std::asinh($a)", "kiln::asinh_($a)"},
    {PrimOp::Acosh, "acosh", kValue, "std::acosh($a)", "kiln::acosh_($a)"},
    {PrimOp::Atanh, "atanh", kValue, "std::atanh($a)", "kiln::atanh_($a)"},
    {PrimOp::Log1p, "log1p", kValue, "std::log1p($a)", "kiln::log1p_($a)"},
    {PrimOp::Expm1, "expm1", kValue, "std::expm1($a)", "kiln::expm1_($a)"},
    {PrimOp::Log2, "log2", kValue, "std::log2($a)", "kiln::log2_($a)"},
    {PrimOp::Log10, "log10", kValue, "std::log10($a)", "kiln::log10_($a)"},
    {PrimOp::Exp2, "exp2", kValue, "std::exp2($a)", "kiln::exp2_($a)"},
    {PrimOp::Erfc, "erfc", kValue, "std::erfc($a)", "kiln::erfc_($a)"},
    {PrimOp::Ceil, "ceil", kValue, "std::ceil($a)", "kiln::ceil_($a)"},
    {PrimOp::Floor, "floor", kValue, "std::floor($a)", "kiln::floor_($a)"},
    {PrimOp::Round, "round", kValue, "std::nearbyint($a)", "kiln::round_($a)"},
    {PrimOp::Trunc, "trunc", kValue, "std::trunc($a)", "kiln::trunc_($a)"},
    {PrimOp::Signbit, "signbit", kPredicate, "std::signbit($a)", "kiln::signbit_($a)"},
    {PrimOp::BitwiseNot, "bitnot", kValue, "kiln_bitwise_not($a)", "kiln::bitwise_not_($a)"},
    // binary math
    {PrimOp::Atan2, "atan2", kValue, "std::atan2($a, $b)", "kiln::atan2_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Fmod, "fmod", kValue, "std::fmod($a, $b)", "kiln::fmod_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Hypot, "hypot", kValue, "std::hypot($a, $b)", "kiln::hypot_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Copysign, "copysign", kValue, "std::copysign($a, $b)",
      "kiln::copysign_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Fmax, "fmax", kValue, "std::fmax($a, $b)", "kiln::fmax_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::Fmin, "fmin", kValue, "std::fmin($a, $b)", "kiln::fmin_(static_cast<$T>($a), static_cast<$T>($b))"},
    {PrimOp::BitwiseAnd, "bitand", kValue, "static_cast<$T>($a & $b)", "static_cast<$T>($a & $b)"},
    {PrimOp::BitwiseOr, "bitor", kValue, "static_cast<$T>($a | $b)", "static_cast<$T>($a | $b)"},
    {PrimOp::BitwiseXor, "bitxor", kValue, "static_cast<$T>($a ^ $b)", "static_cast<$T>($a ^ $b)"},
    // special functions (float compute types)
    {PrimOp::Lgamma, "lgamma", kValue, "std::lgamma($a)", "kiln::lgamma_($a)"},
    {PrimOp::Digamma, "digamma", kValue, "kiln_digamma($a)", "kiln::digamma_($a)"},
    {PrimOp::Erfinv, "erfinv", kValue, "kiln_erfinv($a)", "kiln::erfinv_($a)"},
    {PrimOp::Nextafter, "nextafter", kValue, "std::nextafter($a, $b)",
      "kiln::nextafter_(static_cast<$T>($a), static_cast<$T>($b))"},
    // index check: the gathered loads' own (cpp_prelude.h, kiln_scalar.cuh)
    {PrimOp::CheckedIndex, "checked_index", kValue, "kiln_gather_index($a, $b)", "kiln::gather_index($a, $b)"},
};

constexpr bool in_enum_order() {
  for (int i = 0; i < kPrimOpCount; ++i)
    if (static_cast<int>(kPrims[i].op) != i) return false;
  return true;
}
static_assert(sizeof(kPrims) / sizeof(kPrims[0]) == kPrimOpCount, "one row per PrimOp");
static_assert(in_enum_order(), "the prim table's rows follow PrimOp's order");

}  // namespace

const PrimFacts& prim_facts(PrimOp op) {
  const int index = static_cast<int>(op);
  KILN_ASSERT(index >= 0 && index < kPrimOpCount) << "no prim " << index;
  return kPrims[index];
}

const char* reduce_name(ReduceOp op) {
  static const char* const names[] = {"sum", "max", "min"};
  return names[static_cast<int>(op)];
}

}  // namespace kiln::decomp
