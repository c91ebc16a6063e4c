// Derivative rules, fourth part: scatter and index updates (scatter, scatter_add, scatter_reduce, index_add/copy/
// fill/put, masked_scatter, take, put), shape ops (repeat, diagonal, unfold, rot90, pixel and channel shuffles, the
// slice/select/diagonal scatters), losses, pooling, padding and sampling ops with an ATen backward, nn.Bilinear's
// _trilinear, and the *_copy variants of view ops. As in derivative_rules.cpp, each rule mirrors eager's formula
// (tools/autograd/derivatives.yaml and FunctionsManual.cpp in PyTorch); the OpInfo gradient sweep
// (tests/python/test_opinfo_grad_sweep.py) compares them with eager.
#include <algorithm>

#include "autodiff/derivative_rule_helpers.h"
#include "common/error.h"

namespace kiln::autodiff::detail {

namespace {

// scatter_reduce(self, dim, index, src, reduce, *, include_self): sum and mean spread the gradient back over what
// was reduced; amax and amin share it evenly among the elements equal to the result (eager's
// scatter_reduce_backward). prod keeps the eager interpreter.
void rule_scatter_reduce(RuleCall& c) {
  const std::string reduce = std::get<std::string>(c.arg(4));
  const bool include_self = c.bool_arg(5);
  ValueId index = c.input(2);
  const Arg dim = c.arg(1);
  auto gather = [&](ValueId v) { return op(c, "aten::gather", {tensor(v), dim, tensor(index), false}); };
  ValueId grad = c.grad();
  std::optional<ValueId> grad_self, grad_src;
  if (reduce == "sum") {
    grad_self = grad;
    grad_src = gather(grad);
  } else if (reduce == "mean") {
    ValueId start = include_self ? ones_like(c, grad) : zeros_like(c, grad);
    ValueId count = op(c, "aten::scatter_add", {tensor(start), dim, tensor(index), tensor(ones_like(c, c.input(3)))});
    count = op(c, "aten::masked_fill", {tensor(count), tensor(op(c, "aten::eq", {tensor(count), 0.0}, "Scalar")), 1.0}, "Scalar");
    grad_self = c.b.div(grad, count);
    grad_src = c.b.div(gather(grad), gather(count));
  } else if (reduce == "amax" || reduce == "amin") {
    const graph::ScalarType dtype = c.input_meta(0).dtype;
    ValueId result = c.result(0);
    ValueId value = gather(result);
    ValueId self_is = compare(c, "aten::eq", c.input(0), tensor(result));
    ValueId src_is = compare(c, "aten::eq", c.input(3), tensor(value));
    ValueId count = op(c, "aten::scatter_add", {tensor(c.b.to_dtype(self_is, dtype)), dim, tensor(index), tensor(c.b.to_dtype(src_is, dtype))});
    ValueId shared = c.b.div(grad, count);
    grad_self = c.b.mul(self_is, shared);
    grad_src = c.b.mul(src_is, gather(shared));
  } else {
    KILN_UNSUPPORTED() << "scatter_reduce with reduce='" << reduce << "'";
  }
  if (!include_self) grad_self = op(c, "aten::scatter", {tensor(*grad_self), dim, tensor(index), 0.0}, "value");
  if (c.needs(0)) c.set(0, *grad_self);
  if (c.needs(3)) c.set(3, *grad_src);
}
// ---- scatter, index and shape ops --------------------------------------------------------------------
void rule_scatter_src(RuleCall& c) {  // scatter(self, dim, index, src): self loses the written places
  if (c.needs(0)) c.set(0, op(c, "aten::scatter", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), 0.0}, "value"));
  if (c.needs(3)) c.set(3, op(c, "aten::gather", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), false}));
}
void rule_scatter_value(RuleCall& c) {
  if (c.needs(0)) c.set(0, op(c, "aten::scatter", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), 0.0}, "value"));
}
void rule_scatter_add(RuleCall& c) {  // scatter_add(self, dim, index, src)
  set_if(c, 0, c.grad());
  if (c.needs(3)) c.set(3, op(c, "aten::gather", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), false}));
}
// The rows `index` of grad along dim, shaped as `source` (index_add / index_copy's source gradient).
ValueId selected_rows(RuleCall& c, size_t source_arg) {
  if (c.input_meta(source_arg).sizes.empty()) KILN_UNSUPPORTED() << c.node().qualified_name() << " with a 0-d source";
  ValueId rows = op(c, "aten::index_select", {tensor(c.grad()), c.arg(1), tensor(c.input(2))});
  return c.b.expand(rows, c.input_meta(source_arg).sizes);
}
void rule_index_add(RuleCall& c) {  // index_add(self, dim, index, source, alpha)
  set_if(c, 0, c.grad());
  if (c.needs(3)) c.set(3, c.b.mul(selected_rows(c, 3), c.number_arg(4)));
}
void rule_index_copy(RuleCall& c) {  // index_copy(self, dim, index, source)
  if (c.needs(0)) c.set(0, op(c, "aten::index_fill", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), 0.0}, "int_Scalar"));
  if (c.needs(3)) c.set(3, selected_rows(c, 3));
}
void rule_index_fill(RuleCall& c) {  // index_fill(self, dim, index, value)
  if (c.needs(0)) c.set(0, op(c, "aten::index_fill", {tensor(c.grad()), c.arg(1), tensor(c.input(2)), 0.0}, "int_Scalar"));
}
void rule_masked_scatter(RuleCall& c) {  // masked_scatter(self, mask, source)
  if (c.needs(0)) c.set(0, zero_where(c, c.input(1), c.grad()));
  if (c.needs(2))
    c.set(2, op(c, "aten::masked_scatter_backward", {tensor(c.grad()), tensor(c.input(1)), c.input_meta(2).sizes}));
}
void rule_take(RuleCall& c) {  // take(self, index): grad put back at index, summed where repeated
  if (c.needs(0)) c.set(0, op(c, "aten::put", {tensor(zeros_like(c, c.input(0))), tensor(c.input(1)), tensor(c.grad()), true}));
}
void rule_put(RuleCall& c) {  // put(self, index, source, accumulate)
  const bool accumulate = c.bool_arg(3);
  if (c.needs(0))
    c.set(0, accumulate ? c.grad() : op(c, "aten::put", {tensor(c.grad()), tensor(c.input(1)), tensor(zeros_like(c, c.input(2))), false}));
  if (c.needs(2)) c.set(2, c.b.reshape(op(c, "aten::take", {tensor(c.grad()), tensor(c.input(1))}), c.input_meta(2).sizes));
}
// index_put(self, indices, values, accumulate): self gets grad with the written places zeroed (all of grad when
// accumulating), values the indexed part of grad (summed to values' shape by the joint builder).
void rule_index_put(RuleCall& c) {
  const auto& list = std::get<graph::TensorListArg>(c.arg(1));
  graph::TensorListArg indices;
  for (const auto& id : list.ids) indices.ids.push_back(id ? std::optional<ValueId>(c.b.forward_value(*id)) : std::nullopt);
  if (c.needs(0))
    c.set(0, c.bool_arg(3) ? c.grad() : op(c, "aten::index_put", {tensor(c.grad()), indices, tensor(zeros_like(c, c.input(2))), false}));
  if (c.needs(2)) c.set(2, op(c, "aten::index", {tensor(c.grad()), indices}, "Tensor"));
}
// index(self, indices) (advanced indexing, x[idx] / x[:, idx]): grad accumulated into zeros of self's shape at the
// indexed places, repeated indices summing, as eager's index_backward.
void rule_index(RuleCall& c) {
  if (!c.needs(0)) return;
  const auto& list = std::get<graph::TensorListArg>(c.arg(1));
  graph::TensorListArg indices;
  for (const auto& id : list.ids) indices.ids.push_back(id ? std::optional<ValueId>(c.b.forward_value(*id)) : std::nullopt);
  c.set(0, op(c, "aten::index_put", {tensor(new_zeros(c, c.grad(), c.input_meta(0).sizes)), indices, tensor(c.grad()), true}));
}
void rule_repeat(RuleCall& c) {  // repeat(self, repeats): the tiles summed back onto self
  if (!c.needs(0)) return;
  const std::vector<int64_t> repeats = c.ints_arg(1);
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  if (std::find(repeats.begin(), repeats.end(), 0) != repeats.end()) {
    c.set(0, new_zeros(c, c.grad(), sizes));
    return;
  }
  ValueId g = c.grad();
  const size_t leading = repeats.size() - sizes.size();
  if (leading > 0) {
    std::vector<int64_t> dims;
    for (size_t i = 0; i < leading; ++i) dims.push_back(static_cast<int64_t>(i));
    g = c.b.emit("aten::sum", "dim_IntList", {tensor(g), dims, false, graph::NoneArg{}});
  }
  std::vector<int64_t> tiled, summed;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (repeats[leading + d] != 1) {
      tiled.push_back(repeats[leading + d]);
      summed.push_back(static_cast<int64_t>(tiled.size()) - 1);
    }
    tiled.push_back(sizes[d]);
  }
  if (!summed.empty()) g = c.b.emit("aten::sum", "dim_IntList", {tensor(c.b.reshape(g, tiled)), summed, false, graph::NoneArg{}});
  c.set(0, g);
}
void rule_diag_embed(RuleCall& c) {  // diag_embed(self, offset, dim1, dim2): the diagonal of grad
  if (c.needs(0)) c.set(0, op(c, "aten::diagonal", {tensor(c.grad()), c.arg(1), c.arg(2), c.arg(3)}));
}
void rule_diagonal(RuleCall& c) {  // diagonal(self, offset, dim1, dim2) and diagonal_copy
  if (c.needs(0))
    c.set(0, op(c, "aten::diagonal_backward", {tensor(c.grad()), c.input_meta(0).sizes, c.arg(1), c.arg(2), c.arg(3)}));
}
void rule_unfold(RuleCall& c) {  // unfold(self, dimension, size, step) and unfold_copy
  if (c.needs(0))
    c.set(0, op(c, "aten::unfold_backward", {tensor(c.grad()), c.input_meta(0).sizes, c.arg(1), c.arg(2), c.arg(3)}));
}
void rule_narrow_copy(RuleCall& c) {  // narrow_copy(self, dim, start, length): grad placed in zeros
  if (!c.needs(0)) return;
  const int64_t dim = normalize_dim(c.int_arg(1), c.input_meta(0).sizes.size());
  int64_t start = c.int_arg(2);
  if (start < 0) start += c.input_meta(0).sizes.at(dim);
  c.set(0, op(c, "aten::slice_scatter", {tensor(new_zeros(c, c.grad(), c.input_meta(0).sizes)), tensor(c.grad()), dim,
                                          start, start + c.int_arg(3), int64_t{1}}));
}
void rule_rot90(RuleCall& c) {  // rot90(self, k, dims): rotated back
  if (c.needs(0)) c.set(0, op(c, "aten::rot90", {tensor(c.grad()), -c.int_arg(1), c.arg(2)}));
}
void rule_pixel_shuffle(RuleCall& c) {
  if (c.needs(0)) c.set(0, op(c, "aten::pixel_unshuffle", {tensor(c.grad()), c.arg(1)}));
}
void rule_pixel_unshuffle(RuleCall& c) {
  if (c.needs(0)) c.set(0, op(c, "aten::pixel_shuffle", {tensor(c.grad()), c.arg(1)}));
}
void rule_channel_shuffle(RuleCall& c) {  // shuffled back with channels / groups groups
  if (c.needs(0)) c.set(0, op(c, "aten::channel_shuffle", {tensor(c.grad()), c.input_meta(0).sizes.at(1) / c.int_arg(1)}));
}
// slice_scatter / select_scatter / diagonal_scatter(self, src, <where>...): self gets grad with the written
// part zeroed, src the written part of grad.
void scatter_view_back(RuleCall& c, const char* scatter, const char* view, const char* view_overload) {
  std::vector<Arg> where(c.node().args.begin() + 2, c.node().args.end());
  if (c.needs(0)) {
    std::vector<Arg> args = {tensor(c.grad()), tensor(zeros_like(c, c.input(1)))};
    args.insert(args.end(), where.begin(), where.end());
    c.set(0, op(c, scatter, std::move(args)));
  }
  if (c.needs(1)) {
    std::vector<Arg> args = {tensor(c.grad())};
    args.insert(args.end(), where.begin(), where.end());
    c.set(1, op(c, view, std::move(args), view_overload));
  }
}
void rule_slice_scatter(RuleCall& c) { scatter_view_back(c, "aten::slice_scatter", "aten::slice", "Tensor"); }
void rule_select_scatter(RuleCall& c) { scatter_view_back(c, "aten::select_scatter", "aten::select", "int"); }
void rule_diagonal_scatter(RuleCall& c) { scatter_view_back(c, "aten::diagonal_scatter", "aten::diagonal", "default"); }

// ---- losses, pooling, padding, sampling: ATen backwards --------------------------------------------------
void rule_binary_cross_entropy(RuleCall& c) {  // (self, target, weight?, reduction)
  if (c.needs(1)) KILN_UNSUPPORTED() << "binary_cross_entropy with a target that requires grad";
  if (c.needs(0))
    c.set(0, op(c, "aten::binary_cross_entropy_backward", {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), optional_tensor(c, 2), c.arg(3)}));
}
void rule_soft_margin_loss(RuleCall& c) {  // (self, target, reduction)
  if (c.needs(1)) KILN_UNSUPPORTED() << "soft_margin_loss with a target that requires grad";
  if (c.needs(0))
    c.set(0, op(c, "aten::soft_margin_loss_backward", {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), c.arg(2)}));
}
// backward(grad, self, <forward args 1..n>) for ops whose backward repeats the forward's arguments.
void backward_with_args(RuleCall& c, const char* backward, size_t last_arg, bool indices_last) {
  if (!c.needs(0)) return;
  std::vector<Arg> args = {tensor(c.grad()), tensor(c.input(0))};
  for (size_t a = 1; a <= last_arg; ++a) args.push_back(c.arg(a));
  if (indices_last) args.push_back(tensor(c.result(1)));
  c.set(0, op(c, backward, std::move(args)));
}
void rule_max_pool3d(RuleCall& c) { backward_with_args(c, "aten::max_pool3d_with_indices_backward", 5, true); }
void rule_avg_pool3d(RuleCall& c) { backward_with_args(c, "aten::avg_pool3d_backward", 6, false); }
void rule_adaptive_max_pool2d(RuleCall& c) { backward_with_args(c, "aten::adaptive_max_pool2d_backward", 0, true); }
void rule_adaptive_max_pool3d(RuleCall& c) { backward_with_args(c, "aten::adaptive_max_pool3d_backward", 0, true); }
void rule_adaptive_avg_pool3d(RuleCall& c) { backward_with_args(c, "aten::_adaptive_avg_pool3d_backward", 0, false); }
void rule_reflection_pad1d(RuleCall& c) { backward_with_args(c, "aten::reflection_pad1d_backward", 1, false); }
void rule_replication_pad1d(RuleCall& c) { backward_with_args(c, "aten::replication_pad1d_backward", 1, false); }
void rule_replication_pad2d(RuleCall& c) { backward_with_args(c, "aten::replication_pad2d_backward", 1, false); }
void rule_reflection_pad2d(RuleCall& c) { backward_with_args(c, "aten::reflection_pad2d_backward", 1, false); }
void rule_reflection_pad3d(RuleCall& c) { backward_with_args(c, "aten::reflection_pad3d_backward", 1, false); }
void rule_replication_pad3d(RuleCall& c) { backward_with_args(c, "aten::replication_pad3d_backward", 1, false); }
void rule_pdist(RuleCall& c) {  // _pdist_forward(self, p)
  if (c.needs(0)) c.set(0, op(c, "aten::_pdist_backward", {tensor(c.grad()), tensor(c.input(0)), c.arg(1), tensor(c.result(0))}));
}
void rule_cdist(RuleCall& c) {  // _cdist_forward(x1, x2, p, compute_mode)
  if (c.needs(0))
    c.set(0, op(c, "aten::_cdist_backward", {tensor(contiguous(c, c.grad())), tensor(c.input(0)), tensor(c.input(1)), c.arg(2), tensor(c.result(0))}));
  if (c.needs(1))
    c.set(1, op(c, "aten::_cdist_backward", {tensor(contiguous(c, c.b.transpose(c.grad(), -2, -1))), tensor(c.input(1)), tensor(c.input(0)), c.arg(2),
                                             tensor(contiguous(c, c.b.transpose(c.result(0), -2, -1)))}));
}
// _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim) (nn.Bilinear): each input's gradient is the
// same contraction with the gradient in its place, the gradient taking sumdim's role and the input's expand dims
// becoming the summed ones (eager's _trilinear_backward).
void rule_trilinear(RuleCall& c) {
  const Arg e1 = c.arg(3), e2 = c.arg(4), e3 = c.arg(5), sum = c.arg(6);
  auto trilinear = [&](ValueId a, ValueId b, ValueId d, Arg x1, Arg x2, Arg x3, Arg summed) {
    return op(c, "aten::_trilinear", {tensor(a), tensor(b), tensor(d), std::move(x1), std::move(x2), std::move(x3), std::move(summed), int64_t{1}});
  };
  ValueId g = c.grad();
  if (c.needs(0)) c.set(0, trilinear(g, c.input(1), c.input(2), sum, e2, e3, e1));
  if (c.needs(1)) c.set(1, trilinear(c.input(0), g, c.input(2), e1, sum, e3, e2));
  if (c.needs(2)) c.set(2, trilinear(c.input(0), c.input(1), g, e1, e2, sum, e3));
}
// max_unpool2d / 3d(self, indices, output_size, ...): self gets the gradient at the places it was written to (grad
// gathered at indices over the flattened spatial dims).
void max_unpool_back(RuleCall& c, size_t spatial) {
  if (!c.needs(0)) return;
  const std::vector<int64_t>& index_sizes = c.input_meta(1).sizes;
  const std::vector<int64_t>& grad_sizes = c.b.meta(c.grad()).sizes;
  if (index_sizes.size() < spatial || grad_sizes.size() != index_sizes.size()) KILN_UNSUPPORTED() << "max_unpool shapes";
  auto flattened = [&](const std::vector<int64_t>& sizes) {
    std::vector<int64_t> out(sizes.begin(), sizes.end() - static_cast<std::ptrdiff_t>(spatial));
    int64_t n = 1;
    for (size_t d = sizes.size() - spatial; d < sizes.size(); ++d) n *= sizes[d];
    out.push_back(n);
    return out;
  };
  ValueId grad = c.b.reshape(contiguous(c, c.grad()), flattened(grad_sizes));
  ValueId index = c.b.reshape(c.input(1), flattened(index_sizes));
  c.set(0, c.b.reshape(op(c, "aten::gather", {tensor(grad), int64_t{-1}, tensor(index), false}), index_sizes));
}
void rule_max_unpool2d(RuleCall& c) { max_unpool_back(c, 2); }
void rule_max_unpool3d(RuleCall& c) { max_unpool_back(c, 3); }
void rule_im2col(RuleCall& c) {  // im2col(self, kernel, dilation, padding, stride) -> col2im of grad
  if (!c.needs(0)) return;
  const std::vector<int64_t>& sizes = c.input_meta(0).sizes;
  const std::vector<int64_t> spatial = {sizes.at(sizes.size() - 2), sizes.back()};
  c.set(0, op(c, "aten::col2im", {tensor(c.grad()), spatial, c.arg(1), c.arg(2), c.arg(3), c.arg(4)}));
}
void rule_col2im(RuleCall& c) {  // col2im(self, output_size, kernel, dilation, padding, stride) -> im2col of grad
  if (c.needs(0))
    c.set(0, op(c, "aten::im2col", {tensor(c.grad()), c.arg(2), c.arg(3), c.arg(4), c.arg(5)}));
}
void rule_upsample_nearest_exact1d(RuleCall& c) {  // (self, output_size, scales?)
  if (c.needs(0))
    c.set(0, op(c, "aten::_upsample_nearest_exact1d_backward", {tensor(c.grad()), c.arg(1), c.input_meta(0).sizes, c.arg(2)}));
}
// grid_sampler_2d / 3d(input, grid, interpolation, padding, align_corners) -> (grad_input, grad_grid)
void grid_sampler_back(RuleCall& c, const char* backward) {
  const std::vector<bool> mask = {c.needs(0), c.needs(1)};
  auto grads = c.b.emit_all(backward, "default", {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1)), c.arg(2), c.arg(3), c.arg(4), mask});
  set_masked(c, grads, {0, 1}, mask);
}
void rule_grid_sampler_2d(RuleCall& c) { grid_sampler_back(c, "aten::grid_sampler_2d_backward"); }
void rule_grid_sampler_3d(RuleCall& c) { grid_sampler_back(c, "aten::grid_sampler_3d_backward"); }
void rule_prelu_kernel(RuleCall& c) {  // _prelu_kernel(self, weight) -> _prelu_kernel_backward: (self, weight)
  auto grads = c.b.emit_all("aten::_prelu_kernel_backward", "default", {tensor(c.grad()), tensor(c.input(0)), tensor(c.input(1))});
  set_masked(c, grads, {0, 1}, {c.needs(0), c.needs(1)});
}

}  // namespace

void add_indexing_rules(std::map<std::string, DerivativeRule>& t) {
  const std::map<std::string, DerivativeRule> indexing = {
      {"aten::scatter_reduce.two", {rule_scatter_reduce}},
      {"aten::scatter.src", {rule_scatter_src}},
      {"aten::scatter.value", {rule_scatter_value}},
      {"aten::scatter_add.default", {rule_scatter_add}},
      {"aten::index_add.default", {rule_index_add}},
      {"aten::index_copy.default", {rule_index_copy}},
      {"aten::index_fill.int_Scalar", {rule_index_fill}},
      {"aten::masked_scatter.default", {rule_masked_scatter}},
      {"aten::take.default", {rule_take}},
      {"aten::put.default", {rule_put}},
      {"aten::index_put.default", {rule_index_put}},
      {"aten::index.Tensor", {rule_index}},
      {"aten::repeat.default", {rule_repeat}},
      {"aten::diag_embed.default", {rule_diag_embed}},
      {"aten::diagonal.default", {rule_diagonal}},
      {"aten::diagonal_copy.default", {rule_diagonal}},
      {"aten::unfold.default", {rule_unfold}},
      {"aten::unfold_copy.default", {rule_unfold}},
      {"aten::narrow_copy.default", {rule_narrow_copy}},
      {"aten::rot90.default", {rule_rot90}},
      {"aten::pixel_shuffle.default", {rule_pixel_shuffle}},
      {"aten::pixel_unshuffle.default", {rule_pixel_unshuffle}},
      {"aten::channel_shuffle.default", {rule_channel_shuffle}},
      {"aten::slice_scatter.default", {rule_slice_scatter}},
      {"aten::select_scatter.default", {rule_select_scatter}},
      {"aten::diagonal_scatter.default", {rule_diagonal_scatter}},
      {"aten::binary_cross_entropy.default", {rule_binary_cross_entropy}},
      {"aten::soft_margin_loss.default", {rule_soft_margin_loss}},
      {"aten::max_pool3d_with_indices.default", {rule_max_pool3d}},
      {"aten::avg_pool3d.default", {rule_avg_pool3d}},
      {"aten::adaptive_max_pool2d.default", {rule_adaptive_max_pool2d}},
      {"aten::adaptive_max_pool3d.default", {rule_adaptive_max_pool3d}},
      {"aten::_adaptive_avg_pool3d.default", {rule_adaptive_avg_pool3d}},
      {"aten::reflection_pad1d.default", {rule_reflection_pad1d}},
      {"aten::replication_pad1d.default", {rule_replication_pad1d}},
      {"aten::replication_pad2d.default", {rule_replication_pad2d}},
      {"aten::reflection_pad2d.default", {rule_reflection_pad2d}},
      {"aten::reflection_pad3d.default", {rule_reflection_pad3d}},
      {"aten::replication_pad3d.default", {rule_replication_pad3d}},
      {"aten::_pdist_forward.default", {rule_pdist}},
      {"aten::_cdist_forward.default", {rule_cdist}},
      {"aten::im2col.default", {rule_im2col}},
      {"aten::col2im.default", {rule_col2im}},
      {"aten::_trilinear.default", {rule_trilinear}},
      {"aten::max_unpool2d.default", {rule_max_unpool2d}},
      {"aten::max_unpool3d.default", {rule_max_unpool3d}},
      {"aten::_upsample_nearest_exact1d.default", {rule_upsample_nearest_exact1d}},
      {"aten::grid_sampler_2d.default", {rule_grid_sampler_2d}},
      {"aten::grid_sampler_3d.default", {rule_grid_sampler_3d}},
      {"aten::_prelu_kernel.default", {rule_prelu_kernel}},
  };
  t.insert(indexing.begin(), indexing.end());
  // The *_copy variants of view ops (functional forms, same arguments) take their view op's rule.
  const std::map<std::string, std::string> copies = {
      {"aten::view_copy.default", "aten::view.default"},
      {"aten::t_copy.default", "aten::t.default"},
      {"aten::permute_copy.default", "aten::permute.default"},
      {"aten::transpose_copy.int", "aten::transpose.int"},
      {"aten::expand_copy.default", "aten::expand.default"},
      {"aten::squeeze_copy.default", "aten::squeeze.default"},
      {"aten::unsqueeze_copy.default", "aten::unsqueeze.default"},
      {"aten::alias_copy.default", "aten::alias.default"},
      {"aten::split_with_sizes_copy.default", "aten::split_with_sizes.default"},
      {"aten::unsafe_split.Tensor", "aten::split.Tensor"},
      {"aten::unbind_copy.int", "aten::unbind.int"},
  };
  for (const auto& [copy, view] : copies) {
    auto found = t.find(view);
    KILN_ASSERT(found != t.end()) << "no derivative rule for " << view << ", which " << copy << " shares";
    t.emplace(copy, found->second);
  }
}

}  // namespace kiln::autodiff::detail
