// Shape rules of views (view, reshape, permute, transpose, expand, (un)squeeze, slice, select, narrow, split,
// chunk, unbind) and of cat and stack.
//
// Design note: a view keeps its base's storage, so its strides and storage offset are expressions over the base's.
// Indices that may be negative (slice's start, select's index) are decided by sign; slice's clamping to the dim's
// size is written as min/max, which is exact for every binding. The number of outputs of split, chunk and unbind
// is a constant of the graph: where a symbolic size decides it, its value at the hints is assumed (guarded).
#include "graph/shape_rules_impl.h"

#include <algorithm>
#include <optional>

namespace kiln::graph::shape {

namespace {

void no_empty(RuleCall& call, const SymTensorMeta& x) {
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty tensor");
}

SymTensorMeta view_of(const SymTensorMeta& x, std::vector<Expr> sizes, std::vector<Expr> strides, Expr offset) {
  return make_meta(std::move(sizes), std::move(strides), x.dtype, x.device, std::move(offset));
}

// c10's computeStride: the strides of `x` viewed with `sizes` (the same element count), where each output dim lies in
// one run of input dims whose strides nest (a "chunk"); nullopt where eager's view raises and reshape copies.
std::optional<std::vector<Expr>> view_strides(RuleCall& call, const SymTensorMeta& x, const std::vector<Expr>& sizes) {
  if (x.dim() == 0) return std::vector<Expr>(sizes.size(), Expr(1));
  std::vector<Expr> strides(sizes.size());
  int64_t view_d = static_cast<int64_t>(sizes.size()) - 1;
  Expr chunk_base = x.strides.back(), tensor_numel = 1, view_numel = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    tensor_numel = tensor_numel * x.sizes[d];
    const bool chunk_ends = d == 0 || (!call.size_is(x.sizes[d - 1], 1) &&
                                       !call.eq(x.strides[d - 1], tensor_numel * chunk_base, "a chunk's stride"));
    if (!chunk_ends) continue;
    while (view_d >= 0 && (call.lt(view_numel, tensor_numel, "a view dim against its chunk") ||
                           call.size_is(sizes[view_d], 1))) {
      strides[view_d] = view_numel * chunk_base;
      view_numel = view_numel * sizes[view_d];
      --view_d;
    }
    if (!call.eq(view_numel, tensor_numel, "a chunk's element count")) return std::nullopt;
    if (d > 0) {
      chunk_base = x.strides[d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

// view / _unsafe_view / reshape: -1 inferred, the element count required; a contiguous input gives contiguous strides,
// any other c10's computeStride's, and where those do not exist view refuses (eager raises) and reshape copies.
void view_rule(RuleCall& call, bool reshape) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> sizes = call.int_list(1);
  no_empty(call, x);
  Expr numel = product(x.sizes);
  int64_t infer = -1;
  Expr known = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Expr s = call.simplify(sizes[i]);
    if (s.is_constant() && s.constant_value() == -1) {
      call.check(infer < 0, "two -1 sizes");
      infer = static_cast<int64_t>(i);
      continue;
    }
    call.check(call.le(1, s, "a view size against 1"), "a view size below 1");
    known = known * s;
  }
  if (infer >= 0) {
    if (auto q = exact_quotient(numel, known)) {
      sizes[infer] = *q;
    } else {
      call.require_divisible(numel, known, "view's -1");
      sizes[infer] = sym::floordiv(numel, known);
    }
  } else {
    call.require_eq(known, numel, "view's element count");
  }
  // (c10's computeStride starts from the last dim's stride even when that dim has size 1.)
  if (is_contiguous(call, x) && (x.dim() == 0 || call.eq(x.strides.back(), 1, "the last stride"))) {
    call.add_output(view_of(x, sizes, contiguous_strides(sizes), x.storage_offset));
    return;
  }
  if (std::optional<std::vector<Expr>> strides = view_strides(call, x, sizes)) {
    call.add_output(view_of(x, sizes, *strides, x.storage_offset));
    return;
  }
  call.check(reshape, "a view across non-contiguous dims");  // (eager raises)
  call.add_output(contiguous_meta(sizes, x.dtype, x.device));
}

void permute_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<int64_t> dims = call.const_int_list(1);
  call.check(static_cast<int64_t>(dims.size()) == x.dim(), "permute's dims do not match the rank");
  std::vector<bool> seen(x.dim(), false);
  std::vector<Expr> sizes, strides;
  for (int64_t d : dims) {
    d = wrap_dim(call, d, x.dim());
    call.check(!seen[d], "a repeated dim");
    seen[d] = true;
    sizes.push_back(x.sizes[d]);
    strides.push_back(x.strides[d]);
  }
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

void transpose(RuleCall& call, const SymTensorMeta& x, int64_t dim0, int64_t dim1) {
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  if (x.dim() > 0) {
    dim0 = wrap_dim(call, dim0, x.dim());
    dim1 = wrap_dim(call, dim1, x.dim());
    std::swap(sizes[dim0], sizes[dim1]);
    std::swap(strides[dim0], strides[dim1]);
  }
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

void expand_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> target = call.int_list(1);
  const int64_t ndim = static_cast<int64_t>(target.size());
  call.check(ndim >= x.dim(), "expand to fewer dims");
  std::vector<Expr> sizes(ndim), strides(ndim);
  for (int64_t i = ndim - 1; i >= 0; --i) {
    int64_t dim = x.dim() - (ndim - i);
    Expr size = dim >= 0 ? x.sizes[dim] : Expr(1);
    Expr stride = dim >= 0 ? x.strides[dim] : (i == ndim - 1 ? Expr(1) : sizes[i + 1] * strides[i + 1]);
    Expr want = call.simplify(target[i]);
    if (want.is_constant() && want.constant_value() == -1) {
      call.check(dim >= 0, "-1 for a new dim");
      want = size;
    }
    if (call.size_is(size, 1)) {
      if (!call.size_is(want, 1)) {
        size = want;
        stride = 0;
      }
    } else {
      call.require_eq(size, want, "expand of dim " + std::to_string(i));  // (eager raises otherwise)
    }
    sizes[i] = size;
    strides[i] = stride;
  }
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

void unsqueeze_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim() + 1);
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  Expr stride = dim >= x.dim() ? Expr(1) : x.sizes[dim] * x.strides[dim];
  sizes.insert(sizes.begin() + dim, Expr(1));
  strides.insert(strides.begin() + dim, stride);
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

// squeeze of the dims in `dims` (all dims when empty) that have size 1.
void squeeze(RuleCall& call, const SymTensorMeta& x, std::vector<int64_t> dims, bool all) {
  std::vector<bool> chosen(x.dim(), all);
  for (int64_t d : dims) {
    if (x.dim() == 0) {
      wrap_dim(call, d, 0);
      continue;
    }
    chosen[wrap_dim(call, d, x.dim())] = true;
  }
  std::vector<Expr> sizes, strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (chosen[d] && call.size_is(x.sizes[d], 1)) continue;
    sizes.push_back(x.sizes[d]);
    strides.push_back(x.strides[d]);
  }
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

// The view of x along `dim` from `start` (normalised, in [0, size]) with `length` elements taken every `step`.
SymTensorMeta narrowed(const SymTensorMeta& x, int64_t dim, const Expr& start, const Expr& length, int64_t step) {
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  sizes[dim] = length;
  strides[dim] = x.strides[dim] * step;
  return view_of(x, sizes, strides, x.storage_offset + start * x.strides[dim]);
}

// A start or end index clamped as at::slice does: negative counts from the end, then into [0, size].
Expr clamp_index(RuleCall& call, const Expr& index, const Expr& size) {
  Expr i = call.simplify(index);
  if (i.is_constant() && i.constant_value() >= (int64_t{1} << 62)) return size;  // (INT64_MAX: "to the end")
  if (call.lt(i, 0, "the sign of a slice index")) return sym::max(i + size, 0);
  return sym::min(i, size);
}

void slice_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "slice of a 0-d tensor");
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim());
  int64_t step = call.const_int(4);
  call.check(step > 0, "a step below 1");
  const Expr& size = x.sizes[dim];
  Expr start = call.is_none(2) ? Expr(0) : clamp_index(call, call.int_arg(2), size);
  Expr end = call.is_none(3) ? size : clamp_index(call, call.int_arg(3), size);
  end = sym::max(start, end);  // (an end before the start gives an empty slice)
  Expr length = sym::floordiv(end - start + step - 1, step);
  call.add_output(narrowed(x, dim, start, length, step));
}

// A select or narrow index in [-size, size) (or [-size, size] where `inclusive`), made nonnegative.
Expr wrap_index(RuleCall& call, const Expr& index, const Expr& size, bool inclusive, const std::string& what) {
  Expr i = call.simplify(index);
  if (call.lt(i, 0, "the sign of " + what)) {
    call.require_le(-size, i, what + " in range");
    return i + size;
  }
  if (inclusive) {
    call.require_le(i, size, what + " in range");
  } else {
    call.require_lt(i, size, what + " in range");
  }
  return i;
}

void select_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "select of a 0-d tensor");
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim());
  Expr index = wrap_index(call, call.int_arg(2), x.sizes[dim], false, "select's index");
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  call.add_output(view_of(x, sizes, strides, x.storage_offset + index * x.strides[dim]));
}

void narrow_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "narrow of a 0-d tensor");
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim());
  Expr start = wrap_index(call, call.int_arg(2), x.sizes[dim], true, "narrow's start");
  Expr length = call.simplify(call.int_arg(3));
  call.require_le(0, length, "narrow's length");
  call.require_le(start + length, x.sizes[dim], "narrow's end");
  call.add_output(narrowed(x, dim, start, length, 1));
}

// unfold(self, dimension, size, step): dim's windows of `size` every `step`, the window as a new last dim.
void unfold_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "unfold of a 0-d tensor");
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim());
  Expr size = call.simplify(call.int_arg(2));
  int64_t step = call.const_int(3);
  call.check(step > 0, "a step below 1");
  call.require_le(size, x.sizes[dim], "unfold's size against its dim");
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  sizes[dim] = sym::floordiv(x.sizes[dim] - size, step) + 1;
  strides[dim] = x.strides[dim] * step;
  sizes.push_back(size);
  strides.push_back(x.strides[dim]);
  call.add_output(view_of(x, sizes, strides, x.storage_offset));
}

// diagonal(self, offset, dim1, dim2): the two dims become one last dim of stride1 + stride2.
void diagonal_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() >= 2, "diagonal of fewer than 2 dims");
  int64_t offset = call.const_int(1);
  int64_t dim1 = wrap_dim(call, call.const_int(2), x.dim()), dim2 = wrap_dim(call, call.const_int(3), x.dim());
  call.check(dim1 != dim2, "the same dim twice");
  const Expr &size1 = x.sizes[dim1], &size2 = x.sizes[dim2];
  Expr length = offset >= 0 ? sym::min(size1, size2 - offset) : sym::min(size1 + offset, size2);
  call.require_le(1, length, "a diagonal of elements");  // (an empty one would make a size that may be 0)
  Expr start = offset >= 0 ? x.strides[dim2] * offset : x.strides[dim1] * (-offset);
  std::vector<Expr> sizes, strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d == dim1 || d == dim2) continue;
    sizes.push_back(x.sizes[d]);
    strides.push_back(x.strides[d]);
  }
  sizes.push_back(length);
  strides.push_back(x.strides[dim1] + x.strides[dim2]);
  call.add_output(view_of(x, sizes, strides, x.storage_offset + start));
}

// as_strided(self, size, stride, storage_offset) and _reshape_alias(self, size, stride): the given geometry over
// self's storage (the offset self's where none is given).
void as_strided_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  std::vector<Expr> sizes = call.int_list(1), strides = call.int_list(2);
  call.check(sizes.size() == strides.size(), "sizes and strides of different lengths");
  for (const Expr& s : sizes) call.require_le(0, s, "a size");
  Expr offset = call.num_args() > 3 && !call.is_none(3) ? call.int_arg(3) : x.storage_offset;
  call.add_output(view_of(x, sizes, strides, offset));
}

// The pieces of `dim` of the given lengths, in order.
void pieces(RuleCall& call, const SymTensorMeta& x, int64_t dim, const std::vector<Expr>& lengths) {
  Expr start = 0;
  for (const Expr& length : lengths) {
    call.add_output(narrowed(x, dim, start, length, 1));
    start = start + length;
  }
}

// split into pieces of `split` elements (the last one shorter). Their number is the graph's: where it follows a
// symbolic size (x.split(3) of a dim of s), its value at the hints is kept as an assumption.
void split_into(RuleCall& call, const SymTensorMeta& x, int64_t dim, const Expr& split_size) {
  const Expr& size = x.sizes[dim];
  Expr split = call.simplify(split_size);
  int64_t count;
  if (call.le(size, split, "the split size against the dim's")) {
    count = 1;
  } else {
    call.check(call.lt(0, split, "the split size's sign"), "a split size of 0");
    count = call.pinned(sym::floordiv(size + split - 1, split), "the number of pieces of a split").constant_value();
  }
  std::vector<Expr> lengths(count, split);
  lengths.back() = size - split * (count - 1);
  pieces(call, x, dim, lengths);
}

void split_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "split of a 0-d tensor");
  split_into(call, x, wrap_dim(call, call.const_int(2), x.dim()), call.int_arg(1));
}

void chunk_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "chunk of a 0-d tensor");
  int64_t chunks = call.const_int(1);
  call.check(chunks > 0, "chunks below 1");
  int64_t dim = wrap_dim(call, call.const_int(2), x.dim());
  const Expr& size = x.sizes[dim];
  if (call.decide(call.facts().prove_divisible(call.simplify(size), chunks), "whether chunks divide the size")) {
    Expr piece = exact_quotient(size, chunks).value_or(sym::floordiv(size, chunks));
    pieces(call, x, dim, std::vector<Expr>(chunks, piece));
    return;
  }
  split_into(call, x, dim, sym::floordiv(size + chunks - 1, chunks));
}

void split_with_sizes_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "split of a 0-d tensor");
  std::vector<Expr> lengths = call.int_list(1);
  int64_t dim = wrap_dim(call, call.const_int(2), x.dim());
  call.check(!lengths.empty(), "no split sizes");
  for (const Expr& l : lengths) call.require_le(0, l, "a split size");
  Expr sum = 0;
  for (const Expr& l : lengths) sum = sum + l;
  call.require_eq(sum, x.sizes[dim], "split sizes' sum");
  pieces(call, x, dim, lengths);
}

void unbind_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  call.check(x.dim() > 0, "unbind of a 0-d tensor");
  int64_t dim = wrap_dim(call, call.const_int(1), x.dim());
  Expr n = call.pinned(x.sizes[dim], "the number of tensors unbind makes");
  std::vector<Expr> sizes = x.sizes, strides = x.strides;
  sizes.erase(sizes.begin() + dim);
  strides.erase(strides.begin() + dim);
  for (int64_t i = 0; i < n.constant_value(); ++i)
    call.add_output(view_of(x, sizes, strides, x.storage_offset + x.strides[dim] * i));
}

// cat: the sum along `dim`, the other sizes equal; the inputs' shared suggested memory format, else contiguous.
void cat_rule(RuleCall& call) {
  std::vector<SymTensorMeta> all = call.tensor_list(0);
  std::vector<SymTensorMeta> tensors;
  for (const SymTensorMeta& t : all)  // 1-d empty tensors are skipped (legacy behaviour)
    if (!(t.dim() == 1 && call.size_is(t.sizes[0], 0))) tensors.push_back(t);
  call.check(!tensors.empty(), "no non-empty tensor");
  const SymTensorMeta& first = tensors[0];
  int64_t dim = wrap_dim(call, call.const_int(1), first.dim());
  call.check(first.dim() > 0, "cat of 0-d tensors");
  std::vector<Expr> sizes = first.sizes;
  sizes[dim] = 0;
  bool channels_last = first.dim() >= 4 && strides_like_channels_last(call, first);
  for (const SymTensorMeta& t : tensors) {
    call.check(t.dim() == first.dim() && t.dtype == first.dtype, "tensors of different ranks or dtypes");
    for (int64_t d = 0; d < t.dim(); ++d)
      if (d != dim) call.require_eq(t.sizes[d], first.sizes[d], "cat's dim " + std::to_string(d));
    sizes[dim] = sizes[dim] + t.sizes[dim];
    if (channels_last != (t.dim() >= 4 && strides_like_channels_last(call, t))) channels_last = false;
  }
  for (const Expr& s : sizes) call.check(!call.size_is(s, 0), "an empty result");
  std::vector<Expr> strides = channels_last ? channels_last_strides(sizes) : contiguous_strides(sizes);
  call.add_output(make_meta(sizes, strides, first.dtype, first.device));
}

SymTensorMeta unsqueezed(const SymTensorMeta& t, int64_t dim) {
  SymTensorMeta u = t;
  Expr stride = dim >= t.dim() ? Expr(1) : t.sizes[dim] * t.strides[dim];
  u.sizes.insert(u.sizes.begin() + dim, Expr(1));
  u.strides.insert(u.strides.begin() + dim, stride);
  return u;
}

// stack of tensors of one shape and dtype: contiguous unless what is concatenated looks channels-last.
void stack_rule(RuleCall& call) {
  std::vector<SymTensorMeta> tensors = call.tensor_list(0);
  call.check(tensors.size() >= 2, "one tensor may keep its own layout");
  const SymTensorMeta& first = tensors[0];
  int64_t dim = wrap_dim(call, call.const_int(1), first.dim() + 1);
  call.check(is_floating(first.dtype), "not floating");
  no_empty(call, first);
  for (const SymTensorMeta& t : tensors) {
    call.check(t.dim() == first.dim() && t.dtype == first.dtype, "tensors of different ranks or dtypes");
    for (int64_t d = 0; d < t.dim(); ++d) call.require_eq(t.sizes[d], first.sizes[d], "stack's dim " + std::to_string(d));
    call.check(!strides_like_channels_last(call, dim < first.dim() ? t : unsqueezed(t, dim)),
               "a channels-last-looking input");
  }
  std::vector<Expr> sizes = first.sizes;
  sizes.insert(sizes.begin() + dim, Expr(static_cast<int64_t>(tensors.size())));
  call.add_output(contiguous_meta(sizes, first.dtype, first.device));
}

}  // namespace

void register_view_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  add("view.default", [](RuleCall& call) { view_rule(call, false); });
  add("_unsafe_view.default", [](RuleCall& call) { view_rule(call, false); });
  add("reshape.default", [](RuleCall& call) { view_rule(call, true); });
  add("permute.default", permute_rule);
  add("transpose.int", [](RuleCall& call) { transpose(call, call.tensor(0), call.const_int(1), call.const_int(2)); });
  add("t.default", [](RuleCall& call) {
    const SymTensorMeta& x = call.tensor(0);
    call.check(x.dim() <= 2, "t of more than 2 dims");
    transpose(call, x, 0, x.dim() < 2 ? 0 : 1);
  });
  add("expand.default", expand_rule);
  add("unsqueeze.default", unsqueeze_rule);
  add("squeeze.dim", [](RuleCall& call) { squeeze(call, call.tensor(0), {call.const_int(1)}, false); });
  add("squeeze.dims", [](RuleCall& call) { squeeze(call, call.tensor(0), call.const_int_list(1), false); });
  add("squeeze.default", [](RuleCall& call) { squeeze(call, call.tensor(0), {}, true); });
  add("alias.default", [](RuleCall& call) { call.add_output(call.tensor(0)); });
  add("detach.default", [](RuleCall& call) { call.add_output(call.tensor(0)); });
  add("slice.Tensor", slice_rule);
  add("select.int", select_rule);
  add("narrow.default", narrow_rule);
  add("unfold.default", unfold_rule);
  add("diagonal.default", diagonal_rule);
  add("as_strided.default", as_strided_rule);
  add("_reshape_alias.default", as_strided_rule);
  add("split.Tensor", split_rule);
  add("split_with_sizes.default", split_with_sizes_rule);
  add("chunk.default", chunk_rule);
  add("unbind.int", unbind_rule);
  add("cat.default", cat_rule);
  add("stack.default", stack_rule);
}

}  // namespace kiln::graph::shape
