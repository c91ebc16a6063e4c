// Shape rules of the ops that copy their input into a new shape or order: tril/triu, repeat, flip, roll,
// constant_pad_nd and 2-d upsampling.
//
// Design note: the recorder takes these metas from torch's meta kernels, whose layouts are the rules' layouts: flip
// keeps its input's (empty_like), constant_pad_nd and upsampling take its suggested memory format, the others are
// contiguous (roll too, where eager keeps a channels-last input's).
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

// tril / triu(self, diagonal): a matrix or a batch of them, contiguous.
void triangle_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() >= 2, "fewer than 2 dims");
  call.int_arg(1);
  no_empty(call, x.sizes);
  // (the meta kernel orders size-1 dims by their strides, which are arbitrary: left to torch)
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 1), "a dim of size 1");
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
}

// repeat(self, repeats): self's sizes (ones in front) times the repeats, contiguous.
void repeat_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> repeats = call.int_list(1);
  call.check(static_cast<int64_t>(repeats.size()) >= x.dim(), "fewer repeats than dims");
  const size_t lead = repeats.size() - x.sizes.size();
  std::vector<Expr> sizes;
  for (size_t i = 0; i < repeats.size(); ++i) sizes.push_back(repeats[i] * (i < lead ? Expr(1) : x.sizes[i - lead]));
  no_empty(call, x.sizes);
  call.add_output(contiguous_meta(allocated_sizes(call, sizes), x.dtype, x.device));
}

// flip(self, dims): empty_like(self).
void flip_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  for (int64_t d : call.const_int_list(1)) wrap_dim(call, d, x.dim());
  no_empty(call, x.sizes);
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 1), "a dim of size 1 (placed by its arbitrary stride)");
  call.add_output(make_meta(x.sizes, empty_like_strides(call, x, std::nullopt), x.dtype, x.device));
}

// roll(self, shifts, dims): contiguous (the meta kernel's).
void roll_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> shifts = call.int_list(1);
  std::vector<int64_t> dims = call.const_int_list(2);
  call.check(!shifts.empty() && (dims.empty() ? shifts.size() == 1 : dims.size() == shifts.size()), "shifts and dims");
  for (int64_t d : dims) wrap_dim(call, d, x.dim());
  no_empty(call, x.sizes);
  call.add_output(contiguous_meta(x.sizes, x.dtype, x.device));
}

// constant_pad_nd(self, pad, value): pad holds (before, after) pairs from the last dim back; negative pads crop.
void constant_pad_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> pad = call.int_list(1);
  call.check(pad.size() % 2 == 0 && static_cast<int64_t>(pad.size() / 2) <= x.dim(), "pad's length");
  call.check(call.is_number_arg(2), "a value that is not a number");
  no_empty(call, x.sizes);
  std::vector<Expr> sizes = x.sizes;
  for (size_t i = 0; i < pad.size() / 2; ++i) {
    Expr& size = sizes[x.dim() - 1 - i];
    size = size + pad[2 * i] + pad[2 * i + 1];
  }
  sizes = allocated_sizes(call, sizes);
  no_empty(call, sizes);
  call.add_output(make_meta(sizes, suggested_format_strides(call, sizes, x), x.dtype, x.device));
}

// upsample_nearest2d(input, output_size, scales_h, scales_w) / upsample_bilinear2d(input, output_size,
// align_corners, scales_h, scales_w): (N, C) and the output size, in the input's suggested memory format. The .vec
// forms with an output size (scale factors alone size the output by a double's floor: no rule).
void upsample2d_rule(RuleCall& call, bool vec) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() == 4 && is_floating(x.dtype), "rank or dtype");
  call.check(!call.is_none(1), "scale factors without an output size");
  std::vector<Expr> output_size = call.int_list(1);
  call.check(output_size.size() == 2, "output_size of the wrong length");
  if (vec) call.check(call.is_none(call.num_args() - 1), "both an output size and scale factors");
  no_empty(call, x.sizes);
  std::vector<Expr> sizes = {x.sizes[0], x.sizes[1]};
  for (const Expr& s : output_size) {
    call.check(call.le(1, s, "an output size"), "an output size below 1");
    sizes.push_back(s);
  }
  call.add_output(make_meta(sizes, suggested_format_strides(call, sizes, x), x.dtype, x.device));
}

}  // namespace

void register_copy_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  add("tril.default", triangle_rule);
  add("triu.default", triangle_rule);
  add("repeat.default", repeat_rule);
  add("flip.default", flip_rule);
  add("roll.default", roll_rule);
  add("constant_pad_nd.default", constant_pad_rule);
  add("upsample_nearest2d.default", [](RuleCall& call) { upsample2d_rule(call, false); });
  add("upsample_bilinear2d.default", [](RuleCall& call) { upsample2d_rule(call, false); });
  add("upsample_nearest2d.vec", [](RuleCall& call) { upsample2d_rule(call, true); });
  add("upsample_bilinear2d.vec", [](RuleCall& call) { upsample2d_rule(call, true); });
}

}  // namespace kiln::graph::shape
