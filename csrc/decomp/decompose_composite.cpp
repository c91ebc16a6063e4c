// The composite part of the ATen -> prims table: ops that ATen runs as one kernel but whose formula is a few
// existing prims (logaddexp, sinc, entr, rounding divisions, round(decimals), ldexp), fills and factories
// (a constant stored over the output), reductions built on the same prims (count_nonzero, nansum, aminmax,
// vector norms, dist) and the pointwise losses (mse, huber, smooth_l1, soft_margin) with their reduction.
//
// As in decompose_math.cpp each builder follows ATen's CPU kernel for the op, in the same order of operations.
// Where ATen rounds an intermediate to a 16-bit dtype and a float computation could round differently enough to
// show (trunc or floor of a quotient, round to decimals), the entry is limited to float and double.
#include <cmath>

#include "decomp/decomposition_helpers.h"

namespace kiln::decomp::detail {

namespace {

using Supports = decltype(Decomposition::supports);

bool float_or_double_output(const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  return t == ScalarType::Float || t == ScalarType::Double;
}

// The tensors of arguments 0 and 1 have the same sizes: reductions index their operands by argument 0's
// shape, so a broadcast operand would be read out of bounds.
bool same_shape_operands(const Graph& g, const Node& n) {
  const auto* a = tensor_arg_meta(g, n, 0);
  const auto* b = tensor_arg_meta(g, n, 1);
  return a && b && a->sizes == b->sizes && is_floating_output(g, n);
}

// A constant over the output: exact for floating outputs, and for integers while the double holding it is.
Builder fill_with(std::function<double(const Node&)> value) {
  return [value](PrimBuilder& b, const Graph& g, const Node& n) { b.set_output(0, b.constant(value(n), out_meta(g, n).dtype)); };
}

// The scheduler places a node's tensor arguments over its output's loop, though a fill reads none of them: a tensor
// argument that does not broadcast to the output (new_zeros(grad of [2, 12, 64], [32, 64]), as index's gradient
// makes) leaves the fill to its extern call.
Supports fill_supported(std::function<double(const Node&)> value) {
  return [value](const Graph& g, const Node& n) {
    const std::vector<int64_t>& out = out_meta(g, n).sizes;
    for (const graph::ArgValue& arg : n.args) {
      const auto* t = std::get_if<graph::TensorArg>(&arg);
      if (!t) continue;
      const std::vector<int64_t>& in = g.value(t->id).meta.sizes;
      if (in.size() > out.size()) return false;
      for (size_t d = 0; d < in.size(); ++d)
        if (in[in.size() - 1 - d] != 1 && in[in.size() - 1 - d] != out[out.size() - 1 - d]) return false;
    }
    const double v = value(n);
    return graph::is_floating_or_complex(out_meta(g, n).dtype) || (std::isfinite(v) && std::fabs(v) <= 9007199254740992.0);
  };
}

std::function<double(const Node&)> number_at(int arg) { return [arg](const Node& n) { return number_arg(n, arg); }; }
std::function<double(const Node&)> always(double v) { return [v](const Node&) { return v; }; }

// logaddexp / logaddexp2: max + log1p(base^-|a - b|) (scaled by 1/ln 2 for base 2); equal infinities give themselves.
Builder log_add_exp(bool base2) {
  return pointwise2([base2](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
    Prim power = b.unary(base2 ? PrimOp::Exp2 : PrimOp::Exp, b.unary(PrimOp::Neg, b.unary(PrimOp::Abs, b.binary(PrimOp::Sub, x, y))));
    Prim tail = b.unary(PrimOp::Log1p, power);
    if (base2) tail = b.binary(PrimOp::Mul, tail, b.constant(1.0 / std::log(2.0), t));
    Prim sum = b.binary(PrimOp::Add, b.binary(PrimOp::Maximum, x, y), tail);
    Prim equal_infinities = b.binary(PrimOp::LogicalAnd, b.binary(PrimOp::Eq, b.unary(PrimOp::Abs, x), b.constant(INFINITY, t)),
                                     b.binary(PrimOp::Eq, x, y));
    return select(b, equal_infinities, x, sum);
  });
}

// a / b rounded by `mode` ("trunc", "floor"; anything else: true division). Floor follows c10's
// div_floor_floating: the quotient of a - fmod(a, b), moved down when fmod's sign differs from b's, rounded to the
// nearest whole number, zero signed as a / b; a zero divisor gives IEEE's a / b.
Prim rounded_quotient(PrimBuilder& b, Prim x, Prim y, ScalarType t, const std::string& mode) {
  Prim quotient = b.binary(PrimOp::Div, x, y);
  if (mode == "trunc") return b.unary(PrimOp::Trunc, quotient);
  if (mode != "floor") return quotient;
  Prim zero = b.constant(0, t), one = b.constant(1, t);
  Prim mod = b.binary(PrimOp::Fmod, x, y);
  Prim div = b.binary(PrimOp::Div, b.binary(PrimOp::Sub, x, mod), y);
  Prim signs_differ = b.binary(PrimOp::Ne, b.binary(PrimOp::Lt, y, zero), b.binary(PrimOp::Lt, mod, zero));
  div = select(b, b.binary(PrimOp::LogicalAnd, b.binary(PrimOp::Ne, mod, zero), signs_differ), b.binary(PrimOp::Sub, div, one), div);
  Prim floor = b.unary(PrimOp::Floor, div);
  floor = select(b, b.binary(PrimOp::Gt, b.binary(PrimOp::Sub, div, floor), b.constant(0.5, t)), b.binary(PrimOp::Add, floor, one), floor);
  Prim result = select(b, b.binary(PrimOp::Ne, div, zero), floor, b.binary(PrimOp::Copysign, zero, quotient));
  return select(b, b.binary(PrimOp::Eq, y, zero), quotient, result);
}

std::string rounding_mode(const Node& n, int arg) {
  if (static_cast<int>(n.args.size()) <= arg) return "";
  if (auto* s = std::get_if<std::string>(&n.args[arg])) return *s;
  return "";
}

// ---- reductions -------------------------------------------------------------------------------------------
std::vector<int64_t> dims_of(const Graph& g, const Node& n, int arg) { return dims_from_arg(g, n, arg, true); }

// The vector p-norm of `x` (already |x| or not) over the reduced dims, as ATen's linalg_vector_norm: inf and
// -inf are max and min of |x|, 0 counts the nonzeros, 1 and 2 are a plain sum and a root of squares.
Prim vector_norm(PrimBuilder& b, Prim x, double p, ScalarType t) {
  Prim magnitude = b.unary(PrimOp::Abs, x);
  if (std::isinf(p)) return b.reduce(p > 0 ? ReduceOp::Max : ReduceOp::Min, magnitude);
  if (p == 0) return b.reduce(ReduceOp::Sum, b.cast(b.binary(PrimOp::Ne, x, b.constant(0, t)), t));
  if (p == 1) return b.reduce(ReduceOp::Sum, magnitude);
  if (p == 2) return b.unary(PrimOp::Sqrt, b.reduce(ReduceOp::Sum, b.binary(PrimOp::Mul, x, x)));
  Prim total = b.reduce(ReduceOp::Sum, b.binary(PrimOp::Pow, magnitude, b.constant(p, t)));
  return b.binary(PrimOp::Pow, total, b.constant(1.0 / p, t));
}

// log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|)), ATen's CPU kernel; exp(-|x|) is the buffer it also returns.
Prim log_sigmoid(PrimBuilder& b, Prim x, ScalarType t, Prim* buffer = nullptr) {
  Prim e = b.unary(PrimOp::Exp, b.unary(PrimOp::Neg, b.unary(PrimOp::Abs, x)));
  if (buffer) *buffer = e;
  return b.binary(PrimOp::Sub, b.binary(PrimOp::Minimum, x, b.constant(0, t)), b.unary(PrimOp::Log1p, e));
}

// Pointwise losses: loss(input, target) then the `reduction` argument (0 none, 1 mean, 2 sum), which is
// argument 2 of most losses and 4 of binary_cross_entropy_with_logits.
int reduction_arg(const Node& n) { return n.op == "aten::binary_cross_entropy_with_logits" ? 4 : 2; }
bool reduces(const Node& n) { return number_arg(n, reduction_arg(n)) != 0; }

Builder loss(std::function<Prim(PrimBuilder&, const Node&, Prim, Prim, ScalarType)> f) {
  return [f](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    Prim value = f(b, n, arg_as(b, 0, t), arg_as(b, 1, t), t);
    if (reduces(n)) {
      value = b.reduce(ReduceOp::Sum, value);
      if (number_arg(n, reduction_arg(n)) == 1) value = b.binary(PrimOp::Div, value, b.constant(static_cast<double>(b.reduction_size()), t));
    }
    b.set_output(0, value);
  };
}

std::vector<int64_t> loss_dims(const Graph& g, const Node& n) {
  if (!reduces(n)) return {};
  return normalise_dims({}, static_cast<int64_t>(tensor_arg_meta(g, n, 0)->sizes.size()), true);
}

}  // namespace

void add_composite_decompositions(std::map<std::string, Decomposition>& t) {
  auto pointwise = [&](const std::string& name, Builder build, Supports ok) {
    t[name] = Decomposition{std::move(ok), nullptr, std::move(build), 1};
  };
  auto reducing = [&](const std::string& name, Builder build, decltype(Decomposition::reduction_dims) dims, Supports ok,
                      int outputs = 1) { t[name] = Decomposition{std::move(ok), std::move(dims), std::move(build), outputs}; };

  pointwise("aten::logaddexp.default", log_add_exp(false), is_floating_output);
  pointwise("aten::logaddexp2.default", log_add_exp(true), is_floating_output);
  pointwise("aten::celu.default", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              // ATen: elu(x, alpha, scale 1, input_scale 1 / alpha)
              const double alpha = n.args.size() > 1 && is_number(n, 1) ? number_arg(n, 1) : 1.0;
              Prim negative = b.binary(PrimOp::Mul, b.unary(PrimOp::Expm1, b.binary(PrimOp::Mul, x, b.constant(1.0 / alpha, t))),
                                       b.constant(alpha, t));
              return select(b, b.binary(PrimOp::Le, x, b.constant(0, t)), negative, x);
            }), is_floating_output);
  pointwise("aten::sinc.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
              Prim product = b.binary(PrimOp::Mul, b.constant(kPi, t), x);
              Prim ratio = b.binary(PrimOp::Div, b.unary(PrimOp::Sin, product), product);
              return select(b, b.binary(PrimOp::Eq, x, b.constant(0, t)), b.constant(1, t), ratio);
            }), is_floating_output);
  pointwise("aten::special_entr.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
              Prim zero = b.constant(0, t);
              Prim negative = select(b, b.binary(PrimOp::Eq, x, zero), zero, b.constant(-INFINITY, t));
              Prim positive = b.binary(PrimOp::Mul, b.unary(PrimOp::Neg, x), b.unary(PrimOp::Log, x));
              return select(b, b.binary(PrimOp::Ne, x, x), x, select(b, b.binary(PrimOp::Gt, x, zero), positive, negative));
            }), is_floating_output);
  for (const char* name : {"aten::special_xlog1py.default", "aten::special_xlog1py.self_scalar", "aten::special_xlog1py.other_scalar"})
    pointwise(name, pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
                Prim product = select(b, b.binary(PrimOp::Eq, x, b.constant(0, t)), b.constant(0, t),
                                      b.binary(PrimOp::Mul, x, b.unary(PrimOp::Log1p, y)));
                return select(b, b.binary(PrimOp::Ne, y, y), b.constant(NAN, t), product);
              }), is_floating_output);
  pointwise("aten::angle.default", pointwise1([](PrimBuilder& b, const Node&, Prim x, ScalarType t) {
              Prim angle = select(b, b.binary(PrimOp::Lt, x, b.constant(0, t)), b.constant(kPi, t), b.constant(0, t));
              return select(b, b.binary(PrimOp::Ne, x, x), x, angle);
            }), [](const Graph& g, const Node& n) {
              const auto* in = tensor_arg_meta(g, n, 0);
              return in && in->dtype != ScalarType::Bool && is_floating_output(g, n);
            });
  for (const char* name : {"aten::pow.Tensor_Tensor", "aten::pow.Scalar"})
    pointwise(name, pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) { return b.binary(PrimOp::Pow, x, y); }),
              is_floating_output);
  pointwise("aten::ldexp.Tensor", pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim e, ScalarType t) {
              return b.binary(PrimOp::Mul, x, b.binary(PrimOp::Pow, b.constant(2, t), e));  // ATen: self * pow(2, other)
            }), is_floating_output);
  pointwise("aten::round.decimals", pointwise1([](PrimBuilder& b, const Node& n, Prim x, ScalarType t) {
              const double decimals = number_arg(n, 1);
              Prim scale = b.constant(std::pow(10.0, std::fabs(decimals)), t);
              if (decimals < 0) return b.binary(PrimOp::Mul, b.unary(PrimOp::Round, b.binary(PrimOp::Div, x, scale)), scale);
              return b.binary(PrimOp::Div, b.unary(PrimOp::Round, b.binary(PrimOp::Mul, x, scale)), scale);
            }), float_or_double_output);
  for (const char* name : {"aten::div.Tensor_mode", "aten::div.Scalar_mode"})
    pointwise(name, pointwise2([](PrimBuilder& b, const Node& n, Prim x, Prim y, ScalarType t) {
                return rounded_quotient(b, x, y, t, rounding_mode(n, 2));
              }), float_or_double_output);
  for (const char* name : {"aten::floor_divide.default", "aten::floor_divide.Scalar"})
    pointwise(name, pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
                return rounded_quotient(b, x, y, t, "floor");
              }), float_or_double_output);
  // nextafter steps to the neighbouring value of the dtype itself: a 16-bit dtype computed in float would not.
  pointwise("aten::nextafter.default", pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) {
              return b.binary(PrimOp::Nextafter, x, y);
            }), float_or_double_output);
  pointwise("aten::polygamma.default", [](PrimBuilder& b, const Graph& g, const Node& n) {  // order 0 is digamma
    b.set_output(0, b.unary(PrimOp::Digamma, arg_as(b, 1, compute_dtype(g, n))));
  }, [](const Graph& g, const Node& n) { return is_number(n, 0) && number_arg(n, 0) == 0 && is_floating_output(g, n); });
  pointwise("aten::_prelu_kernel.default", pointwise2([](PrimBuilder& b, const Node&, Prim x, Prim w, ScalarType t) {
              return select(b, b.binary(PrimOp::Gt, x, b.constant(0, t)), x, b.binary(PrimOp::Mul, w, x));
            }), is_floating_output);

  // Fills and factories: the output's meta already names sizes, strides and dtype.
  const std::pair<const char*, std::function<double(const Node&)>> fills[] = {
      {"aten::fill.Scalar", number_at(1)},     {"aten::full_like.default", number_at(1)}, {"aten::full.default", number_at(1)},
      {"aten::new_full.default", number_at(2)}, {"aten::ones_like.default", always(1)},   {"aten::zeros_like.default", always(0)},
      {"aten::ones.default", always(1)},       {"aten::zeros.default", always(0)},       {"aten::new_ones.default", always(1)},
      {"aten::new_zeros.default", always(0)}};
  for (const auto& [name, value] : fills) pointwise(name, fill_with(value), fill_supported(value));
  pointwise("aten::fill.Tensor", [](PrimBuilder& b, const Graph& g, const Node& n) { b.set_output(0, arg_as(b, 1, out_meta(g, n).dtype)); },
            nullptr);

  // Reductions.
  auto dims_at = [](int arg) { return [arg](const Graph& g, const Node& n) { return dims_of(g, n, arg); }; };
  for (const char* name : {"aten::count_nonzero.default", "aten::count_nonzero.dim_IntList"})
    reducing(name, [](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = opmath(tensor_arg_meta(g, n, 0)->dtype);
      Prim x = arg_as(b, 0, t);
      b.set_output(0, b.reduce(ReduceOp::Sum, b.cast(b.binary(PrimOp::Ne, x, b.constant(0, t)), ScalarType::Long)));
    }, dims_at(1), nullptr);
  reducing("aten::nansum.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    Prim x = arg_as(b, 0, t);
    b.set_output(0, b.reduce(ReduceOp::Sum, select(b, b.binary(PrimOp::Ne, x, x), b.constant(0, t), x)));
  }, dims_at(1), is_floating_output);
  reducing("aten::aminmax.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    Prim x = arg_as(b, 0, out_meta(g, n).dtype);
    b.set_output(0, b.reduce(ReduceOp::Min, x));
    b.set_output(1, b.reduce(ReduceOp::Max, x));
  }, dims_at(1), not_bool_output, 2);
  reducing("aten::linalg_vector_norm.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    b.set_output(0, vector_norm(b, arg_as(b, 0, t), number_arg(n, 1), t));
  }, dims_at(2), [](const Graph& g, const Node& n) { return is_number(n, 1) && is_floating_output(g, n); });
  reducing("aten::dist.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    b.set_output(0, vector_norm(b, b.binary(PrimOp::Sub, arg_as(b, 0, t), arg_as(b, 1, t)), number_arg(n, 2), t));
  }, dims_at(-1), [](const Graph& g, const Node& n) { return is_number(n, 2) && same_shape_operands(g, n); });

  for (const auto& [name, op] : {std::pair<const char*, ReduceOp>{"aten::max.default", ReduceOp::Max}, {"aten::min.default", ReduceOp::Min}})
    reducing(name, [op = op](PrimBuilder& b, const Graph& g, const Node& n) {
      b.set_output(0, b.reduce(op, arg_as(b, 0, out_meta(g, n).dtype)));
    }, dims_at(-1), not_bool_output);

  // log_sigmoid_forward's buffer: exp(-|x|) on CPU; CUDA's is empty, while the meta gives the CPU shape.
  t["aten::log_sigmoid_forward.default"] = Decomposition{
      [](const Graph& g, const Node& n) {
        return is_floating_output(g, n) && (out_meta(g, n).device.type == graph::DeviceType::CPU || !graph::is_read(g, n.outputs[1]));
      },
      nullptr,
      [](PrimBuilder& b, const Graph& g, const Node& n) {
        const ScalarType t = compute_dtype(g, n);
        Prim buffer;
        b.set_output(0, log_sigmoid(b, arg_as(b, 0, t), t, &buffer));
        b.set_output(1, buffer);
      },
      2};

  // Losses (ATen's CPU formulas), reduced as their `reduction` argument says.
  auto losses = [&](const char* name, std::function<Prim(PrimBuilder&, const Node&, Prim, Prim, ScalarType)> f) {
    reducing(name, loss(std::move(f)), loss_dims, [](const Graph& g, const Node& n) {
      const int reduction = reduction_arg(n);
      for (int optional = 2; optional < reduction; ++optional)  // weights: not modelled
        if (!is_none(n, optional)) return false;
      return static_cast<int>(n.args.size()) > reduction && is_number(n, reduction) && same_shape_operands(g, n);
    });
  };
  // ATen: (1 - target) * input - log_sigmoid(input), without weights.
  losses("aten::binary_cross_entropy_with_logits.default", [](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType t) {
    return b.binary(PrimOp::Sub, b.binary(PrimOp::Mul, b.binary(PrimOp::Sub, b.constant(1, t), y), x), log_sigmoid(b, x, t));
  });
  losses("aten::mse_loss.default", [](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) {
    Prim d = b.binary(PrimOp::Sub, x, y);
    return b.binary(PrimOp::Mul, d, d);
  });
  losses("aten::huber_loss.default", [](PrimBuilder& b, const Node& n, Prim x, Prim y, ScalarType t) {
    const double delta = n.args.size() > 3 ? number_arg(n, 3) : 1.0;
    Prim z = b.unary(PrimOp::Abs, b.binary(PrimOp::Sub, x, y));
    Prim quadratic = b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, b.constant(0.5, t), z), z);
    Prim linear = b.binary(PrimOp::Mul, b.constant(delta, t), b.binary(PrimOp::Sub, z, b.constant(0.5 * delta, t)));
    return select(b, b.binary(PrimOp::Lt, z, b.constant(delta, t)), quadratic, linear);
  });
  losses("aten::smooth_l1_loss.default", [](PrimBuilder& b, const Node& n, Prim x, Prim y, ScalarType t) {
    const double beta = n.args.size() > 3 ? number_arg(n, 3) : 1.0;
    Prim z = b.unary(PrimOp::Abs, b.binary(PrimOp::Sub, x, y));
    if (beta == 0) return z;  // ATen: l1_loss
    Prim quadratic = b.binary(PrimOp::Div, b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, b.constant(0.5, t), z), z), b.constant(beta, t));
    return select(b, b.binary(PrimOp::Lt, z, b.constant(beta, t)), quadratic, b.binary(PrimOp::Sub, z, b.constant(0.5 * beta, t)));
  });
  losses("aten::soft_margin_loss.default", [](PrimBuilder& b, const Node&, Prim x, Prim y, ScalarType) {
    return b.unary(PrimOp::Log1p, b.unary(PrimOp::Exp, b.binary(PrimOp::Mul, b.unary(PrimOp::Neg, x), y)));
  });
}

}  // namespace kiln::decomp::detail
