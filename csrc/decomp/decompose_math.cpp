// The math part of the ATen -> prims table: trigonometric and rounding functions, bitwise and logical ops,
// activations, predicates (isnan, signbit...), and the reductions var/std/logsumexp/any/all.
//
// Each builder follows ATen's CPU kernel for the op (the expression and the order of operations), because the
// OpInfo sweep compares against eager at pointwise tolerance: e.g. lerp switches formula at weight 0.5,
// remainder corrects fmod's sign, sign(NaN) is 0, nan_to_num replaces infinities by the dtype's finite
// extremes. Half and bfloat16 values compute in float (their compute type) and round once when stored.
#include <cmath>
#include <limits>

#include "decomp/decomposition_helpers.h"

namespace kiln::decomp::detail {

namespace {

bool floating_input(const Graph& g, const Node& n) {
  const auto* m = tensor_arg_meta(g, n, 0);
  return m && graph::is_floating_or_complex(m->dtype);
}
bool integral_output(const Graph& g, const Node& n) { return !graph::is_floating_or_complex(out_meta(g, n).dtype); }
bool not_bool_input(const Graph& g, const Node& n) {
  const auto* m = tensor_arg_meta(g, n, 0);
  return m && m->dtype != ScalarType::Bool;
}

// ATen clamps logit's input to [eps, 1 - eps] in the tensor's own dtype: for half/bfloat16 the bounds are rounded
// first, which constants here do not model, so those calls stay extern (the edge-value test found it).
bool logit_supported(const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  return t == ScalarType::Double || t == ScalarType::Float || (graph::is_floating_or_complex(t) && is_none(n, 1));
}

double largest_finite(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return 65504.0;
    case ScalarType::BFloat16: return 3.3895313892515355e38;
    case ScalarType::Float: return std::numeric_limits<float>::max();
    default: return std::numeric_limits<double>::max();
  }
}

// The predicate `f(x)` on the input in its own dtype (isnan, signbit...): bool output.
Builder predicate(std::function<Prim(PrimBuilder&, Prim)> f) {
  return [f](PrimBuilder& b, const Graph& g, const Node& n) {
    const auto* m = tensor_arg_meta(g, n, 0);
    b.set_output(0, f(b, arg_as(b, 0, opmath(m->dtype))));
  };
}

Prim sign_of(PrimBuilder& b, Prim x, ScalarType t) {  // 1, -1 or 0 (also for NaN), as ATen's sign
  Prim zero = b.constant(0, t);
  return select(b, b.binary(PrimOp::Gt, x, zero), b.constant(1, t),
                select(b, b.binary(PrimOp::Lt, x, zero), b.constant(-1, t), zero));
}

// ---- reductions -------------------------------------------------------------------------------------------
// Scalar? correction=None means 1 (Bessel); the divisor never drops below 0, as in ATen.
double variance_divisor(const Node& n, int64_t count) {
  const int arg = 2;
  const double correction = is_none(n, arg) ? 1.0 : number_arg(n, arg);
  return std::max(0.0, static_cast<double>(count) - correction);
}

// var/std (and their _mean forms): mean = sum(x)/N, var = sum((x-mean)^2) / max(0, N - correction).
Builder variance(bool take_sqrt, bool with_mean) {
  return [take_sqrt, with_mean](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    Prim x = arg_as(b, 0, t);
    Prim mean = b.binary(PrimOp::Div, b.reduce(ReduceOp::Sum, x), b.constant(static_cast<double>(b.reduction_size()), t));
    Prim centred = b.binary(PrimOp::Sub, x, mean);
    Prim squares = b.reduce(ReduceOp::Sum, b.binary(PrimOp::Mul, centred, centred));
    Prim var = b.binary(PrimOp::Div, squares, b.constant(variance_divisor(n, b.reduction_size()), t));
    b.set_output(0, take_sqrt ? b.unary(PrimOp::Sqrt, var) : var);
    if (with_mean) b.set_output(1, mean);
  };
}

// logsumexp: max + log(sum(exp(x - max))), the max replaced by 0 where it is infinite (ATen's guard
// against inf - inf).
void build_logsumexp(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = compute_dtype(g, n);
  Prim x = arg_as(b, 0, t);
  Prim max = b.reduce(ReduceOp::Max, x);
  Prim infinite = b.binary(PrimOp::Eq, b.unary(PrimOp::Abs, max), b.constant(INFINITY, t));
  Prim shift = select(b, infinite, b.constant(0, t), max);
  Prim total = b.reduce(ReduceOp::Sum, b.unary(PrimOp::Exp, b.binary(PrimOp::Sub, x, shift)));
  b.set_output(0, b.binary(PrimOp::Add, b.unary(PrimOp::Log, total), shift));
}

// any/all as counts (an empty reduction gives 0: any -> false, all -> true).
Builder any_all(bool all) {
  return [all](PrimBuilder& b, const Graph&, const Node&) {
    Prim truth = arg_as(b, 0, ScalarType::Bool);
    if (all) truth = b.unary(PrimOp::LogicalNot, truth);
    Prim count = b.reduce(ReduceOp::Sum, b.cast(truth, ScalarType::Long));
    Prim zero = b.constant(0, ScalarType::Long);
    b.set_output(0, b.binary(all ? PrimOp::Eq : PrimOp::Gt, count, zero));
  };
}

std::vector<int64_t> reduce_dims(const Graph& g, const Node& n, int arg) { return dims_from_arg(g, n, arg, true); }

}  // namespace

void add_math_decompositions(std::map<std::string, Decomposition>& t) {
  auto pointwise = [&](const std::string& name, Builder build, decltype(Decomposition::supports) ok) {
    t[name] = Decomposition{std::move(ok), nullptr, std::move(build), 1};
  };
  // Unary functions of floating results (integer inputs are promoted by the meta's output dtype).
  const std::pair<const char*, PrimOp> float_unary[] = {
      {"sin", PrimOp::Sin},     {"cos", PrimOp::Cos},     {"tan", PrimOp::Tan},       {"asin", PrimOp::Asin},
      {"acos", PrimOp::Acos},   {"atan", PrimOp::Atan},   {"sinh", PrimOp::Sinh},     {"cosh", PrimOp::Cosh},
      {"asinh", PrimOp::Asinh}, {"acosh", PrimOp::Acosh}, {"atanh", PrimOp::Atanh},   {"log1p", PrimOp::Log1p},
      {"expm1", PrimOp::Expm1}, {"log2", PrimOp::Log2},   {"log10", PrimOp::Log10},   {"exp2", PrimOp::Exp2},
      {"erfc", PrimOp::Erfc},   {"ceil", PrimOp::Ceil},   {"floor", PrimOp::Floor},   {"round", PrimOp::Round},
      {"trunc", PrimOp::Trunc}, {"lgamma", PrimOp::Lgamma}, {"digamma", PrimOp::Digamma}, {"erfinv", PrimOp::Erfinv}};
  for (const auto& [name, op] : float_unary)
    pointwise(std::string("aten::") + name + ".default", pointwise1([op = op](PrimBuilder& b, const Node&, Prim x, ScalarType) {
                return b.unary(op, x);
              }), is_floating_output);
  pointwise("aten::reciprocal.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
              return b.binary(PrimOp::Div, b.constant(1, t), x);
            }), is_floating_output);
  pointwise("aten::frac.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType) {
              return b.binary(PrimOp::Sub, x, b.unary(PrimOp::Trunc, x));
            }), is_floating_output);
  for (const auto& [name, factor] : {std::pair<const char*, double>{"deg2rad", kPi / 180.0}, {"rad2deg", 180.0 / kPi}})
    pointwise(std::string("aten::") + name + ".default", pointwise1([factor = factor](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
                return b.binary(PrimOp::Mul, x, b.constant(factor, t));
              }), is_floating_output);
  for (const char* name : {"aten::sign.default", "aten::sgn.default"})
    pointwise(name, pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType t) { return sign_of(b, x, t); }),
              not_bool_output);

  // Predicates (bool results).
  pointwise("aten::isnan.default", predicate([](PrimBuilder& b, Prim x) { return b.binary(PrimOp::Ne, x, x); }), nullptr);
  pointwise("aten::isinf.default", predicate([](PrimBuilder& b, Prim x) {
              return b.binary(PrimOp::Eq, b.unary(PrimOp::Abs, x), b.constant(INFINITY, b.dtype(x)));
            }), floating_input);
  for (const auto& [name, value] : {std::pair<const char*, double>{"isposinf", INFINITY}, {"isneginf", -INFINITY}})
    pointwise(std::string("aten::") + name + ".default", predicate([value = value](PrimBuilder& b, Prim x) {
                return b.binary(PrimOp::Eq, x, b.constant(value, b.dtype(x)));
              }), floating_input);
  pointwise("aten::signbit.default", predicate([](PrimBuilder& b, Prim x) { return b.unary(PrimOp::Signbit, x); }),
            not_bool_input);

  // Binary functions of floating results.
  const std::pair<const char*, PrimOp> float_binary[] = {
      {"aten::atan2.default", PrimOp::Atan2},    {"aten::hypot.default", PrimOp::Hypot},
      {"aten::copysign.Tensor", PrimOp::Copysign}, {"aten::copysign.Scalar", PrimOp::Copysign},
      {"aten::fmax.default", PrimOp::Fmax},      {"aten::fmin.default", PrimOp::Fmin},
      {"aten::fmod.Tensor", PrimOp::Fmod},       {"aten::fmod.Scalar", PrimOp::Fmod}};
  for (const auto& [name, op] : float_binary)
    pointwise(name, pointwise2([op = op](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) {
                return b.binary(op, x, y);
              }), is_floating_output);
  // remainder: fmod, moved into the divisor's sign (Python's %).
  for (const char* name : {"aten::remainder.Tensor", "aten::remainder.Scalar"})
    pointwise(name, pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
                Prim mod = b.binary(PrimOp::Fmod, x, y);
                Prim zero = b.constant(0, t);
                Prim differ = b.binary(PrimOp::Ne, b.binary(PrimOp::Lt, y, zero), b.binary(PrimOp::Lt, mod, zero));
                Prim fix = b.binary(PrimOp::LogicalAnd, b.binary(PrimOp::Ne, mod, zero), differ);
                return select(b, fix, b.binary(PrimOp::Add, mod, y), mod);
              }), is_floating_output);
  pointwise("aten::xlogy.Tensor", pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
              Prim product = select(b, b.binary(PrimOp::Eq, x, b.constant(0, t)), b.constant(0, t),
                                    b.binary(PrimOp::Mul, x, b.unary(PrimOp::Log, y)));
              return select(b, b.binary(PrimOp::Ne, y, y), y, product);
            }), is_floating_output);
  pointwise("aten::heaviside.default", pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim v, ScalarType t) {
              Prim zero = b.constant(0, t);
              return select(b, b.binary(PrimOp::Eq, x, zero), v,
                            b.cast(b.binary(PrimOp::Gt, x, zero), t));
            }), not_bool_output);
  for (const auto& [suffix, op] : {std::pair<const char*, PrimOp>{"and", PrimOp::BitwiseAnd}, {"or", PrimOp::BitwiseOr},
                                   {"xor", PrimOp::BitwiseXor}})
    for (const char* overload : {".Tensor", ".Scalar"})
      pointwise(std::string("aten::bitwise_") + suffix + overload,
                pointwise2([op = op](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) { return b.binary(op, x, y); }),
                integral_output);
  pointwise("aten::bitwise_not.default",
            pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType) { return b.unary(PrimOp::BitwiseNot, x); }),
            integral_output);
  for (const auto& [name, op] : {std::pair<const char*, PrimOp>{"logical_and", PrimOp::LogicalAnd},
                                 {"logical_or", PrimOp::LogicalOr}, {"logical_xor", PrimOp::Ne}})
    pointwise(std::string("aten::") + name + ".default", [op = op](PrimBuilder& b, const Graph&, const Node&) {
      b.set_output(0, b.binary(op, arg_as(b, 0, ScalarType::Bool), arg_as(b, 1, ScalarType::Bool)));
    }, nullptr);

  // Arithmetic composites.
  for (const char* name : {"aten::rsub.Tensor", "aten::rsub.Scalar"})  // other - alpha * self
    pointwise(name, [](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = compute_dtype(g, n);
      Prim scaled = arg_as(b, 0, t);
      if (is_number(n, 2) && number_arg(n, 2) != 1.0) scaled = b.binary(PrimOp::Mul, scaled, number(b, n, 2, t));
      b.set_output(0, b.binary(PrimOp::Sub, arg_as(b, 1, t), scaled));
    }, not_bool_output);
  for (const char* name : {"aten::lerp.Scalar", "aten::lerp.Tensor"})  // ATen: two formulas split at weight 0.5
    pointwise(name, [](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = compute_dtype(g, n);
      Prim start = arg_as(b, 0, t), end = arg_as(b, 1, t), weight = arg_as(b, 2, t);
      Prim diff = b.binary(PrimOp::Sub, end, start);
      Prim low = b.binary(PrimOp::Add, start, b.binary(PrimOp::Mul, weight, diff));
      Prim high = b.binary(PrimOp::Sub, end, b.binary(PrimOp::Mul, diff, b.binary(PrimOp::Sub, b.constant(1, t), weight)));
      Prim small = b.binary(PrimOp::Lt, b.unary(PrimOp::Abs, weight), b.constant(0.5, t));
      b.set_output(0, select(b, small, low, high));
    }, is_floating_output);
  for (const auto& [name, op] : {std::pair<const char*, PrimOp>{"aten::addcmul.default", PrimOp::Mul},
                                 {"aten::addcdiv.default", PrimOp::Div}})  // self + value * t1 (op) t2
    pointwise(name, [op = op](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = compute_dtype(g, n);
      Prim scaled = b.binary(PrimOp::Mul, number(b, n, 3, t), arg_as(b, 1, t));
      b.set_output(0, b.binary(PrimOp::Add, arg_as(b, 0, t), b.binary(op, scaled, arg_as(b, 2, t))));
    }, op == PrimOp::Div ? decltype(Decomposition::supports)(is_floating_output) : not_bool_output);
  for (const char* name : {"aten::masked_fill.Scalar", "aten::masked_fill.Tensor"})
    pointwise(name, [](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = out_meta(g, n).dtype;
      b.set_output(0, select(b, arg_as(b, 1, ScalarType::Bool), arg_as(b, 2, t), arg_as(b, 0, t)));
    }, nullptr);
  pointwise("aten::nan_to_num.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType out = out_meta(g, n).dtype, t = opmath(out);
    auto replacement = [&](int arg, double otherwise) { return is_none(n, arg) ? b.constant(otherwise, t) : number(b, n, arg, t); };
    Prim x = arg_as(b, 0, t);
    Prim r = select(b, b.binary(PrimOp::Eq, x, b.constant(-INFINITY, t)), replacement(3, -largest_finite(out)), x);
    r = select(b, b.binary(PrimOp::Eq, x, b.constant(INFINITY, t)), replacement(2, largest_finite(out)), r);
    b.set_output(0, select(b, b.binary(PrimOp::Ne, x, x), replacement(1, 0.0), r));
  }, is_floating_output);

  // Activations, following ATen's CPU formulas.
  pointwise("aten::hardtanh.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              return b.binary(PrimOp::Minimum, b.binary(PrimOp::Maximum, x, number(b, n, 1, t)), number(b, n, 2, t));
            }), not_bool_output);
  pointwise("aten::leaky_relu.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              return select(b, b.binary(PrimOp::Gt, x, b.constant(0, t)), x, b.binary(PrimOp::Mul, x, number(b, n, 1, t)));
            }), is_floating_output);
  pointwise("aten::elu.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              // x <= 0 ? expm1(x * input_scale) * alpha * scale : x * scale
              Prim negative = b.binary(PrimOp::Mul, b.unary(PrimOp::Expm1, b.binary(PrimOp::Mul, x, number(b, n, 3, t))),
                                       b.constant(number_arg(n, 1) * number_arg(n, 2), t));
              return select(b, b.binary(PrimOp::Le, x, b.constant(0, t)), negative, b.binary(PrimOp::Mul, x, number(b, n, 2, t)));
            }), is_floating_output);
  pointwise("aten::threshold.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              return select(b, b.binary(PrimOp::Le, x, number(b, n, 1, t)), number(b, n, 2, t), x);
            }), not_bool_output);
  for (const auto& [name, times_x] : {std::pair<const char*, bool>{"aten::hardsigmoid.default", false},
                                      {"aten::hardswish.default", true}})
    pointwise(name, pointwise1([times_x = times_x](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
                Prim relu6 = b.binary(PrimOp::Minimum, b.binary(PrimOp::Maximum, b.binary(PrimOp::Add, x, b.constant(3, t)),
                                                                b.constant(0, t)), b.constant(6, t));
                Prim scaled = times_x ? b.binary(PrimOp::Mul, x, relu6) : relu6;
                return b.binary(PrimOp::Div, scaled, b.constant(6, t));
              }), is_floating_output);
  pointwise("aten::softplus.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              Prim beta = number(b, n, 1, t);
              Prim scaled = b.binary(PrimOp::Mul, x, beta);
              Prim soft = b.binary(PrimOp::Div, b.unary(PrimOp::Log1p, b.unary(PrimOp::Exp, scaled)), beta);
              return select(b, b.binary(PrimOp::Gt, scaled, number(b, n, 2, t)), x, soft);
            }), is_floating_output);
  pointwise("aten::mish.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType) {
              return b.binary(PrimOp::Mul, x, b.unary(PrimOp::Tanh, b.unary(PrimOp::Log1p, b.unary(PrimOp::Exp, x))));
            }), is_floating_output);
  pointwise("aten::hardshrink.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              Prim lambd = number(b, n, 1, t);
              Prim inside = b.binary(PrimOp::LogicalAnd, b.binary(PrimOp::Ge, x, b.unary(PrimOp::Neg, lambd)),
                                     b.binary(PrimOp::Le, x, lambd));
              return select(b, inside, b.constant(0, t), x);
            }), is_floating_output);
  pointwise("aten::softshrink.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              Prim lambd = number(b, n, 1, t);
              // x * 0 rather than 0 in the middle: NaN stays NaN (the edge-value test found it).
              Prim below = select(b, b.binary(PrimOp::Lt, x, b.unary(PrimOp::Neg, lambd)), b.binary(PrimOp::Add, x, lambd),
                                  b.binary(PrimOp::Mul, x, b.constant(0, t)));
              return select(b, b.binary(PrimOp::Gt, x, lambd), b.binary(PrimOp::Sub, x, lambd), below);
            }), is_floating_output);
  pointwise("aten::logit.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              if (!is_none(n, 1)) {
                const double eps = number_arg(n, 1);
                x = b.binary(PrimOp::Minimum, b.binary(PrimOp::Maximum, x, b.constant(eps, t)), b.constant(1 - eps, t));
              }
              return b.unary(PrimOp::Log, b.binary(PrimOp::Div, x, b.binary(PrimOp::Sub, b.constant(1, t), x)));
            }), logit_supported);
  for (const char* name : {"aten::clamp.Tensor"}) pointwise(name, clamp_builder(1, 2), not_bool_output);
  pointwise("aten::clamp_min.Tensor", clamp_builder(1, -1), not_bool_output);
  pointwise("aten::clamp_max.Tensor", clamp_builder(-1, 1), not_bool_output);

  // Reductions.
  auto reducing = [&](const std::string& name, Builder build, int dims_arg, decltype(Decomposition::supports) ok, int outputs) {
    t[name] = Decomposition{std::move(ok), [dims_arg](const Graph& g, const Node& n) { return reduce_dims(g, n, dims_arg); },
                            std::move(build), outputs};
  };
  reducing("aten::var.correction", variance(false, false), 1, is_floating_output, 1);
  reducing("aten::std.correction", variance(true, false), 1, is_floating_output, 1);
  reducing("aten::var_mean.correction", variance(false, true), 1, is_floating_output, 2);
  reducing("aten::std_mean.correction", variance(true, true), 1, is_floating_output, 2);
  reducing("aten::logsumexp.default", build_logsumexp, 1, is_floating_output, 1);
  reducing("aten::any.default", any_all(false), -1, nullptr, 1);
  reducing("aten::all.default", any_all(true), -1, nullptr, 1);
  for (const char* overload : {".dim", ".dims"}) {
    reducing(std::string("aten::any") + overload, any_all(false), 1, nullptr, 1);
    reducing(std::string("aten::all") + overload, any_all(true), 1, nullptr, 1);
  }
}

}  // namespace kiln::decomp::detail
