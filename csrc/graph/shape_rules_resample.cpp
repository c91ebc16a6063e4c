// Shape rules of the ops that resample their input onto a new grid: reflection and replication padding, 1-d,
// 3-d, bicubic and nearest-exact upsampling, pixel (un)shuffle, im2col / col2im (F.unfold / F.fold), adaptive
// pooling beside the 2-d average, cdist, and the linspace / logspace factories.
//
// Design note: the recorder takes these metas from torch's meta kernels, so the rules give their layouts: padding,
// 1-d upsampling, pixel shuffle, im2col, col2im, 3-d adaptive averaging and cdist are contiguous whatever the input;
// 2-d and 3-d upsampling and 2-d adaptive max pooling take the input's suggested memory format. Where a meta kernel's
// layout follows a rule this file does not write (pixel_unshuffle of a channels-last input), the rule refuses and the
// op specialises. cdist's composite picks its algorithm by size (a matrix product for p = 2 past 25 rows), so the
// direct kernel's rule guards the sizes that chose it.
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

// The input of an op over `spatial` trailing dims, with or without a batch dim in front of the channels.
const SymTensorMeta& batched_input(RuleCall& call, int64_t spatial, bool floating = true) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() == spatial + 1 || x.dim() == spatial + 2, "rank");
  if (floating) call.check(is_floating(x.dtype), "dtype");
  no_empty(call, x.sizes);
  return x;
}

// reflection_pad{1,2,3}d / replication_pad{1,2,3}d(self, padding): (left, right) pairs from the last dim back.
// Reflection needs each pad below its dim's size; replication any pads that leave a dim.
void pad_rule(RuleCall& call, int64_t spatial, bool reflect) {
  const SymTensorMeta& x = batched_input(call, spatial, false);
  std::vector<Expr> pad = call.int_list(1);
  call.check(static_cast<int64_t>(pad.size()) == 2 * spatial, "padding's length");
  std::vector<Expr> sizes = x.sizes;
  for (int64_t i = 0; i < spatial; ++i) {
    Expr& size = sizes[x.dim() - 1 - i];
    const Expr &before = pad[2 * i], &after = pad[2 * i + 1];
    if (reflect) {
      call.require_lt(before, size, "reflection padding against its dim");
      call.require_lt(after, size, "reflection padding against its dim");
    }
    size = size + before + after;
    call.require_le(1, size, "a padded size");
  }
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

// upsample_*(self, output_size, [align_corners,] scales...): (N, C) and the output size. 1-d results are
// contiguous; 2-d and 3-d ones in the input's suggested memory format.
void upsample_rule(RuleCall& call, int64_t spatial) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() == spatial + 2 && is_floating(x.dtype), "rank or dtype");
  std::vector<Expr> output_size = call.int_list(1);
  call.check(static_cast<int64_t>(output_size.size()) == spatial, "output_size of the wrong length");
  no_empty(call, x.sizes);
  std::vector<Expr> sizes = {x.sizes[0], x.sizes[1]};
  for (const Expr& s : output_size) {
    call.check(call.le(1, s, "an output size"), "an output size below 1");
    sizes.push_back(s);
  }
  call.add_output(make_meta(sizes, spatial == 1 ? contiguous_strides(sizes) : suggested_format_strides(call, sizes, x),
                            x.dtype, x.device));
}

// pixel_shuffle(self, r): [..., C*r*r, H, W] -> [..., C, H*r, W*r]; pixel_unshuffle the inverse. Contiguous inputs
// only (a channels-last one keeps its layout through pixel_unshuffle's meta kernel, not through pixel_shuffle's).
void pixel_shuffle_rule(RuleCall& call, bool shuffle) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() >= 3, "fewer than 3 dims");
  const int64_t r = call.const_int(1);
  call.check(r > 0, "a factor below 1");
  no_empty(call, x.sizes);
  call.check(is_contiguous(call, x), "a non-contiguous input");
  std::vector<Expr> sizes = x.sizes;
  Expr &c = sizes[x.dim() - 3], &h = sizes[x.dim() - 2], &w = sizes[x.dim() - 1];
  if (shuffle) {
    call.require_divisible(c, r * r, "pixel_shuffle's channels by the factor squared");
    c = exact_quotient(c, Expr(r * r)).value_or(sym::floordiv(c, r * r));
    h = h * r;
    w = w * r;
  } else {
    call.require_divisible(h, r, "pixel_unshuffle's height by the factor");
    call.require_divisible(w, r, "pixel_unshuffle's width by the factor");
    c = c * (r * r);
    h = exact_quotient(h, Expr(r)).value_or(sym::floordiv(h, r));
    w = exact_quotient(w, Expr(r)).value_or(sym::floordiv(w, r));
  }
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

// A sliding window's count along one dim: (size + 2*padding - dilation*(kernel-1) - 1) / stride + 1, at least 1.
Expr windows(RuleCall& call, const Expr& size, int64_t kernel, int64_t dilation, int64_t padding, int64_t stride) {
  call.check(kernel > 0 && dilation > 0 && stride > 0 && padding >= 0, "kernel, dilation, padding or stride");
  Expr count = sym::floordiv(size + (2 * padding - dilation * (kernel - 1) - 1), stride) + 1;
  call.require_le(1, count, "a sliding window's count");
  return count;
}

std::vector<int64_t> pair_of(RuleCall& call, size_t i) {
  std::vector<int64_t> v = call.const_int_list(i);
  call.check(v.size() == 2, "a window parameter of the wrong length");
  return v;
}

// im2col(self, kernel_size, dilation, padding, stride): [N, C, H, W] -> [N, C*kh*kw, L], contiguous.
void im2col_rule(RuleCall& call) {
  const SymTensorMeta& x = batched_input(call, 2);
  const std::vector<int64_t> k = pair_of(call, 1), d = pair_of(call, 2), p = pair_of(call, 3), s = pair_of(call, 4);
  const bool batched = x.dim() == 4;
  const int64_t h = x.dim() - 2, w = x.dim() - 1;
  Expr blocks = windows(call, x.sizes[h], k[0], d[0], p[0], s[0]) * windows(call, x.sizes[w], k[1], d[1], p[1], s[1]);
  std::vector<Expr> sizes;
  if (batched) sizes.push_back(x.sizes[0]);
  sizes.push_back(x.sizes[x.dim() - 3] * (k[0] * k[1]));
  sizes.push_back(blocks);
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

// col2im(self, output_size, kernel_size, dilation, padding, stride): [N, C*kh*kw, L] -> [N, C, H, W], contiguous;
// L must be the number of windows over the output size.
void col2im_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check((x.dim() == 2 || x.dim() == 3) && is_floating(x.dtype), "rank or dtype");
  no_empty(call, x.sizes);
  std::vector<Expr> output_size = call.int_list(1);
  call.check(output_size.size() == 2, "output_size of the wrong length");
  const std::vector<int64_t> k = pair_of(call, 2), d = pair_of(call, 3), p = pair_of(call, 4), s = pair_of(call, 5);
  const bool batched = x.dim() == 3;
  const Expr& columns = x.sizes[x.dim() - 2];
  call.require_divisible(columns, k[0] * k[1], "col2im's columns by the kernel's size");
  Expr blocks = windows(call, output_size[0], k[0], d[0], p[0], s[0]) * windows(call, output_size[1], k[1], d[1], p[1], s[1]);
  call.require_eq(x.sizes[x.dim() - 1], blocks, "col2im's blocks against the output size");
  std::vector<Expr> sizes;
  if (batched) sizes.push_back(x.sizes[0]);
  sizes.push_back(exact_quotient(columns, Expr(k[0] * k[1])).value_or(sym::floordiv(columns, k[0] * k[1])));
  sizes.push_back(output_size[0]);
  sizes.push_back(output_size[1]);
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

// The output sizes of an adaptive pool over `spatial` trailing dims: the leading dims, then output_size.
std::vector<Expr> adaptive_sizes(RuleCall& call, const SymTensorMeta& x, int64_t spatial) {
  std::vector<Expr> output_size = call.int_list(1);
  call.check(static_cast<int64_t>(output_size.size()) == spatial, "output_size of the wrong length");
  std::vector<Expr> sizes(x.sizes.begin(), x.sizes.end() - spatial);
  for (const Expr& s : output_size) {
    call.check(call.le(1, s, "an output size"), "an output size below 1");
    sizes.push_back(s);
  }
  return sizes;
}

// adaptive_max_pool2d(self, output_size): values and int64 indices in the input's suggested memory format.
void adaptive_max_pool2d_rule(RuleCall& call) {
  const SymTensorMeta& x = batched_input(call, 2);
  std::vector<Expr> sizes = adaptive_sizes(call, x, 2);
  std::vector<Expr> strides = suggested_format_strides(call, sizes, x);
  call.add_output(make_meta(sizes, strides, x.dtype, x.device));
  call.add_output(make_meta(sizes, strides, ScalarType::Long, x.device));
}

// _adaptive_avg_pool3d(self, output_size): contiguous for contiguous inputs (a channels-last-3d one refuses).
void adaptive_avg_pool3d_rule(RuleCall& call) {
  const SymTensorMeta& x = batched_input(call, 3);
  call.check(is_contiguous(call, x), "a non-contiguous input");
  call.add_output(contiguous_meta(adaptive_sizes(call, x, 3), x.dtype, x.device));
}

// _cdist_forward(x1, x2, p, compute_mode): [*, P, M] and [*, R, M] -> [*, P, R] (batch dims broadcast), contiguous.
// torch.cdist reaches this kernel for p = 2 only while both row counts are at most 25 (or when told to by
// compute_mode 2), so those bounds are the graph's to keep.
void cdist_rule(RuleCall& call) {
  const SymTensorMeta &a = call.tensor(0), &b = call.tensor(1);
  call.check(a.dim() >= 2 && b.dim() >= 2 && is_floating(a.dtype) && a.dtype == b.dtype, "ranks or dtypes");
  std::optional<double> p = call.number(2);
  call.check(p.has_value() && *p >= 0, "p");
  no_empty(call, a.sizes);
  no_empty(call, b.sizes);
  const int64_t mode = call.is_none(3) ? 0 : call.const_int(3);
  const Expr &rows_a = a.sizes[a.dim() - 2], &rows_b = b.sizes[b.dim() - 2];
  if (*p == 2 && mode == 0) {
    call.require_le(rows_a, 25, "cdist's rows for its direct kernel");
    call.require_le(rows_b, 25, "cdist's rows for its direct kernel");
  }
  call.check(!(*p == 2 && mode == 1), "compute_mode 1 (a matrix product)");
  call.require_eq(a.sizes[a.dim() - 1], b.sizes[b.dim() - 1], "cdist's feature dims");
  std::vector<Expr> sizes = broadcast_shape(call, {std::vector<Expr>(a.sizes.begin(), a.sizes.end() - 2),
                                                   std::vector<Expr>(b.sizes.begin(), b.sizes.end() - 2)});
  sizes.push_back(rows_a);
  sizes.push_back(rows_b);
  call.add_output(contiguous_meta(sizes, a.dtype, a.device));
}

// linspace(start, end, steps, dtype, layout, device, pin_memory) and logspace(start, end, steps, base, dtype, ...):
// [steps] of the dtype given, else torch's default (number bounds only: the Tensor overloads are left to torch).
void spaced_rule(RuleCall& call, size_t options_from) {
  call.check(call.is_number_arg(0) && call.is_number_arg(1), "bounds that are not numbers");
  call.check(!std::holds_alternative<bool>(call.arg(0)) && !std::holds_alternative<bool>(call.arg(1)), "bool bounds");
  if (options_from == 4) call.check(call.is_number_arg(3), "a base that is not a number");
  TensorOptions options = tensor_options(call, options_from, kDefaultDtype, Device{});
  call.check(options.dtype != ScalarType::Bool, "a bool result");
  call.add_output(contiguous_meta(allocated_sizes(call, {call.int_arg(2)}), options.dtype, options.device));
}

}  // namespace

void register_resample_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  for (int64_t n = 1; n <= 3; ++n) {
    const std::string d = std::to_string(n) + "d.default";
    add("reflection_pad" + d, [n](RuleCall& call) { pad_rule(call, n, true); });
    add("replication_pad" + d, [n](RuleCall& call) { pad_rule(call, n, false); });
  }
  for (const char* op : {"upsample_nearest1d.default", "_upsample_nearest_exact1d.default", "upsample_linear1d.default"})
    add(op, [](RuleCall& call) { upsample_rule(call, 1); });
  for (const char* op : {"upsample_bicubic2d.default", "_upsample_nearest_exact2d.default",
                         "_upsample_bilinear2d_aa.default", "_upsample_bicubic2d_aa.default"})
    add(op, [](RuleCall& call) { upsample_rule(call, 2); });
  for (const char* op : {"upsample_nearest3d.default", "_upsample_nearest_exact3d.default", "upsample_trilinear3d.default"})
    add(op, [](RuleCall& call) { upsample_rule(call, 3); });
  add("pixel_shuffle.default", [](RuleCall& call) { pixel_shuffle_rule(call, true); });
  add("pixel_unshuffle.default", [](RuleCall& call) { pixel_shuffle_rule(call, false); });
  add("im2col.default", im2col_rule);
  add("col2im.default", col2im_rule);
  add("adaptive_max_pool2d.default", adaptive_max_pool2d_rule);
  add("_adaptive_avg_pool3d.default", adaptive_avg_pool3d_rule);
  add("_cdist_forward.default", cdist_rule);
  add("linspace.default", [](RuleCall& call) { spaced_rule(call, 3); });
  add("logspace.default", [](RuleCall& call) { spaced_rule(call, 4); });
}

}  // namespace kiln::graph::shape
