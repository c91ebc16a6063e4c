#pragma once
// Helpers shared by the files that fill the decomposition table (decompositions.cpp, decompose_math.cpp):
// argument access, dtype rules and the builders that several entries reuse. Internal to decomp/.
//
// Torch-free.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "decomp/decompositions.h"

namespace kiln::decomp::detail {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::ScalarType;

inline int dtype_category(ScalarType t) {  // 0 bool, 1 integral, 2 floating
  if (t == ScalarType::Bool) return 0;
  return graph::is_floating_or_complex(t) ? 2 : 1;
}


inline const graph::TensorMeta& out_meta(const Graph& g, const Node& n, int i = 0) { return g.value(n.outputs[i]).meta; }

inline const graph::TensorMeta* tensor_arg_meta(const Graph& g, const Node& n, int i) {
  if (auto* t = std::get_if<graph::TensorArg>(&n.args[i])) return &g.value(t->id).meta;
  return nullptr;
}

inline bool is_none(const Node& n, int i) { return std::holds_alternative<graph::NoneArg>(n.args[i]); }

inline double number_arg(const Node& n, int i) {
  const ArgValue& a = n.args[i];
  if (auto* d = std::get_if<double>(&a)) return *d;
  if (auto* l = std::get_if<int64_t>(&a)) return static_cast<double>(*l);
  if (auto* b = std::get_if<bool>(&a)) return *b ? 1.0 : 0.0;
  return std::nan("");
}

inline bool is_number(const Node& n, int i) {
  const ArgValue& a = n.args[i];
  return std::holds_alternative<double>(a) || std::holds_alternative<int64_t>(a) || std::holds_alternative<bool>(a);
}

inline ScalarType number_dtype(const Node& n, int i) {
  const ArgValue& a = n.args[i];
  if (std::holds_alternative<double>(a)) return ScalarType::Double;
  if (std::holds_alternative<bool>(a)) return ScalarType::Bool;
  return ScalarType::Long;
}

inline std::vector<int64_t> int_list_arg(const Node& n, int i) {
  const ArgValue& a = n.args[i];
  if (auto* v = std::get_if<std::vector<int64_t>>(&a)) return *v;
  if (auto* l = std::get_if<int64_t>(&a)) return {*l};
  return {};
}

inline std::vector<int64_t> normalise_dims(std::vector<int64_t> dims, int64_t rank, bool empty_means_all) {
  if (dims.empty() && empty_means_all)
    for (int64_t d = 0; d < rank; ++d) dims.push_back(d);
  std::vector<int64_t> out;
  for (int64_t d : dims) {
    if (rank == 0) continue;  // 0-d: dim 0 / -1 name the single element
    if (d < 0) d += rank;
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The dtype a comparison (or maximum/minimum) of args i and j is carried out in.
inline ScalarType compare_dtype(const Graph& g, const Node& n, int i, int j) {
  const auto* ma = tensor_arg_meta(g, n, i);
  const auto* mb = tensor_arg_meta(g, n, j);
  if (ma && mb) return promote_types(ma->dtype, mb->dtype);
  const auto* tensor = ma ? ma : mb;
  const ScalarType number = number_dtype(n, ma ? j : i);
  if (dtype_category(number) > dtype_category(tensor->dtype))
    return number == ScalarType::Double ? ScalarType::Float : ScalarType::Long;  // default dtypes
  return tensor->dtype;
}

inline Prim arg_as(PrimBuilder& b, int i, ScalarType t) { return b.cast(b.arg(i), t); }
inline Prim constant_like(PrimBuilder& b, double v, Prim like) { return b.constant(v, b.dtype(like)); }

// ---- builders -------------------------------------------------------------------------------------------
using Builder = std::function<void(PrimBuilder&, const Graph&, const Node&)>;

inline Builder unary(PrimOp op) {
  return [op](PrimBuilder& b, const Graph& g, const Node& n) {
    b.set_output(0, b.unary(op, arg_as(b, 0, out_meta(g, n).dtype)));
  };
}

// add/sub with alpha (argument 2): a op alpha*b
inline Builder add_like(PrimOp op) {
  return [op](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    Prim rhs = arg_as(b, 1, t);
    if (n.args.size() > 2 && is_number(n, 2) && number_arg(n, 2) != 1.0)
      rhs = b.binary(PrimOp::Mul, rhs, b.constant(number_arg(n, 2), t));
    b.set_output(0, b.binary(op, arg_as(b, 0, t), rhs));
  };
}

inline Builder binary(PrimOp op) {
  return [op](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    b.set_output(0, b.binary(op, arg_as(b, 0, t), arg_as(b, 1, t)));
  };
}

inline Builder comparison(PrimOp op) {
  return [op](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compare_dtype(g, n, 0, 1);
    b.set_output(0, b.binary(op, arg_as(b, 0, t), arg_as(b, 1, t)));
  };
}

inline bool is_floating_output(const Graph& g, const Node& n) { return graph::is_floating_or_complex(out_meta(g, n).dtype); }
inline bool not_bool_output(const Graph& g, const Node& n) { return out_meta(g, n).dtype != ScalarType::Bool; }
inline std::vector<int64_t> dims_from_arg(const Graph& g, const Node& n, int arg, bool empty_means_all) {
  const int64_t rank = static_cast<int64_t>(tensor_arg_meta(g, n, 0)->sizes.size());
  if (arg < 0 || is_none(n, arg)) return normalise_dims({}, rank, true);
  return normalise_dims(int_list_arg(n, arg), rank, empty_means_all);
}

// clamp(x, min?, max?) = min(max(x, lo), hi); the bounds are arguments `lo_arg`, `hi_arg` (-1: absent).
inline Builder clamp_builder(int lo_arg, int hi_arg) {
  return [lo_arg, hi_arg](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = out_meta(g, n).dtype;
    Prim x = arg_as(b, 0, t);
    if (lo_arg >= 0 && !is_none(n, lo_arg)) x = b.binary(PrimOp::Maximum, x, arg_as(b, lo_arg, t));
    if (hi_arg >= 0 && !is_none(n, hi_arg)) x = b.binary(PrimOp::Minimum, x, arg_as(b, hi_arg, t));
    b.set_output(0, x);
  };
}

// ---- compute dtypes and pointwise builders (ATen's "opmath": half and bfloat16 compute in float) ----------
constexpr double kPi = 3.14159265358979323846;

inline ScalarType opmath(ScalarType t) { return t == ScalarType::Half || t == ScalarType::BFloat16 ? ScalarType::Float : t; }

// The output dtype's opmath: the type arithmetic of this node happens in.
inline ScalarType compute_dtype(const Graph& g, const Node& n) { return opmath(out_meta(g, n).dtype); }

inline Prim number(PrimBuilder& b, const Node& n, int i, ScalarType t) { return b.constant(number_arg(n, i), t); }

inline Prim select(PrimBuilder& b, Prim condition, Prim if_true, Prim if_false) { return b.where(condition, if_true, if_false); }

// f(x) with x in the compute dtype; the result is stored in the output dtype.
inline Builder pointwise1(std::function<Prim(PrimBuilder&, const Node&, Prim, ScalarType)> f) {
  return [f](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    b.set_output(0, f(b, n, arg_as(b, 0, t), t));
  };
}

// f(x, y) with both operands in the compute dtype.
inline Builder pointwise2(std::function<Prim(PrimBuilder&, const Node&, Prim, Prim, ScalarType)> f) {
  return [f](PrimBuilder& b, const Graph& g, const Node& n) {
    const ScalarType t = compute_dtype(g, n);
    b.set_output(0, f(b, n, arg_as(b, 0, t), arg_as(b, 1, t), t));
  };
}

/// Adds the math entries (trigonometric, rounding, bitwise, activations, var/std, any/all...).
void add_math_decompositions(std::map<std::string, Decomposition>& table);
/// Adds the composite entries (logaddexp, rounding divisions, norms, losses, fills...).
void add_composite_decompositions(std::map<std::string, Decomposition>& table);
/// Adds the entries that read padded or windowed operands (constant_pad_nd, slice_backward, cat, pooling).
void add_window_decompositions(std::map<std::string, Decomposition>& table);
void add_gather_decompositions(std::map<std::string, Decomposition>& table);
/// Adds the derivative ops the backward graphs hold (gelu_backward, softmax's backward, ...).
void add_backward_decompositions(std::map<std::string, Decomposition>& table);

}  // namespace kiln::decomp::detail
