// The ATen -> prims table. Each entry is a small builder; arithmetic casts its operands to the output dtype
// first (PyTorch computes pointwise ops in the promoted dtype, which the meta already names), comparisons to
// the promoted dtype of their operands. Reductions declare their reduced dims so the scheduler can pick the
// kernel's iteration space before the builder runs.
#include "decomp/decompositions.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "decomp/decomposition_helpers.h"
#include "graph/op_facts.h"

namespace kiln::decomp {

using namespace detail;
using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::ScalarType;

bool is_codegen_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: case ScalarType::Byte: case ScalarType::Char: case ScalarType::Short:
    case ScalarType::Int: case ScalarType::Long: case ScalarType::Half: case ScalarType::BFloat16:
    case ScalarType::Float: case ScalarType::Double:
      return true;
    default:
      return false;
  }
}

namespace {

int dtype_rank(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: return 0;
    case ScalarType::Byte: case ScalarType::Char: return 1;
    case ScalarType::Short: return 2;
    case ScalarType::Int: return 3;
    case ScalarType::Long: return 4;
    case ScalarType::Half: case ScalarType::BFloat16: return 5;
    case ScalarType::Float: return 6;
    default: return 7;
  }
}

}  // namespace

ScalarType promote_types(ScalarType a, ScalarType b) {
  if (a == b) return a;
  if ((a == ScalarType::Half && b == ScalarType::BFloat16) || (a == ScalarType::BFloat16 && b == ScalarType::Half))
    return ScalarType::Float;
  if ((a == ScalarType::Byte && b == ScalarType::Char) || (a == ScalarType::Char && b == ScalarType::Byte))
    return ScalarType::Short;
  return dtype_rank(a) >= dtype_rank(b) ? a : b;
}

namespace {

void build_relu(PrimBuilder& b, const Graph& g, const Node& n) {
  Prim x = arg_as(b, 0, out_meta(g, n).dtype);
  b.set_output(0, b.binary(PrimOp::Maximum, x, constant_like(b, 0, x)));
}

void build_gelu(PrimBuilder& b, const Graph& g, const Node& n) {
  Prim x = arg_as(b, 0, out_meta(g, n).dtype);
  const bool tanh_form = n.args.size() > 1 && std::holds_alternative<std::string>(n.args[1]) &&
                         std::get<std::string>(n.args[1]) == "tanh";
  auto c = [&](double v) { return constant_like(b, v, x); };
  Prim inner;
  if (tanh_form) {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    Prim x3 = b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, x, x), x);
    Prim poly = b.binary(PrimOp::Add, x, b.binary(PrimOp::Mul, c(0.044715), x3));
    inner = b.unary(PrimOp::Tanh, b.binary(PrimOp::Mul, c(0.7978845608028654), poly));
  } else {  // 0.5 x (1 + erf(x / sqrt 2))
    inner = b.unary(PrimOp::Erf, b.binary(PrimOp::Mul, x, c(0.7071067811865476)));
  }
  Prim half_x = b.binary(PrimOp::Mul, x, c(0.5));
  b.set_output(0, b.binary(PrimOp::Mul, half_x, b.binary(PrimOp::Add, c(1.0), inner)));
}

void build_silu(PrimBuilder& b, const Graph& g, const Node& n) {
  Prim x = arg_as(b, 0, out_meta(g, n).dtype);
  b.set_output(0, b.binary(PrimOp::Mul, x, b.unary(PrimOp::Sigmoid, x)));
}

void build_pow_scalar(PrimBuilder& b, const Graph& g, const Node& n) {
  Prim x = arg_as(b, 0, out_meta(g, n).dtype);
  const double e = number_arg(n, 1);
  Prim result;
  if (e == 1.0) result = x;
  else if (e == 2.0) result = b.binary(PrimOp::Mul, x, x);
  else if (e == 3.0) result = b.binary(PrimOp::Mul, b.binary(PrimOp::Mul, x, x), x);
  else if (e == 0.5) result = b.unary(PrimOp::Sqrt, x);
  else if (e == -0.5) result = b.unary(PrimOp::Rsqrt, x);
  else if (e == -1.0) result = b.binary(PrimOp::Div, constant_like(b, 1, x), x);
  else result = b.binary(PrimOp::Pow, x, constant_like(b, e, x));
  b.set_output(0, result);
}

bool pow_supported(const Graph& g, const Node& n) {
  if (graph::is_floating_or_complex(out_meta(g, n).dtype)) return true;
  const double e = number_arg(n, 1);  // integers: only exact small powers, never std::pow's doubles
  return e == 1.0 || e == 2.0 || e == 3.0;
}


void build_where(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  b.set_output(0, b.where(arg_as(b, 0, ScalarType::Bool), arg_as(b, 1, t), arg_as(b, 2, t)));
}

void build_cast(PrimBuilder& b, const Graph& g, const Node& n) { b.set_output(0, arg_as(b, 0, out_meta(g, n).dtype)); }

bool to_copy_supported(const Graph& g, const Node& n) {
  const auto* in = tensor_arg_meta(g, n, 0);
  return in && in->device == out_meta(g, n).device;
}

// ---- reductions ----------------------------------------------------------------------------------------

Builder reduction(ReduceOp op, bool mean) {
  return [op, mean](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    Prim r = b.reduce(op, arg_as(b, 0, t));
    if (mean) r = b.binary(PrimOp::Div, r, b.constant(static_cast<double>(b.reduction_size()), t));
    b.set_output(0, r);
  };
}

// softmax(x) = exp(x - max) * (1 / sum(exp(x - max))); log_softmax(x) = (x - max) - log(sum(exp(x - max))).
// The reciprocal is taken once per row (it depends only on the outer loops) and multiplied in, as ATen's
// CPU kernel does: a multiply per element instead of a divide.
Builder softmax(bool log) {
  return [log](PrimBuilder& b, const Graph& g, const Node& n) {
    Prim x = arg_as(b, 0, out_meta(g, n).dtype);
    Prim shifted = b.binary(PrimOp::Sub, x, b.reduce(ReduceOp::Max, x));
    Prim e = b.unary(PrimOp::Exp, shifted);
    Prim total = b.reduce(ReduceOp::Sum, e);
    if (log) {
      b.set_output(0, b.binary(PrimOp::Sub, shifted, b.unary(PrimOp::Log, total)));
      return;
    }
    Prim inverse = b.binary(PrimOp::Div, b.constant(1.0, out_meta(g, n).dtype), total);
    b.set_output(0, b.binary(PrimOp::Mul, e, inverse));
  };
}

bool softmax_supported(const Graph& g, const Node& n) {
  // _softmax(half_to_float=True) writes float from half: the meta's dtype covers it, but keep it extern
  // until tested; softmax.int(dtype) is fine (the output dtype names the compute dtype).
  if (auto* flag = std::get_if<bool>(&n.args[2])) return !*flag;
  return graph::is_floating_or_complex(out_meta(g, n).dtype);
}

void build_layer_norm(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  const ScalarType stat_t = out_meta(g, n, 1).dtype;  // float for half/bfloat16 inputs
  const ScalarType compute = promote_types(t, stat_t);
  Prim x = arg_as(b, 0, compute);
  Prim count = b.constant(static_cast<double>(b.reduction_size()), compute);
  Prim mean = b.binary(PrimOp::Div, b.reduce(ReduceOp::Sum, x), count);
  Prim centred = b.binary(PrimOp::Sub, x, mean);
  Prim var = b.binary(PrimOp::Div, b.reduce(ReduceOp::Sum, b.binary(PrimOp::Mul, centred, centred)), count);
  Prim rstd = b.unary(PrimOp::Rsqrt, b.binary(PrimOp::Add, var, b.constant(number_arg(n, 4), compute)));
  Prim y = b.binary(PrimOp::Mul, centred, rstd);
  if (!is_none(n, 2)) y = b.binary(PrimOp::Mul, y, arg_as(b, 2, compute));
  if (!is_none(n, 3)) y = b.binary(PrimOp::Add, y, arg_as(b, 3, compute));
  b.set_output(0, b.cast(y, t));
  b.set_output(1, b.cast(mean, stat_t));
  b.set_output(2, b.cast(rstd, stat_t));
}

// On CPU, ATen's layer norm returns mean and rstd in the input's dtype, while the meta (CUDA's rule) says float
// for half/bfloat16: such a call is decomposed only when nothing reads those two outputs (found by the sweep).
bool layer_norm_supported(const Graph& g, const Node& n) {
  if (!is_floating_output(g, n)) return false;
  if (out_meta(g, n, 1).dtype == out_meta(g, n).dtype || out_meta(g, n).device.type != graph::DeviceType::CPU) return true;
  return !graph::is_read(g, n.outputs[1]) && !graph::is_read(g, n.outputs[2]);
}

std::vector<int64_t> layer_norm_dims(const Graph& g, const Node& n) {
  const int64_t rank = static_cast<int64_t>(tensor_arg_meta(g, n, 0)->sizes.size());
  const int64_t k = static_cast<int64_t>(int_list_arg(n, 1).size());
  std::vector<int64_t> dims;
  for (int64_t d = rank - k; d < rank; ++d) dims.push_back(d);
  return dims;
}


std::map<std::string, Decomposition> make_table() {
  std::map<std::string, Decomposition> t;
  auto pointwise = [&](const std::string& name, Builder build, decltype(Decomposition::supports) ok = nullptr) {
    t[name] = Decomposition{std::move(ok), nullptr, std::move(build), 1};
  };
  auto reducing = [&](const std::string& name, Builder build, decltype(Decomposition::reduction_dims) dims,
                      decltype(Decomposition::supports) ok = nullptr, int outputs = 1) {
    t[name] = Decomposition{std::move(ok), std::move(dims), std::move(build), outputs};
  };
  for (const char* o : {"aten::add.Tensor", "aten::add.Scalar"}) pointwise(o, add_like(PrimOp::Add), not_bool_output);
  for (const char* o : {"aten::sub.Tensor", "aten::sub.Scalar"}) pointwise(o, add_like(PrimOp::Sub), not_bool_output);
  for (const char* o : {"aten::mul.Tensor", "aten::mul.Scalar"}) pointwise(o, binary(PrimOp::Mul), not_bool_output);
  for (const char* o : {"aten::div.Tensor", "aten::div.Scalar"}) pointwise(o, binary(PrimOp::Div), is_floating_output);
  pointwise("aten::maximum.default", binary(PrimOp::Maximum));
  pointwise("aten::minimum.default", binary(PrimOp::Minimum));
  const std::pair<const char*, PrimOp> unary_ops[] = {
      {"neg", PrimOp::Neg},   {"abs", PrimOp::Abs},   {"exp", PrimOp::Exp},         {"log", PrimOp::Log},
      {"sqrt", PrimOp::Sqrt}, {"rsqrt", PrimOp::Rsqrt}, {"tanh", PrimOp::Tanh}, {"sigmoid", PrimOp::Sigmoid},
      {"erf", PrimOp::Erf}};
  for (const auto& [name, op] : unary_ops) {
    const bool needs_float = op != PrimOp::Neg && op != PrimOp::Abs;
    pointwise(std::string("aten::") + name + ".default", unary(op), needs_float ? is_floating_output : not_bool_output);
  }
  pointwise("aten::logical_not.default", [](PrimBuilder& b, const Graph& g, const Node& n) {
    b.set_output(0, b.cast(b.unary(PrimOp::LogicalNot, arg_as(b, 0, ScalarType::Bool)), out_meta(g, n).dtype));
  });
  pointwise("aten::relu.default", build_relu, not_bool_output);
  pointwise("aten::gelu.default", build_gelu, is_floating_output);
  pointwise("aten::silu.default", build_silu, is_floating_output);
  pointwise("aten::pow.Tensor_Scalar", build_pow_scalar, pow_supported);
  pointwise("aten::clamp.default", clamp_builder(1, 2), not_bool_output);
  pointwise("aten::clamp_min.default", clamp_builder(1, -1), not_bool_output);
  pointwise("aten::clamp_max.default", clamp_builder(-1, 1), not_bool_output);
  pointwise("aten::where.self", build_where);
  pointwise("aten::_to_copy.default", build_cast, to_copy_supported);
  pointwise("aten::clone.default", build_cast);
  const std::pair<const char*, PrimOp> comparisons[] = {{"lt", PrimOp::Lt}, {"le", PrimOp::Le}, {"gt", PrimOp::Gt},
                                                        {"ge", PrimOp::Ge}, {"eq", PrimOp::Eq}, {"ne", PrimOp::Ne}};
  for (const auto& [name, op] : comparisons)
    for (const char* overload : {".Tensor", ".Scalar"}) pointwise(std::string("aten::") + name + overload, comparison(op));

  auto dims_arg = [](int arg, bool empty_means_all) {
    return [arg, empty_means_all](const Graph& g, const Node& n) { return dims_from_arg(g, n, arg, empty_means_all); };
  };
  reducing("aten::sum.dim_IntList", reduction(ReduceOp::Sum, false), dims_arg(1, true), not_bool_output);
  reducing("aten::sum.default", reduction(ReduceOp::Sum, false), dims_arg(-1, true), not_bool_output);
  reducing("aten::mean.dim", reduction(ReduceOp::Sum, true), dims_arg(1, true), is_floating_output);
  reducing("aten::mean.default", reduction(ReduceOp::Sum, true), dims_arg(-1, true), is_floating_output);
  reducing("aten::amax.default", reduction(ReduceOp::Max, false), dims_arg(1, true), not_bool_output);
  reducing("aten::amin.default", reduction(ReduceOp::Min, false), dims_arg(1, true), not_bool_output);
  for (const char* o : {"aten::_softmax.default", "aten::softmax.int"})
    reducing(o, softmax(false), dims_arg(1, false), softmax_supported);
  for (const char* o : {"aten::_log_softmax.default", "aten::log_softmax.int"})
    reducing(o, softmax(true), dims_arg(1, false), softmax_supported);
  reducing("aten::native_layer_norm.default", build_layer_norm, layer_norm_dims, layer_norm_supported, 3);
  add_math_decompositions(t);
  add_composite_decompositions(t);
  add_window_decompositions(t);
  add_gather_decompositions(t);
  add_backward_decompositions(t);
  return t;
}

const std::map<std::string, Decomposition>& table() {
  static const std::map<std::string, Decomposition> t = make_table();
  return t;
}

}  // namespace

const Decomposition* find_decomposition(const Graph& g, const Node& node) {
  if (node.mutates_args || node.returns_list) return nullptr;
  auto it = table().find(node.qualified_name());
  if (it == table().end()) return nullptr;
  for (graph::ValueId out : node.outputs)
    if (!is_codegen_dtype(g.value(out).meta.dtype)) return nullptr;
  for (const ArgValue& arg : node.args) {
    bool ok = true;
    graph::for_each_tensor(arg, [&](graph::ValueId id) {
      const auto& m = g.value(id).meta;
      ok = ok && is_codegen_dtype(m.dtype) && m.device == g.value(node.outputs[0]).meta.device;
    });
    // A tensor list is read element by element through padded_list_element: only padded-read builders (cat) can.
    if (const auto* list = std::get_if<graph::TensorListArg>(&arg)) {
      if (!it->second.padded_reads) return nullptr;
      for (const auto& id : list->ids)
        if (!id) return nullptr;
    }
    if (std::holds_alternative<std::complex<double>>(arg)) return nullptr;
    if (!ok) return nullptr;
  }
  if (it->second.supports && !it->second.supports(g, node)) return nullptr;
  return &it->second;
}

std::optional<double> constant_node_value(const Graph& g, const Node& node, ScalarType& dtype) {
  if (node.qualified_name() != "aten::scalar_tensor.default" || !is_number(node, 0)) return std::nullopt;
  dtype = out_meta(g, node).dtype;
  if (!is_codegen_dtype(dtype)) return std::nullopt;
  return number_arg(node, 0);
}

bool is_affine_view(const Graph& g, const Node& node) {
  if (node.outputs.size() != 1 || node.mutates_args || node.args.empty()) return false;
  auto* base = std::get_if<graph::TensorArg>(&node.args[0]);
  if (!base) return false;
  switch (graph::op_facts(node.qualified_name()).view) {
    case graph::OpView::kNone:
      return false;
    case graph::OpView::kAffine:
      return true;
    case graph::OpView::kAffineWhenContiguous: {
      const auto& m = g.value(base->id).meta;
      return m.strides == graph::contiguous_strides(m.sizes) &&
             g.value(node.outputs[0]).meta.strides == graph::contiguous_strides(g.value(node.outputs[0]).meta.sizes);
    }
  }
  return false;
}

std::vector<std::string> decomposed_ops() {
  std::vector<std::string> names;
  for (const auto& [name, entry] : table()) names.push_back(name);
  return names;
}

}  // namespace kiln::decomp
