// Derivative rules, third part: the rest of the elementwise math (trigonometric, hyperbolic, special functions),
// binary ops whose second operand is a tensor (atan2, pow, lerp, addcmul, clamp with tensor bounds ...),
// reductions (max/min/median over everything or a dim, sort, topk, cummax, p-norms, prod, cumprod, logcumsumexp).
// Products and linear algebra are in derivative_rules_linalg.cpp. As in derivative_rules.cpp, each rule
// mirrors eager's formula (tools/autograd/derivatives.yaml and FunctionsManual.cpp in PyTorch); the OpInfo gradient
// sweep (tests/python/test_opinfo_grad_sweep.py) compares them with eager.
#include <algorithm>
#include <cmath>
#include <set>

#include "autodiff/derivative_rule_helpers.h"
#include "common/error.h"

namespace kiln::autodiff::detail {

namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kLn10 = 2.30258509299404568402;

// ---- unary math: grad * f'(self) -----------------------------------------------------------------------
void rule_tan(RuleCall& c) {  // grad * (1 + result^2)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), plus(c, square(c, c.result(0)), 1.0)));
}
void rule_sinh(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::cosh", {tensor(c.input(0))})));
}
void rule_cosh(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::sinh", {tensor(c.input(0))})));
}
ValueId one_minus_square(RuleCall& c) { return plus(c, c.b.neg(square(c, c.input(0))), 1.0); }
void rule_asin(RuleCall& c) {  // grad * (1 - self^2).rsqrt()
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::rsqrt", {tensor(one_minus_square(c))})));
}
void rule_acos(RuleCall& c) {  // grad * -(1 - self^2).rsqrt()
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.b.neg(op(c, "aten::rsqrt", {tensor(one_minus_square(c))}))));
}
void rule_atan(RuleCall& c) {  // grad / (self^2 + 1)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), plus(c, square(c, c.input(0)), 1.0)));
}
void rule_asinh(RuleCall& c) {  // grad * (self^2 + 1).rsqrt()
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::rsqrt", {tensor(plus(c, square(c, c.input(0)), 1.0))})));
}
void rule_acosh(RuleCall& c) {  // grad * (self^2 - 1).rsqrt()
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::rsqrt", {tensor(plus(c, square(c, c.input(0)), -1.0))})));
}
void rule_atanh(RuleCall& c) {  // grad / (1 - self^2)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), one_minus_square(c)));
}
void rule_log2(RuleCall& c) {  // grad / (self * ln 2)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), c.b.mul(c.input(0), kLn2)));
}
void rule_log10(RuleCall& c) {  // grad / (self * ln 10)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), c.b.mul(c.input(0), kLn10)));
}
void rule_exp2(RuleCall& c) {  // grad * result * ln 2
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.b.mul(c.result(0), kLn2)));
}
void rule_erfc(RuleCall& c) {  // -2/sqrt(pi) * exp(-self^2) * grad
  if (!c.needs(0)) return;
  ValueId e = op(c, "aten::exp", {tensor(c.b.neg(square(c, c.input(0))))});
  c.set(0, c.b.mul(c.b.mul(e, -1.1283791670955126), c.grad()));
}
void rule_erfinv(RuleCall& c) {  // sqrt(pi)/2 * exp(result^2) * grad
  if (!c.needs(0)) return;
  ValueId e = op(c, "aten::exp", {tensor(square(c, c.result(0)))});
  c.set(0, c.b.mul(c.b.mul(e, 0.88622692545275801365), c.grad()));
}
void rule_lgamma(RuleCall& c) {  // grad * digamma(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::digamma", {tensor(c.input(0))})));
}
void rule_digamma(RuleCall& c) {  // grad * polygamma(1, self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::polygamma", {int64_t{1}, tensor(c.input(0))})));
}
void rule_polygamma(RuleCall& c) {  // polygamma(n, self): grad * polygamma(n + 1, self)
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), op(c, "aten::polygamma", {c.int_arg(0) + 1, tensor(c.input(1))})));
}
void rule_mvlgamma(RuleCall& c) {  // mvlgamma(self, p): grad * sum over j < p of digamma(self - j / 2)
  if (!c.needs(0)) return;
  ValueId total = op(c, "aten::digamma", {tensor(c.input(0))});
  for (int64_t j = 1; j < c.int_arg(1); ++j)
    total = c.b.add(total, op(c, "aten::digamma", {tensor(plus(c, c.input(0), -0.5 * static_cast<double>(j)))}));
  c.set(0, c.b.mul(c.grad(), total));
}
void rule_real_zero_gradient(RuleCall& c) {  // sgn of a real tensor, round(decimals): piecewise constant
  if (!c.needs(0)) return;
  if (is_complex(c.input_meta(0).dtype)) KILN_UNSUPPORTED() << c.node().qualified_name() << " of a complex tensor";
  c.set(0, zeros_like(c, c.grad()));
}
void rule_pass_through(RuleCall& c) {  // frac: grad
  if (c.needs(0)) c.set(0, c.grad());
}
void rule_rad2deg(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), 180.0 / kPi));
}
void rule_deg2rad(RuleCall& c) {
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), kPi / 180.0));
}
void rule_logit(RuleCall& c) {  // logit(self, eps?)
  if (c.needs(0)) c.set(0, op(c, "aten::logit_backward", {tensor(c.grad()), tensor(c.input(0)), c.arg(1)}));
}
void rule_sinc(RuleCall& c) {  // grad * (pi x cos(pi x) - sin(pi x)) / (pi x^2), 0 at x = 0
  if (!c.needs(0)) return;
  ValueId x = c.input(0);
  ValueId pi_x = c.b.mul(x, kPi);
  ValueId pi_x_squared = c.b.mul(square(c, x), kPi);
  ValueId numerator = op(c, "aten::sub", {tensor(c.b.mul(pi_x, op(c, "aten::cos", {tensor(pi_x)}))),
                                          tensor(op(c, "aten::sin", {tensor(pi_x)})), int64_t{1}}, "Tensor");
  ValueId out = c.b.div(c.b.mul(c.grad(), numerator), pi_x_squared);
  c.set(0, zero_where(c, op(c, "aten::eq", {tensor(pi_x_squared), 0.0}, "Scalar"), out));
}
void rule_i0(RuleCall& c) {  // grad * i1(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::special_i1", {tensor(c.input(0))})));
}
void rule_i0e(RuleCall& c) {  // grad * (i1e(self) - sgn(self) * result)
  if (!c.needs(0)) return;
  ValueId sgn_result = c.b.mul(op(c, "aten::sgn", {tensor(c.input(0))}), c.result(0));
  ValueId d = op(c, "aten::sub", {tensor(op(c, "aten::special_i1e", {tensor(c.input(0))})), tensor(sgn_result), int64_t{1}}, "Tensor");
  c.set(0, c.b.mul(c.grad(), d));
}
void rule_ndtri(RuleCall& c) {  // grad * sqrt(2 pi) * exp(result^2 / 2)
  if (!c.needs(0)) return;
  ValueId e = op(c, "aten::exp", {tensor(c.b.mul(square(c, c.result(0)), 0.5))});
  c.set(0, c.b.mul(c.b.mul(c.grad(), 2.5066282746310002), e));
}
void rule_log_ndtr(RuleCall& c) {  // grad / sqrt(2 pi) * exp(-(result + self^2 / 2))
  if (!c.needs(0)) return;
  ValueId exponent = c.b.neg(c.b.add(c.result(0), c.b.mul(square(c, c.input(0)), 0.5)));
  c.set(0, c.b.mul(c.b.mul(c.grad(), 0.3989422804014327), op(c, "aten::exp", {tensor(exponent)})));
}
void rule_erfcx(RuleCall& c) {  // (2 self result - 2/sqrt(pi)) * grad
  if (!c.needs(0)) return;
  ValueId d = plus(c, c.b.mul(c.b.mul(c.input(0), c.result(0)), 2.0), -1.1283791670955126);
  c.set(0, c.b.mul(d, c.grad()));
}
void rule_entr(RuleCall& c) {  // grad * -(1 + log(self))
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), c.b.neg(plus(c, op(c, "aten::log", {tensor(c.input(0))}), 1.0))));
}
void rule_nan_to_num(RuleCall& c) {  // grad * isfinite(self)
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::isfinite", {tensor(c.input(0))})));
}
void rule_celu(RuleCall& c) {  // celu(self, alpha): elu_backward(grad, alpha, 1, 1 / alpha, false, self)
  if (!c.needs(0)) return;
  const double alpha = c.number_arg(1);
  c.set(0, op(c, "aten::elu_backward", {tensor(c.grad()), alpha, 1.0, 1.0 / alpha, false, tensor(c.input(0))}));
}
// softshrink / hardshrink(self, lambd), threshold(self, threshold, value): backward(grad, self, <arg 1>)
void rule_shrink_or_threshold(RuleCall& c) {
  if (!c.needs(0)) return;
  static const std::map<std::string, const char*> backward = {{"aten::softshrink.default", "aten::softshrink_backward"},
                                                              {"aten::hardshrink.default", "aten::hardshrink_backward"},
                                                              {"aten::threshold.default", "aten::threshold_backward"}};
  c.set(0, op(c, backward.at(c.node().qualified_name()), {tensor(c.grad()), tensor(c.input(0)), c.arg(1)}));
}
void rule_frexp(RuleCall& c) {  // (mantissa, exponent): grad / exp2(exponent)
  if (c.needs(0)) c.set(0, c.b.div(c.grad(), op(c, "aten::exp2", {tensor(c.result(1))})));
}
void rule_ldexp(RuleCall& c) {  // self * 2^other: self gets grad * 2^other, other grad * result * ln 2
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), op(c, "aten::exp2", {operand(c, 1)})));
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.b.mul(c.result(0), kLn2)));
}

// ---- binary ops --------------------------------------------------------------------------------------
void rule_atan2(RuleCall& c) {  // self: grad * other / (self^2 + other^2); other: grad * -self / (...)
  ValueId self = c.input(0), other = c.input(1);
  ValueId reciprocal = op(c, "aten::reciprocal", {tensor(c.b.add(square(c, self), square(c, other)))});
  set_if(c, 0, c.b.mul(c.b.mul(c.grad(), other), reciprocal));
  if (c.needs(1)) c.set(1, c.b.mul(c.b.mul(c.grad(), c.b.neg(self)), reciprocal));
}
void rule_hypot(RuleCall& c) {  // self: grad * self / result; other: grad * other / result
  if (c.needs(0)) c.set(0, c.b.div(c.b.mul(c.grad(), c.input(0)), c.result(0)));
  if (c.needs(1)) c.set(1, c.b.div(c.b.mul(c.grad(), c.input(1)), c.result(0)));
}
// fmax / fmin: self gets grad where self wins (>= / <=) or other is NaN, other gets the rest.
void fmax_fmin(RuleCall& c, const char* self_wins) {
  ValueId self = c.input(0), other = c.input(1);
  ValueId wins = logical(c, "aten::logical_or", compare(c, self_wins, self, tensor(other)), op(c, "aten::isnan", {tensor(other)}));
  if (c.needs(0)) c.set(0, keep_where(c, wins, c.grad()));
  if (c.needs(1)) c.set(1, zero_where(c, wins, c.grad()));
}
void rule_fmax(RuleCall& c) { fmax_fmin(c, "aten::ge"); }
void rule_fmin(RuleCall& c) { fmax_fmin(c, "aten::le"); }
void rule_copysign(RuleCall& c) {  // self: grad * (result / self), 0 where self is 0; other: zeros
  if (c.needs(0)) {
    ValueId ratio = c.b.div(c.result(0), c.input(0));
    ratio = zero_where(c, op(c, "aten::eq", {tensor(c.input(0)), 0.0}, "Scalar"), ratio);
    c.set(0, c.b.mul(c.grad(), ratio));
  }
  if (c.needs(1)) c.set(1, zeros_like(c, c.input(1)));
}
// logaddexp(2): self gets grad / (1 + e^(other - self)) (2^ for logaddexp2), other the same mirrored.
void logaddexp_back(RuleCall& c, const char* power) {
  ValueId self = c.input(0), other = c.input(1);
  auto part = [&](ValueId a, ValueId b) {
    ValueId d = op(c, "aten::sub", {tensor(b), tensor(a), int64_t{1}}, "Tensor");
    return c.b.div(c.grad(), plus(c, op(c, power, {tensor(d)}), 1.0));
  };
  if (c.needs(0)) c.set(0, part(self, other));
  if (c.needs(1)) c.set(1, part(other, self));
}
void rule_logaddexp(RuleCall& c) { logaddexp_back(c, "aten::exp"); }
void rule_logaddexp2(RuleCall& c) { logaddexp_back(c, "aten::exp2"); }
// xlogy(self, other) / xlog1py: self gets xlogy(grad, other) (xlog1py), 0 where self == 0 and other <= 0
// (<= -1); other gets grad * self / other (/ (other + 1)).
void xlog_back(RuleCall& c, bool one_plus) {
  ValueId self = c.input(0), other = c.input(1);
  if (c.needs(0)) {
    ValueId g = op(c, one_plus ? "aten::special_xlog1py" : "aten::xlogy", {tensor(c.grad()), tensor(other)}, one_plus ? "default" : "Tensor");
    ValueId edge = logical(c, "aten::logical_and", op(c, "aten::eq", {tensor(self), 0.0}, "Scalar"),
                           op(c, "aten::le", {tensor(other), one_plus ? -1.0 : 0.0}, "Scalar"));
    c.set(0, zero_where(c, edge, g));
  }
  if (c.needs(1)) c.set(1, c.b.div(c.b.mul(c.grad(), self), one_plus ? plus(c, other, 1.0) : other));
}
void rule_xlogy(RuleCall& c) { xlog_back(c, false); }
void rule_xlog1py(RuleCall& c) { xlog_back(c, true); }
// pow(self, exponent) with a tensor exponent: self gets grad * exponent * self^(exponent - 1), 0 where
// exponent == 0; exponent gets grad * result * log(self), 0 where self == 0 and exponent >= 0.
void rule_pow_tensor_tensor(RuleCall& c) {
  ValueId self = c.input(0);
  Arg exponent = operand(c, 1);
  if (c.needs(0)) {
    ValueId lowered = op(c, "aten::sub", {exponent, 1.0, int64_t{1}}, "Scalar");
    ValueId d = op(c, "aten::mul", {exponent, tensor(op(c, "aten::pow", {tensor(self), tensor(lowered)}, "Tensor_Tensor"))}, "Tensor");
    ValueId g = c.b.mul(c.grad(), d);
    c.set(0, zero_where(c, op(c, "aten::eq", {exponent, 0.0}, "Scalar"), g));
  }
  if (c.needs(1)) {
    ValueId g = c.b.mul(c.grad(), c.b.mul(c.result(0), op(c, "aten::log", {tensor(self)})));
    ValueId edge = logical(c, "aten::logical_and", op(c, "aten::eq", {tensor(self), 0.0}, "Scalar"),
                           op(c, "aten::ge", {exponent, 0.0}, "Scalar"));
    c.set(1, zero_where(c, edge, g));
  }
}
void rule_lerp_scalar(RuleCall& c) {  // lerp(self, end, weight): self: grad * (1 - weight); end: grad * weight
  const double weight = c.number_arg(2);
  if (c.needs(0)) c.set(0, c.b.mul(c.grad(), 1.0 - weight));
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), weight));
}
void rule_lerp_tensor(RuleCall& c) {  // ... weight: grad * (end - self)
  Arg weight = operand(c, 2);
  if (c.needs(0)) {
    ValueId one_minus = op(c, "aten::rsub", {weight, 1.0, int64_t{1}}, "Scalar");
    c.set(0, c.b.mul(c.grad(), one_minus));
  }
  if (c.needs(1)) c.set(1, op(c, "aten::mul", {tensor(c.grad()), weight}, "Tensor"));
  if (c.needs(2)) c.set(2, c.b.mul(c.grad(), op(c, "aten::sub", {operand(c, 1), operand(c, 0), int64_t{1}}, "Tensor")));
}
void rule_addcmul(RuleCall& c) {  // self + value * t1 * t2
  const double value = c.number_arg(3);
  set_if(c, 0, c.grad());
  if (c.needs(1)) c.set(1, c.b.mul(c.b.mul(c.grad(), c.input(2)), value));
  if (c.needs(2)) c.set(2, c.b.mul(c.b.mul(c.grad(), c.input(1)), value));
}
void rule_addcdiv(RuleCall& c) {  // self + value * t1 / t2
  const double value = c.number_arg(3);
  set_if(c, 0, c.grad());
  if (c.needs(1)) c.set(1, c.b.mul(c.grad(), c.b.mul(op(c, "aten::reciprocal", {tensor(c.input(2))}), value)));
  if (c.needs(2)) {
    ValueId ratio = c.b.div(c.b.mul(c.input(1), value), square(c, c.input(2)));
    c.set(2, c.b.mul(c.b.neg(c.grad()), ratio));
  }
}
void rule_rsub(RuleCall& c) {  // rsub(self, other, alpha) = other - alpha * self
  if (c.needs(0)) c.set(0, c.b.mul(c.b.neg(c.grad()), c.number_arg(2)));
  if (c.needs(1)) c.set(1, c.grad());
}
// remainder / fmod(self, other): self gets grad, other -grad * self.div(other, floor / trunc).
void remainder_back(RuleCall& c, const char* rounding) {
  set_if(c, 0, c.grad());
  if (c.needs(1)) {
    ValueId quotient = op(c, "aten::div", {tensor(c.input(0)), tensor(c.input(1)), std::string(rounding)}, "Tensor_mode");
    c.set(1, c.b.mul(c.b.neg(c.grad()), quotient));
  }
}
void rule_remainder(RuleCall& c) { remainder_back(c, "floor"); }
void rule_fmod(RuleCall& c) { remainder_back(c, "trunc"); }
void rule_div_mode(RuleCall& c) {  // div(self, other, rounding_mode): rounded results have gradient grad * 0
  if (!c.is_none(2)) {
    set_if(c, 0, c.b.mul(c.grad(), 0.0));
    if (c.needs(1)) c.set(1, c.b.mul(c.grad(), 0.0));
    return;
  }
  if (c.needs(0)) c.set(0, op(c, "aten::div", {tensor(c.grad()), operand(c, 1)}, "Tensor"));
  if (c.needs(1)) {
    ValueId ratio = op(c, "aten::div", {tensor(op(c, "aten::div", {operand(c, 0), tensor(c.input(1))}, "Tensor")), tensor(c.input(1))}, "Tensor");
    c.set(1, c.b.mul(c.b.neg(c.grad()), ratio));
  }
}
// clamp with tensor bounds: self keeps grad within [min, max]; min gets it where self < min (and min < max),
// max where self > max (or max < min), as eager's clamp_backward_min_max.
void rule_clamp_tensor(RuleCall& c) {
  const bool has_min = !c.is_none(1), has_max = !c.is_none(2);
  ValueId self = c.input(0);
  if (c.needs(0)) {
    std::optional<ValueId> inside;
    if (has_min) inside = compare(c, "aten::ge", self, operand(c, 1));
    if (has_max) {
      ValueId below = compare(c, "aten::le", self, operand(c, 2));
      inside = inside ? logical(c, "aten::logical_and", *inside, below) : below;
    }
    c.set(0, inside ? keep_where(c, *inside, c.grad()) : c.grad());
  }
  if (has_min && has_max) {  // a bound that is a number gets no gradient
    if (c.needs(1)) {
      ValueId lo = c.input(1);
      ValueId below = logical(c, "aten::logical_and", compare(c, "aten::lt", self, tensor(lo)), compare(c, "aten::lt", lo, operand(c, 2)));
      c.set(1, keep_where(c, below, c.grad()));
    }
    if (c.needs(2)) {
      ValueId hi = c.input(2);
      ValueId above = logical(c, "aten::logical_or", compare(c, "aten::gt", self, tensor(hi)), compare(c, "aten::lt", hi, operand(c, 1)));
      c.set(2, keep_where(c, above, c.grad()));
    }
  } else if (has_min && c.needs(1)) {
    c.set(1, keep_where(c, compare(c, "aten::lt", self, tensor(c.input(1))), c.grad()));
  } else if (has_max && c.needs(2)) {
    c.set(2, keep_where(c, compare(c, "aten::gt", self, tensor(c.input(2))), c.grad()));
  }
}
void rule_clamp_min_tensor(RuleCall& c) {  // clamp_min(self, min)
  if (c.needs(0)) c.set(0, keep_where(c, compare(c, "aten::ge", c.input(0), operand(c, 1)), c.grad()));
  if (c.needs(1)) c.set(1, keep_where(c, compare(c, "aten::lt", c.input(0), tensor(c.input(1))), c.grad()));
}
void rule_clamp_max_tensor(RuleCall& c) {  // clamp_max(self, max)
  if (c.needs(0)) c.set(0, keep_where(c, compare(c, "aten::le", c.input(0), operand(c, 1)), c.grad()));
  if (c.needs(1)) c.set(1, keep_where(c, compare(c, "aten::gt", c.input(0), tensor(c.input(1))), c.grad()));
}

// ---- reductions ----------------------------------------------------------------------------------------
// max() / min() / median() / nanmedian() over everything: the gradient shared evenly among the elements equal
// to the result (NaN counting as equal to a NaN result), as eager's evenly_distribute_backward.
void rule_evenly_distributed(RuleCall& c) {
  if (!c.needs(0)) return;
  ValueId self = c.input(0), value = c.result(0);
  ValueId both_nan = logical(c, "aten::logical_and", op(c, "aten::isnan", {tensor(self)}), op(c, "aten::isnan", {tensor(value)}));
  ValueId mask = logical(c, "aten::logical_or", compare(c, "aten::eq", self, tensor(value)), both_nan);
  ValueId count = op(c, "aten::sum", {tensor(mask), graph::NoneArg{}});
  c.set(0, c.b.mul(mask, c.b.div(c.grad(), count)));
}
// (values, indices) = op(self, ..., dim, keepdim): the gradient goes back to the selected indices.
void value_selecting_back(RuleCall& c, int64_t dim, bool keepdim) {
  if (!c.needs(0)) return;
  c.set(0, op(c, "aten::value_selecting_reduction_backward",
              {tensor(c.grad()), dim, tensor(c.result(1)), c.input_meta(0).sizes, keepdim}));
}
void rule_max_min_dim(RuleCall& c) { value_selecting_back(c, c.int_arg(1), c.bool_arg(2)); }  // also mode, median.dim
void rule_kthvalue(RuleCall& c) { value_selecting_back(c, c.int_arg(2), c.bool_arg(3)); }
void rule_sort(RuleCall& c) { value_selecting_back(c, c.int_arg(1), true); }
void rule_topk(RuleCall& c) { value_selecting_back(c, c.int_arg(2), true); }
void rule_cummax_cummin(RuleCall& c) {  // (values, indices) = cummax(self, dim): scatter_add of grad at indices
  if (c.needs(0))
    c.set(0, op(c, "aten::scatter_add", {tensor(zeros_like(c, c.input(0))), c.arg(1), tensor(c.result(1)), tensor(c.grad())}));
}
// aminmax(self, *, dim?, keepdim) -> (min, max): each result's gradient shared evenly among the elements equal
// to it, as amin and amax.
void rule_aminmax(RuleCall& c) {
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  const bool keepdim = c.bool_arg(2);
  std::optional<ValueId> total;
  for (size_t i = 0; i < 2; ++i) {
    auto g = c.grad_at(i);
    if (!g) continue;
    ValueId mask = compare(c, "aten::eq", c.input(0), tensor(kept(c, c.result(i), r, keepdim)));
    ValueId count = c.b.emit("aten::sum", "dim_IntList", {tensor(mask), r.dims, true, graph::NoneArg{}});
    ValueId part = c.b.mul(c.b.div(kept(c, *g, r, keepdim), count), mask);
    total = total ? c.b.add(*total, part) : part;
  }
  if (total) c.set(0, *total);
}
void rule_nansum(RuleCall& c) {  // nansum(self, dim?, keepdim, dtype?): grad where self is not NaN
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  ValueId g = c.b.to_dtype(kept(c, c.grad(), r, c.bool_arg(2)), c.input_meta(0).dtype);
  c.set(0, c.b.mul(g, op(c, "aten::logical_not", {tensor(op(c, "aten::isnan", {tensor(c.input(0))}))})));
}
// var_mean / std_mean(self, dim?, *, correction?, keepdim) -> (var or std, mean): both results differentiable.
void statistic_mean_back(RuleCall& c, bool std_dev) {
  if (!c.needs(0)) return;
  const Reduced r = reduced_dims(c, 1);
  const bool keepdim = c.bool_arg(3);
  const double correction = c.is_none(2) ? 1.0 : c.number_arg(2);
  std::optional<ValueId> total;
  if (auto g = c.grad_at(0)) {
    ValueId scaled = kept(c, *g, r, keepdim);
    if (std_dev) {
      ValueId sd = kept(c, c.result(0), r, keepdim);
      scaled = zero_where(c, op(c, "aten::eq", {tensor(sd), 0.0}, "Scalar"), c.b.div(scaled, c.b.mul(sd, 2.0)));
    }
    ValueId centred = op(c, "aten::sub", {tensor(c.input(0)), tensor(kept(c, c.result(1), r, keepdim)), int64_t{1}}, "Tensor");
    total = c.b.mul(c.b.mul(centred, 2.0 / (static_cast<double>(r.count) - correction)), scaled);
  }
  if (auto g = c.grad_at(1)) {
    ValueId spread = c.b.expand(c.b.mul(kept(c, *g, r, keepdim), 1.0 / static_cast<double>(r.count)), c.input_meta(0).sizes);
    total = total ? c.b.add(*total, spread) : spread;
  }
  if (total) c.set(0, *total);
}
void rule_var_mean(RuleCall& c) { statistic_mean_back(c, false); }
void rule_std_mean(RuleCall& c) { statistic_mean_back(c, true); }
void rule_trace(RuleCall& c) {  // grad on the diagonal of an [n, m] matrix
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (sizes.size() != 2) KILN_UNSUPPORTED() << "trace of a tensor that is not a matrix";
  const int64_t k = std::min(sizes[0], sizes[1]);
  ValueId diagonal = c.b.expand(c.b.reshape(c.grad(), {1}), {k});
  ValueId square_matrix = op(c, "aten::diag_embed", {tensor(diagonal), int64_t{0}, int64_t{-2}, int64_t{-1}});
  c.set(0, op(c, "aten::constant_pad_nd", {tensor(square_matrix), std::vector<int64_t>{0, sizes[1] - k, 0, sizes[0] - k}, 0.0}));
}

// The gradient of a p-norm of `x` over `r`'s dims (eager's norm_backward), given the norm and its gradient.
ValueId norm_back(RuleCall& c, ValueId x, double p, ValueId norm_result, ValueId grad, const Reduced& r, bool keepdim) {
  ValueId g = kept(c, grad, r, keepdim), norm = kept(c, norm_result, r, keepdim);
  if (p == 0.0) return zeros_like(c, x);
  ValueId sgn = op(c, "aten::sgn", {tensor(x)});
  if (p == 1.0) return c.b.mul(sgn, g);
  auto over_norm_power = [&](double power) {  // grad / norm^power, 0 where the norm is 0
    ValueId scale = c.b.div(g, power == 1.0 ? norm : op(c, "aten::pow", {tensor(norm), power}, "Tensor_Scalar"));
    return zero_where(c, op(c, "aten::eq", {tensor(norm), 0.0}, "Scalar"), scale);
  };
  if (p == 2.0) return c.b.mul(x, over_norm_power(1.0));
  ValueId magnitude = op(c, "aten::abs", {tensor(x)});
  if (std::isinf(p)) {  // the gradient shared among the elements whose magnitude is the norm (or NaN)
    ValueId mask = logical(c, "aten::logical_or", compare(c, "aten::eq", magnitude, tensor(norm)), op(c, "aten::isnan", {tensor(magnitude)}));
    ValueId count = c.b.emit("aten::sum", "dim_IntList", {tensor(mask), r.dims, true, graph::NoneArg{}});
    return c.b.mul(sgn, c.b.mul(c.b.div(g, count), mask));
  }
  if (p < 1.0) {
    ValueId scaled = zero_where(c, op(c, "aten::eq", {tensor(x), 0.0}, "Scalar"), op(c, "aten::pow", {tensor(magnitude), p - 1.0}, "Tensor_Scalar"));
    return c.b.mul(c.b.mul(c.b.mul(sgn, scaled), g), op(c, "aten::pow", {tensor(norm), 1.0 - p}, "Tensor_Scalar"));
  }
  if (p < 2.0) return c.b.mul(c.b.mul(sgn, op(c, "aten::pow", {tensor(magnitude), p - 1.0}, "Tensor_Scalar")), over_norm_power(p - 1.0));
  return c.b.mul(c.b.mul(x, op(c, "aten::pow", {tensor(magnitude), p - 2.0}, "Tensor_Scalar")), over_norm_power(p - 1.0));
}
Reduced all_dims(const std::vector<int64_t>& sizes) {
  Reduced r;
  r.kept_sizes = sizes;
  for (size_t d = 0; d < sizes.size(); ++d) {
    r.dims.push_back(static_cast<int64_t>(d));
    r.count *= sizes[d];
    r.kept_sizes[d] = 1;
  }
  return r;
}
void rule_vector_norm(RuleCall& c) {  // linalg_vector_norm(self, ord, dim?, keepdim, *, dtype?)
  if (!c.needs(0)) return;
  if (!c.is_none(4)) KILN_UNSUPPORTED() << "linalg_vector_norm with a dtype";
  c.set(0, norm_back(c, c.input(0), c.number_arg(1), c.result(0), c.grad(), reduced_dims(c, 2), c.bool_arg(3)));
}
void rule_norm_dims(RuleCall& c) {  // norm.ScalarOpt_dim(self, p?, dim, keepdim)
  if (!c.needs(0)) return;
  const double p = c.is_none(1) ? 2.0 : c.number_arg(1);
  c.set(0, norm_back(c, c.input(0), p, c.result(0), c.grad(), reduced_dims(c, 2), c.bool_arg(3)));
}
void rule_dist(RuleCall& c) {  // dist(self, other, p) = norm(self - other, p)
  if (!c.needs(0) && !c.needs(1)) return;
  ValueId difference = op(c, "aten::sub", {tensor(c.input(0)), tensor(c.input(1)), int64_t{1}}, "Tensor");
  ValueId g = norm_back(c, difference, c.number_arg(2), c.result(0), c.grad(), all_dims(c.b.meta(difference).sizes), false);
  if (c.needs(0)) c.set(0, g);
  if (c.needs(1)) c.set(1, c.b.neg(g));
}
// prod over everything or along a dim: the product of the other elements, as the exclusive products before
// and after each element (eager's prod_safe_zeros_backward: exact where elements are 0).
ValueId exclusive_products(RuleCall& c, ValueId x, int64_t dim, int64_t length) {
  auto slice = [&](ValueId v, int64_t start, int64_t end) {
    return op(c, "aten::slice", {tensor(v), dim, start, end, int64_t{1}}, "Tensor");
  };
  auto cumprod = [&](ValueId v) { return op(c, "aten::cumprod", {tensor(v), dim, graph::NoneArg{}}); };
  const std::vector<int64_t> dims = {dim};
  ValueId ones = ones_like(c, slice(x, 0, 1));
  ValueId before = cumprod(op(c, "aten::cat", {graph::TensorListArg{{ones, slice(x, 0, length - 1)}}, dim}));
  ValueId reversed = op(c, "aten::flip", {tensor(slice(x, 1, length)), dims});
  ValueId after = op(c, "aten::flip", {tensor(cumprod(op(c, "aten::cat", {graph::TensorListArg{{ones, reversed}}, dim}))), dims});
  return c.b.mul(before, after);
}
void rule_prod(RuleCall& c) {  // prod(self, dtype?)
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (sizes.empty()) {
    c.set(0, c.grad());
    return;
  }
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  if (n == 0) {
    c.set(0, c.b.expand(c.b.reshape(c.grad(), std::vector<int64_t>(sizes.size(), 1)), sizes));
    return;
  }
  ValueId flat = c.b.reshape(c.input(0), {n});
  ValueId others = c.b.reshape(exclusive_products(c, flat, 0, n), sizes);
  c.set(0, c.b.mul(c.b.to_dtype(c.grad(), c.input_meta(0).dtype), others));
}
void rule_prod_dim(RuleCall& c) {  // prod.dim_int(self, dim, keepdim, dtype?)
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (sizes.empty()) {
    c.set(0, c.grad());
    return;
  }
  const int64_t dim = normalize_dim(c.int_arg(1), sizes.size());
  if (sizes.at(dim) == 0) KILN_UNSUPPORTED() << "prod over an empty dim";
  std::vector<int64_t> kept_sizes = sizes;
  kept_sizes[dim] = 1;
  ValueId g = c.bool_arg(2) ? c.grad() : c.b.reshape(c.grad(), kept_sizes);
  c.set(0, c.b.mul(c.b.to_dtype(g, c.input_meta(0).dtype), exclusive_products(c, c.input(0), dim, sizes[dim])));
}
void rule_cross(RuleCall& c) {  // linalg_cross(self, other, dim): self gets cross(other, grad), other cross(grad, self)
  if (c.needs(0)) c.set(0, op(c, "aten::linalg_cross", {tensor(c.input(1)), tensor(c.grad()), c.arg(2)}));
  if (c.needs(1)) c.set(1, op(c, "aten::linalg_cross", {tensor(c.grad()), tensor(c.input(0)), c.arg(2)}));
}
void rule_fill(RuleCall& c) {  // fill.Scalar(self, value): every element replaced
  if (c.needs(0)) c.set(0, zeros_like(c, c.grad()));
}
// special_i1 / special_i1e: grad * (i0(x) - result / x) (i1e: i0e(x) - result * (sgn(x) + 1 / x)), 0.5 at x = 0,
// with x kept away from 0 by the dtype's epsilon as eager does.
void bessel_i1_back(RuleCall& c, bool scaled) {
  if (!c.needs(0)) return;
  const double eps = c.input_meta(0).dtype == graph::ScalarType::Double ? 2.220446049250313e-16 : 1.1920928955078125e-07;
  ValueId x = c.input(0);
  ValueId not_tiny = op(c, "aten::gt", {tensor(op(c, "aten::abs", {tensor(x)})), eps}, "Scalar");
  ValueId safe = op(c, "aten::where", {tensor(not_tiny), tensor(x), eps}, "ScalarOther");
  ValueId reciprocal = op(c, "aten::reciprocal", {tensor(safe)});
  ValueId d;
  if (scaled) {
    ValueId factor = c.b.add(op(c, "aten::sgn", {tensor(safe)}), reciprocal);
    d = op(c, "aten::sub", {tensor(op(c, "aten::special_i0e", {tensor(safe)})), tensor(c.b.mul(c.result(0), factor)), int64_t{1}}, "Tensor");
  } else {
    d = op(c, "aten::sub", {tensor(op(c, "aten::i0", {tensor(safe)})), tensor(c.b.mul(c.result(0), reciprocal)), int64_t{1}}, "Tensor");
  }
  c.set(0, c.b.mul(c.grad(), op(c, "aten::where", {tensor(not_tiny), tensor(d), 0.5}, "ScalarOther")));
}
void rule_i1(RuleCall& c) { bessel_i1_back(c, false); }
void rule_i1e(RuleCall& c) { bessel_i1_back(c, true); }

// logcumsumexp(self, dim): eager's formula, positive and negative parts of the gradient in log space.
void rule_logcumsumexp(RuleCall& c) {
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (sizes.empty()) {
    c.set(0, c.grad());
    return;
  }
  const std::vector<int64_t> dims = {normalize_dim(c.int_arg(1), sizes.size())};
  const double lowest = c.input_meta(0).dtype == graph::ScalarType::Double ? -1.7976931348623157e308 : -3.4028234663852886e38;
  auto reverse_logcumsumexp = [&](ValueId v) {
    ValueId flipped = op(c, "aten::flip", {tensor(v), dims});
    return op(c, "aten::flip", {tensor(op(c, "aten::logcumsumexp", {tensor(flipped), dims[0]})), dims});
  };
  ValueId grad = c.grad();
  ValueId log_abs = op(c, "aten::log", {tensor(op(c, "aten::abs", {tensor(grad)}))});
  auto part = [&](const char* sign_test) {
    ValueId log_grad = op(c, "aten::where", {tensor(op(c, sign_test, {tensor(grad), 0.0}, "Scalar")), tensor(log_abs), lowest}, "ScalarOther");
    ValueId shifted = op(c, "aten::sub", {tensor(log_grad), tensor(c.result(0)), int64_t{1}}, "Tensor");
    return op(c, "aten::exp", {tensor(c.b.add(reverse_logcumsumexp(shifted), c.input(0)))});
  };
  c.set(0, op(c, "aten::sub", {tensor(part("aten::gt")), tensor(part("aten::lt")), int64_t{1}}, "Tensor"));
}

// cumprod(self, dim, dtype?): x_i's gradient is E_i * S_i, with E_i the product of the elements before it (the result
// shifted by one) and S_i = g_i + x_{i+1} S_{i+1} the gradient carried back from the later results. S is a reverse
// linear recurrence, computed by a scan of (A, B) pairs in ceil(log2 n) steps; no division, so zeros are exact.
void rule_cumprod(RuleCall& c) {
  if (!c.needs(0)) return;
  if (!c.is_none(2)) KILN_UNSUPPORTED() << "cumprod with a dtype";
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (sizes.empty()) {
    c.set(0, c.grad());
    return;
  }
  const int64_t dim = normalize_dim(c.int_arg(1), sizes.size());
  const int64_t n = sizes[dim];
  if (n <= 1) {
    c.set(0, c.grad());
    return;
  }
  auto slice = [&](ValueId v, int64_t start, int64_t end) {
    return op(c, "aten::slice", {tensor(v), dim, start, end, int64_t{1}}, "Tensor");
  };
  // v moved `by` places towards the start of dim, the end filled with `fill`.
  auto shift = [&](ValueId v, int64_t by, double fill) {
    std::vector<int64_t> pad(2 * (sizes.size() - static_cast<size_t>(dim)), 0);
    pad.back() = std::min(by, n);
    return op(c, "aten::constant_pad_nd", {tensor(slice(v, std::min(by, n), n)), pad, fill});
  };
  ValueId ones = ones_like(c, slice(c.input(0), 0, 1));
  ValueId before = op(c, "aten::cat", {graph::TensorListArg{{ones, slice(c.result(0), 0, n - 1)}}, dim});
  ValueId a = shift(c.input(0), 1, 1.0), b = c.grad();
  for (int64_t d = 1; d < n; d *= 2) {
    b = c.b.add(b, c.b.mul(a, shift(b, d, 0.0)));
    if (d * 2 < n) a = c.b.mul(a, shift(a, d, 1.0));
  }
  c.set(0, c.b.mul(before, b));
}

}  // namespace

void add_math_rules(std::map<std::string, DerivativeRule>& t) {
  const std::map<std::string, DerivativeRule> math = {
      {"aten::tan.default", {rule_tan}},
      {"aten::sinh.default", {rule_sinh}},
      {"aten::cosh.default", {rule_cosh}},
      {"aten::asin.default", {rule_asin}},
      {"aten::acos.default", {rule_acos}},
      {"aten::atan.default", {rule_atan}},
      {"aten::asinh.default", {rule_asinh}},
      {"aten::acosh.default", {rule_acosh}},
      {"aten::atanh.default", {rule_atanh}},
      {"aten::log2.default", {rule_log2}},
      {"aten::log10.default", {rule_log10}},
      {"aten::exp2.default", {rule_exp2}},
      {"aten::erfc.default", {rule_erfc}},
      {"aten::erfinv.default", {rule_erfinv}},
      {"aten::lgamma.default", {rule_lgamma}},
      {"aten::digamma.default", {rule_digamma}},
      {"aten::polygamma.default", {rule_polygamma}},
      {"aten::mvlgamma.default", {rule_mvlgamma}},
      {"aten::sgn.default", {rule_real_zero_gradient}},
      {"aten::angle.default", {rule_real_zero_gradient}},
      {"aten::round.decimals", {rule_real_zero_gradient}},
      {"aten::frac.default", {rule_pass_through}},
      {"aten::rad2deg.default", {rule_rad2deg}},
      {"aten::deg2rad.default", {rule_deg2rad}},
      {"aten::logit.default", {rule_logit}},
      {"aten::sinc.default", {rule_sinc}},
      {"aten::i0.default", {rule_i0}},
      {"aten::special_i0e.default", {rule_i0e}},
      {"aten::special_ndtri.default", {rule_ndtri}},
      {"aten::special_log_ndtr.default", {rule_log_ndtr}},
      {"aten::special_erfcx.default", {rule_erfcx}},
      {"aten::special_entr.default", {rule_entr}},
      {"aten::nan_to_num.default", {rule_nan_to_num}},
      {"aten::celu.default", {rule_celu}},
      {"aten::softshrink.default", {rule_shrink_or_threshold}},
      {"aten::hardshrink.default", {rule_shrink_or_threshold}},
      {"aten::threshold.default", {rule_shrink_or_threshold}},
      {"aten::frexp.Tensor", {rule_frexp}},
      {"aten::ldexp.Tensor", {rule_ldexp}},
      {"aten::atan2.default", {rule_atan2}},
      {"aten::hypot.default", {rule_hypot}},
      {"aten::fmax.default", {rule_fmax}},
      {"aten::fmin.default", {rule_fmin}},
      {"aten::copysign.Tensor", {rule_copysign}},
      {"aten::logaddexp.default", {rule_logaddexp}},
      {"aten::logaddexp2.default", {rule_logaddexp2}},
      {"aten::xlogy.Tensor", {rule_xlogy}},
      {"aten::special_xlog1py.default", {rule_xlog1py}},
      {"aten::pow.Tensor_Tensor", {rule_pow_tensor_tensor}},
      {"aten::lerp.Scalar", {rule_lerp_scalar}},
      {"aten::lerp.Tensor", {rule_lerp_tensor}},
      {"aten::addcmul.default", {rule_addcmul}},
      {"aten::addcdiv.default", {rule_addcdiv}},
      {"aten::rsub.Tensor", {rule_rsub}},
      {"aten::rsub.Scalar", {rule_rsub}},
      {"aten::remainder.Tensor", {rule_remainder}},
      {"aten::fmod.Tensor", {rule_fmod}},
      {"aten::div.Tensor_mode", {rule_div_mode}},
      {"aten::clamp.Tensor", {rule_clamp_tensor}},
      {"aten::clamp_min.Tensor", {rule_clamp_min_tensor}},
      {"aten::clamp_max.Tensor", {rule_clamp_max_tensor}},
      {"aten::max.default", {rule_evenly_distributed}},
      {"aten::min.default", {rule_evenly_distributed}},
      {"aten::median.default", {rule_evenly_distributed}},
      {"aten::nanmedian.default", {rule_evenly_distributed}},
      {"aten::max.dim", {rule_max_min_dim}},
      {"aten::min.dim", {rule_max_min_dim}},
      {"aten::median.dim", {rule_max_min_dim}},
      {"aten::nanmedian.dim", {rule_max_min_dim}},
      {"aten::mode.default", {rule_max_min_dim}},
      {"aten::kthvalue.default", {rule_kthvalue}},
      {"aten::sort.default", {rule_sort}},
      {"aten::topk.default", {rule_topk}},
      {"aten::cummax.default", {rule_cummax_cummin}},
      {"aten::cummin.default", {rule_cummax_cummin}},
      {"aten::nansum.default", {rule_nansum}},
      {"aten::aminmax.default", {.emit = rule_aminmax, .differentiable_results = 2, .all_results = true}},
      {"aten::var_mean.correction", {.emit = rule_var_mean, .differentiable_results = 2, .all_results = true}},
      {"aten::std_mean.correction", {.emit = rule_std_mean, .differentiable_results = 2, .all_results = true}},
      {"aten::trace.default", {rule_trace}},
      {"aten::logcumsumexp.default", {rule_logcumsumexp}},
      {"aten::cumprod.default", {rule_cumprod}},
      {"aten::linalg_vector_norm.default", {rule_vector_norm}},
      {"aten::norm.ScalarOpt_dim", {rule_norm_dims}},
      {"aten::dist.default", {rule_dist}},
      {"aten::prod.default", {rule_prod}},
      {"aten::prod.dim_int", {rule_prod_dim}},
      {"aten::linalg_cross.default", {rule_cross}},
      {"aten::fill.Scalar", {rule_fill}},
      {"aten::special_i1.default", {rule_i1}},
      {"aten::special_i1e.default", {rule_i1e}},
  };
  t.insert(math.begin(), math.end());
}

}  // namespace kiln::autodiff::detail
