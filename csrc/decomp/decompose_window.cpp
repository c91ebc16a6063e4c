// Decompositions that read their input at other elements than the output's own: padding, a slice's gradient,
// concatenation and 2-d pooling.
// They go through PrimBuilder::padded_arg, which reads an operand at out_index * stride + window_index *
// dilation + offset per dim and gives a fill value outside the operand, so the padding is never materialised
// and nothing outside the input is read. Pooling windows are extra reduced dims of the node's index space
// (Decomposition::window_sizes), combined by reduce().
//
// Window geometry follows ATen's CPU kernels (aten/src/ATen/native/cpu/{Max,Avg}PoolKernel.cpp): window
// (oh, kh) reads input row oh * stride - pad + kh * dilation; rows outside [0, H) are skipped. The output's
// size (ceil_mode included) comes from the node's meta, so ceil_mode needs nothing here.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "decomp/decomposition_helpers.h"

namespace kiln::decomp::detail {

namespace {

// A pooling parameter given as one or two ints (`kernel_size=3`, `stride=[2, 1]`), or empty for `fallback`.
std::vector<int64_t> pair_arg(const Node& n, int i, const std::vector<int64_t>& fallback) {
  std::vector<int64_t> v = i < static_cast<int>(n.args.size()) ? int_list_arg(n, i) : std::vector<int64_t>{};
  if (v.empty()) return fallback;
  if (v.size() == 1) v.push_back(v[0]);
  return v;
}

struct PoolGeometry {
  std::vector<int64_t> kernel, stride, padding, dilation;
};

// max_pool2d(_with_indices)(self, kernel_size, stride, padding, dilation, ceil_mode) and
// avg_pool2d(self, kernel_size, stride, padding, ...) share their first four arguments; avg has no dilation.
PoolGeometry pool_geometry(const Node& n, bool has_dilation) {
  PoolGeometry p;
  p.kernel = pair_arg(n, 1, {});
  p.stride = pair_arg(n, 2, p.kernel);
  p.padding = pair_arg(n, 3, {0, 0});
  p.dilation = has_dilation ? pair_arg(n, 4, {1, 1}) : std::vector<int64_t>{1, 1};
  return p;
}

// Per input dim: the batch/channel dims read at the output's own index, the last two through the window.
std::vector<DimAccess> window_access(const PoolGeometry& p, size_t rank) {
  std::vector<DimAccess> dims(rank);
  for (int w = 0; w < 2; ++w) {
    DimAccess& d = dims[rank - 2 + w];
    d.stride = p.stride[w];
    d.offset = -p.padding[w];
    d.window_dim = w;
    d.dilation = p.dilation[w];
  }
  return dims;
}

bool pool_shape_ok(const Graph& g, const Node& n, const PoolGeometry& p) {
  const auto* in = tensor_arg_meta(g, n, 0);
  if (!in || (in->sizes.size() != 3 && in->sizes.size() != 4) || out_meta(g, n).sizes.size() != in->sizes.size())
    return false;
  for (const auto* v : {&p.kernel, &p.stride, &p.padding, &p.dilation})
    if (v->size() != 2) return false;
  return p.kernel[0] > 0 && p.kernel[1] > 0 && p.stride[0] > 0 && p.stride[1] > 0 && p.dilation[0] > 0 && p.dilation[1] > 0;
}

// The identity of max for `t`: -inf, or the lowest integer (what ATen's kernels start their max from).
double max_identity(ScalarType t) {
  switch (t) {
    case ScalarType::Byte: return 0;
    case ScalarType::Char: return std::numeric_limits<int8_t>::lowest();
    case ScalarType::Short: return std::numeric_limits<int16_t>::lowest();
    case ScalarType::Int: return std::numeric_limits<int32_t>::lowest();
    case ScalarType::Long: return static_cast<double>(std::numeric_limits<int64_t>::lowest());
    default: return -std::numeric_limits<double>::infinity();
  }
}

// max over the window; NaN propagates (reduce(Max) does, like ATen's `val > max || isnan(val)`).
void build_max_pool(PrimBuilder& b, const Graph& g, const Node& n) {
  const ScalarType t = out_meta(g, n).dtype;
  const PoolGeometry p = pool_geometry(n, true);
  const Prim x = b.padded_arg(0, window_access(p, out_meta(g, n).sizes.size()), max_identity(t));
  b.set_output(0, b.reduce(ReduceOp::Max, b.cast(x, t)));
}

// Training (the indices are read, by the backward) keeps ATen's kernel, which computes them.
bool max_pool_supported(const Graph& g, const Node& n) {
  if (!pool_shape_ok(g, n, pool_geometry(n, true)) || out_meta(g, n).dtype == ScalarType::Bool) return false;
  return n.outputs.size() < 2 || !graph::is_read(g, n.outputs[1]);
}

// sum / divisor, the divisor as ATen's avg_pool2d: divisor_override, else the window's elements inside the
// input padded by `padding` on both sides (count_include_pad: padding counts, the part past it does not), else
// those inside the input.
void build_avg_pool(PrimBuilder& b, const Graph& g, const Node& n) {
  const auto& out = out_meta(g, n);
  const ScalarType compute = compute_dtype(g, n);
  const PoolGeometry p = pool_geometry(n, false);
  const std::vector<DimAccess> dims = window_access(p, out.sizes.size());
  const Prim sum = b.reduce(ReduceOp::Sum, b.cast(b.padded_arg(0, dims, 0.0), compute));
  const bool count_include_pad = !(n.args.size() > 5 && std::holds_alternative<bool>(n.args[5]) && !std::get<bool>(n.args[5]));
  Prim divisor;
  if (n.args.size() > 6 && is_number(n, 6)) {
    divisor = b.constant(number_arg(n, 6), compute);
  } else {
    std::vector<int64_t> extents = tensor_arg_meta(g, n, 0)->sizes;
    std::vector<DimAccess> counted = dims;
    if (count_include_pad)
      for (int w = 0; w < 2; ++w) {
        counted[counted.size() - 2 + w].offset += p.padding[w];
        extents[extents.size() - 2 + w] += 2 * p.padding[w];
      }
    divisor = b.reduce(ReduceOp::Sum, b.cast(b.in_bounds(counted, extents), compute));
  }
  b.set_output(0, b.cast(b.binary(PrimOp::Div, sum, divisor), out.dtype));
}

bool avg_pool_supported(const Graph& g, const Node& n) {
  if (!pool_shape_ok(g, n, pool_geometry(n, false)) || !is_floating_output(g, n)) return false;
  return !(n.args.size() > 6 && is_number(n, 6) && number_arg(n, 6) == 0);  // ATen raises on a zero divisor
}

// The window dims' extents: the kernel, cut to the positions that can read inside the input (avg: inside the input
// padded on both sides, which count_include_pad counts). Positions past them read nothing for any output, so cutting
// them changes no sum, count or max; a window far larger than its input (transformers' EfficientNet pools its 2x2
// last map with a 2560x2560 kernel) loops over the input, not over millions of skipped positions.
std::vector<int64_t> pool_window(const Graph& g, const Node& n) {
  const bool max = n.op.find("max_pool") != std::string::npos;
  const PoolGeometry p = pool_geometry(n, max);
  std::vector<int64_t> window = p.kernel;
  const auto* in = tensor_arg_meta(g, n, 0);
  if (!in || in->sizes.size() < 2 || window.size() != 2) return window;
  for (int w = 0; w < 2; ++w) {
    const int64_t size = in->sizes[in->sizes.size() - 2 + w];
    const int64_t reach = max ? (size + p.padding[w] + p.dilation[w] - 1) / p.dilation[w] : size + 2 * p.padding[w];
    window[w] = std::max<int64_t>(1, std::min(window[w], reach));
  }
  return window;
}

// constant_pad_nd(self, pad, value): pad holds (before, after) pairs from the last dim backwards; a negative
// pad crops, which the same offset expresses (the source index starts inside the input).
void build_constant_pad(PrimBuilder& b, const Graph& g, const Node& n) {
  const std::vector<int64_t> pad = int_list_arg(n, 1);
  const size_t rank = out_meta(g, n).sizes.size();
  std::vector<DimAccess> dims(rank);
  for (size_t i = 0; 2 * i < pad.size(); ++i) dims[rank - 1 - i].offset = -pad[2 * i];
  const double value = n.args.size() > 2 && is_number(n, 2) ? number_arg(n, 2) : 0.0;
  b.set_output(0, b.padded_arg(0, dims, value));
}

bool constant_pad_supported(const Graph& g, const Node& n) {
  const auto* in = tensor_arg_meta(g, n, 0);
  const std::vector<int64_t> pad = int_list_arg(n, 1);
  if (!in || pad.size() % 2 != 0 || pad.size() / 2 > in->sizes.size()) return false;
  return in->sizes.size() == out_meta(g, n).sizes.size() && in->dtype == out_meta(g, n).dtype;
}

// slice_backward(grad, input_sizes, dim, start, end, step): the slice's gradient in a zero tensor of the input's
// shape. With step 1 it is constant_pad_nd's read: the grad at the index less `start` along `dim`, 0 elsewhere (a
// rotary embedding's gradient: its two halves and their sum are one loop, not two zero fills and two copies).
// start and end are normalised as ATen's slice does. The read's access per dim, or nullopt for other calls.
std::optional<std::vector<DimAccess>> slice_backward_access(const Graph& g, const Node& n) {
  const auto* grad = tensor_arg_meta(g, n, 0);
  const graph::TensorMeta& out = out_meta(g, n);
  const int64_t rank = static_cast<int64_t>(out.sizes.size());
  if (!grad || static_cast<int64_t>(grad->sizes.size()) != rank || rank == 0 || n.args.size() < 6) return std::nullopt;
  for (int i = 2; i < 6; ++i)
    if (!std::holds_alternative<int64_t>(n.args[i])) return std::nullopt;
  int64_t dim = std::get<int64_t>(n.args[2]);
  if (dim < 0) dim += rank;
  if (dim < 0 || dim >= rank || std::get<int64_t>(n.args[5]) != 1 || grad->dtype != out.dtype) return std::nullopt;
  const int64_t size = out.sizes[dim];
  auto clamp = [&](int64_t i) { return std::clamp(i < 0 ? i + size : i, int64_t{0}, size); };
  const int64_t start = clamp(std::get<int64_t>(n.args[3]));
  const int64_t end = std::max(start, clamp(std::get<int64_t>(n.args[4])));
  for (int64_t d = 0; d < rank; ++d)
    if (grad->sizes[d] != (d == dim ? end - start : out.sizes[d])) return std::nullopt;
  std::vector<DimAccess> dims(rank);
  dims[dim].offset = -start;
  return dims;
}

bool slice_backward_supported(const Graph& g, const Node& n) { return slice_backward_access(g, n).has_value(); }

void build_slice_backward(PrimBuilder& b, const Graph& g, const Node& n) {
  b.set_output(0, b.padded_arg(0, *slice_backward_access(g, n), 0.0));
}

// cat(tensors, dim) as one loop over the output: operand k covers [offset_k, offset_k + extent_k) along `dim` and is
// read at the output's index less offset_k (a padded read: 0 outside it, nothing outside it read). A chain of
// selects on the same bounds keeps the covering operand, so each element loads one operand. Its producers'
// pointwise work is recomputed there (rotary embeddings' `cat((-x2, x1))`) and its readers fuse after it.
// Up to kMaxFusedCatOperands operands: each element evaluates every operand's bounds.
constexpr size_t kMaxFusedCatOperands = 8;

struct CatOperand {
  int element;                  // index in the tensor list
  std::vector<DimAccess> dims;  // the output's index less the operand's offset along the cat dim
  const std::vector<int64_t>* sizes;
};

// The operands that hold elements, in order, or nullopt when the call is not a concatenation of same-rank tensors.
// ATen skips 1-d empty operands whatever the others' rank (transformers' caches start as `torch.tensor([])`).
std::optional<std::vector<CatOperand>> cat_operands(const Graph& g, const Node& n) {
  const auto* list = n.args.empty() ? nullptr : std::get_if<graph::TensorListArg>(&n.args[0]);
  const graph::TensorMeta& out = out_meta(g, n);
  const int64_t rank = static_cast<int64_t>(out.sizes.size());
  int64_t dim = n.args.size() > 1 && std::holds_alternative<int64_t>(n.args[1]) ? std::get<int64_t>(n.args[1]) : 0;
  if (dim < 0) dim += rank;
  if (!list || list->ids.empty() || dim < 0 || dim >= rank) return std::nullopt;
  std::vector<CatOperand> operands;
  int64_t offset = 0;
  for (size_t k = 0; k < list->ids.size(); ++k) {
    if (!list->ids[k]) return std::nullopt;
    const graph::TensorMeta& m = g.value(*list->ids[k]).meta;
    if (m.sizes.size() == 1 && m.sizes[0] == 0) continue;
    if (static_cast<int64_t>(m.sizes.size()) != rank) return std::nullopt;
    for (int64_t d = 0; d < rank; ++d)
      if (d != dim && m.sizes[d] != out.sizes[d]) return std::nullopt;
    if (m.sizes[dim] > 0) {
      std::vector<DimAccess> dims(rank);
      dims[dim].offset = -offset;
      operands.push_back({static_cast<int>(k), std::move(dims), &m.sizes});
    }
    offset += m.sizes[dim];
  }
  if (offset != out.sizes[dim] || operands.empty() || operands.size() > kMaxFusedCatOperands) return std::nullopt;
  return operands;
}

bool cat_supported(const Graph& g, const Node& n) { return cat_operands(g, n).has_value(); }

void build_cat(PrimBuilder& b, const Graph& g, const Node& n) {
  const std::vector<CatOperand> operands = *cat_operands(g, n);
  const graph::ScalarType dtype = out_meta(g, n).dtype;
  Prim result = -1;
  for (auto it = operands.rbegin(); it != operands.rend(); ++it) {
    const Prim value = b.cast(b.padded_list_element(0, it->element, it->dims, 0.0), dtype);
    result = result < 0 ? value : b.where(b.in_bounds(it->dims, *it->sizes), value, result);
  }
  b.set_output(0, result);
}

}  // namespace

void add_window_decompositions(std::map<std::string, Decomposition>& table) {
  auto windowed = [&](const std::string& name, Builder build, decltype(Decomposition::supports) ok) {
    Decomposition d{std::move(ok), nullptr, std::move(build), 1};
    d.padded_reads = true;
    d.window_sizes = pool_window;
    table[name] = std::move(d);
  };
  windowed("aten::max_pool2d_with_indices.default", build_max_pool, max_pool_supported);
  windowed("aten::max_pool2d.default", build_max_pool, max_pool_supported);
  windowed("aten::avg_pool2d.default", build_avg_pool, avg_pool_supported);
  Decomposition pad{constant_pad_supported, nullptr, build_constant_pad, 1};
  pad.padded_reads = true;
  table["aten::constant_pad_nd.default"] = std::move(pad);
  Decomposition slice_backward{slice_backward_supported, nullptr, build_slice_backward, 1};
  slice_backward.padded_reads = true;
  table["aten::slice_backward.default"] = std::move(slice_backward);
  Decomposition cat{cat_supported, nullptr, build_cat, 1};
  cat.padded_reads = true;
  table["aten::cat.default"] = std::move(cat);
}

}  // namespace kiln::decomp::detail
