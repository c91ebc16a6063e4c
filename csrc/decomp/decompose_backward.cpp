// The backward part of the ATen -> prims table: the derivative ops autodiff/derivative_rules.cpp emits
// (gelu_backward, tanh_backward, softmax's backward...). As externs each was one more ATen kernel reading and
// writing a whole activation-sized tensor; decomposed, they fuse with the pointwise work and the bias-gradient
// sums around them in the backward graph.
//
// Each builder follows ATen's kernel for the op (its formula and order of operations), so results match eager
// at pointwise tolerance. Half and bfloat16 compute in float and round once when stored.
#include "decomp/decomposition_helpers.h"

namespace kiln::decomp::detail {

namespace {

// All tensor arguments and the output share one floating dtype (softmax's backward with half_to_float reads a
// float gradient for a half input: kept extern).
bool same_floating_dtypes(const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  if (!graph::is_floating_or_complex(t)) return false;
  for (size_t i = 0; i < n.args.size(); ++i) {
    const auto* m = tensor_arg_meta(g, n, static_cast<int>(i));
    if (m && m->dtype != t) return false;
  }
  return true;
}

// grad_input = grad * (cdf(x) + x * pdf(x)), or the tanh form's derivative (ATen's GeluBackward kernels).
void build_gelu_backward(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = compute_dtype(g, n);
  Prim dy = arg_as(b, 0, t);
  Prim x = arg_as(b, 1, t);
  auto c = [&](double v) { return b.constant(v, t); };
  const bool tanh_form = n.args.size() > 2 && std::holds_alternative<std::string>(n.args[2]) &&
                         std::get<std::string>(n.args[2]) == "tanh";
  Prim derivative;
  if (tanh_form) {
    const double beta = 1.4142135623730951 * 1.1283791670955126 * 0.5;  // sqrt(2) * 2/sqrt(pi) * 0.5
    const double kappa = 0.044715;
    Prim x_sq = b.binary(PrimOp::Mul, x, x);
    Prim x_cube = b.binary(PrimOp::Mul, x_sq, x);
    Prim inner = b.binary(PrimOp::Mul, c(beta), b.binary(PrimOp::Add, x, b.binary(PrimOp::Mul, c(kappa), x_cube)));
    Prim tanh_inner = b.unary(PrimOp::Tanh, inner);
    Prim left = b.binary(PrimOp::Mul, c(0.5), x);
    Prim left_derivative = b.binary(PrimOp::Mul, c(0.5), b.binary(PrimOp::Add, c(1), tanh_inner));
    Prim right_derivative = b.binary(PrimOp::Sub, c(1), b.binary(PrimOp::Mul, tanh_inner, tanh_inner));
    Prim inner_derivative =
        b.binary(PrimOp::Mul, c(beta), b.binary(PrimOp::Add, c(1), b.binary(PrimOp::Mul, c(3 * kappa), x_sq)));
    derivative = b.binary(PrimOp::Add, left_derivative,
                          b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, left, right_derivative), inner_derivative));
  } else {
    const double alpha = 0.7071067811865476;                       // 1/sqrt(2)
    const double beta = 1.1283791670955126 * 0.7071067811865476 * 0.5;  // 2/sqrt(pi) * 1/sqrt(2) * 0.5
    Prim cdf = b.binary(PrimOp::Mul, c(0.5), b.binary(PrimOp::Add, c(1), b.unary(PrimOp::Erf, b.binary(PrimOp::Mul, x, c(alpha)))));
    Prim pdf = b.binary(PrimOp::Mul, c(beta), b.unary(PrimOp::Exp, b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, x, x), c(-0.5))));
    derivative = b.binary(PrimOp::Add, cdf, b.binary(PrimOp::Mul, x, pdf));
  }
  b.set_output(0, b.binary(PrimOp::Mul, dy, derivative));
}

bool gelu_backward_supported(const Graph& g, const Node& n) {
  if (!same_floating_dtypes(g, n)) return false;
  if (n.args.size() < 3 || !std::holds_alternative<std::string>(n.args[2])) return n.args.size() < 3;
  const std::string& approximate = std::get<std::string>(n.args[2]);
  return approximate == "none" || approximate == "tanh";
}

// _softmax_backward_data(grad_output, output, dim, input_dtype) = output * (grad - sum(grad * output, dim)).
void build_softmax_backward(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = compute_dtype(g, n);
  Prim dy = arg_as(b, 0, t);
  Prim y = arg_as(b, 1, t);
  Prim total = b.reduce(ReduceOp::Sum, b.binary(PrimOp::Mul, dy, y));
  b.set_output(0, b.binary(PrimOp::Mul, y, b.binary(PrimOp::Sub, dy, total)));
}

// _log_softmax_backward_data(grad_output, output, dim, input_dtype) = grad - exp(output) * sum(grad, dim).
void build_log_softmax_backward(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = compute_dtype(g, n);
  Prim dy = arg_as(b, 0, t);
  Prim y = arg_as(b, 1, t);
  Prim total = b.reduce(ReduceOp::Sum, dy);
  b.set_output(0, b.binary(PrimOp::Sub, dy, b.binary(PrimOp::Mul, b.unary(PrimOp::Exp, y), total)));
}

}  // namespace

// The pointwise entries are pointwise2 builders: f(grad, self-or-result) in the compute dtype.
void add_backward_decompositions(std::map<std::string, Decomposition>& t) {
  auto pointwise = [&](const std::string& name, Builder build, decltype(Decomposition::supports) ok) {
    t[name] = Decomposition{std::move(ok), nullptr, std::move(build), 1};
  };
  // relu's backward: threshold_backward(grad, self, threshold) = self <= threshold ? 0 : grad.
  pointwise("aten::threshold_backward.default", pointwise2([](PrimBuilder& b, const Node& n, Prim dy, Prim x, ScalarType t) {
              return select(b, b.binary(PrimOp::Le, x, number(b, n, 2, t)), b.constant(0, t), dy);
            }), same_floating_dtypes);
  // tanh_backward(grad, output) = grad * (1 - y * y)
  pointwise("aten::tanh_backward.default", pointwise2([](PrimBuilder& b, const Node&, Prim dy, Prim y, ScalarType t) {
              return b.binary(PrimOp::Mul, dy, b.binary(PrimOp::Sub, b.constant(1, t), b.binary(PrimOp::Mul, y, y)));
            }), same_floating_dtypes);
  // sigmoid_backward(grad, output) = grad * (1 - y) * y
  pointwise("aten::sigmoid_backward.default", pointwise2([](PrimBuilder& b, const Node&, Prim dy, Prim y, ScalarType t) {
              return b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, dy, b.binary(PrimOp::Sub, b.constant(1, t), y)), y);
            }), same_floating_dtypes);
  // silu_backward(grad, self) = grad * s * (1 + x * (1 - s)), s = sigmoid(x)
  pointwise("aten::silu_backward.default", pointwise2([](PrimBuilder& b, const Node&, Prim dy, Prim x, ScalarType t) {
              Prim s = b.unary(PrimOp::Sigmoid, x);
              Prim one = b.constant(1, t);
              Prim factor = b.binary(PrimOp::Add, one, b.binary(PrimOp::Mul, x, b.binary(PrimOp::Sub, one, s)));
              return b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, dy, s), factor);
            }), same_floating_dtypes);
  // hardtanh_backward(grad, self, min, max) = (x <= min || x >= max) ? 0 : grad
  pointwise("aten::hardtanh_backward.default", pointwise2([](PrimBuilder& b, const Node& n, Prim dy, Prim x, ScalarType t) {
              Prim outside = b.binary(PrimOp::LogicalOr, b.binary(PrimOp::Le, x, number(b, n, 2, t)),
                                      b.binary(PrimOp::Ge, x, number(b, n, 3, t)));
              return select(b, outside, b.constant(0, t), dy);
            }), same_floating_dtypes);
  // leaky_relu_backward(grad, self, negative_slope, self_is_result) = x > 0 ? grad : grad * slope
  pointwise("aten::leaky_relu_backward.default", pointwise2([](PrimBuilder& b, const Node& n, Prim dy, Prim x, ScalarType t) {
              return select(b, b.binary(PrimOp::Gt, x, b.constant(0, t)), dy, b.binary(PrimOp::Mul, dy, number(b, n, 2, t)));
            }), same_floating_dtypes);
  pointwise("aten::gelu_backward.default", build_gelu_backward, gelu_backward_supported);
  // native_dropout_backward(grad, mask, scale) = grad * mask * scale (the mask is bool)
  pointwise("aten::native_dropout_backward.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
              const ScalarType t = compute_dtype(g, n);
              Prim scaled = b.binary(PrimOp::Mul, arg_as(b, 0, t), arg_as(b, 1, t));
              b.set_output(0, b.binary(PrimOp::Mul, scaled, number(b, n, 2, t)));
            }, is_floating_output);
  auto dim_arg = [](const Graph& g, const Node& n) { return dims_from_arg(g, n, 2, false); };
  t["aten::_softmax_backward_data.default"] = Decomposition{same_floating_dtypes, dim_arg, build_softmax_backward, 1};
  // float32/float64 only: in bfloat16 ATen's CPU kernel rounds exp(output) before the product, which this
  // formula (all in float, rounded once) does not (the derivative-op test found a 1-ulp difference).
  auto full_precision = [](const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    return same_floating_dtypes(g, n) && (t == ScalarType::Float || t == ScalarType::Double);
  };
  t["aten::_log_softmax_backward_data.default"] = Decomposition{full_precision, dim_arg, build_log_softmax_backward, 1};
}

}  // namespace kiln::decomp::detail
