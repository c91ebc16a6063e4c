// Shape rules of the indexing ops: advanced indexing by integer tensors (index.Tensor), index_select, gather, the
// scatters, index_put, index_add, masked_fill and embedding's backward.
//
// Design note: the recorder takes these ops' metas from torch's meta kernels, so the rules follow those (not eager's
// TensorIterator where they differ): index.Tensor's output takes the stride order of its restrided source alone.
// Index tensors' sizes are sizes like any other (the broadcast of several index tensors assumes unequal symbolic sizes
// equal); their values never matter, and bool masks (whose nonzero count is data) never reach these rules.
#include "graph/shape_rules_impl.h"

#include <algorithm>

namespace kiln::graph::shape {

namespace {

bool is_index_dtype(ScalarType t) { return t == ScalarType::Long || t == ScalarType::Int; }

// index.Tensor(self, indices): the index tensors broadcast to one shape B, which replaces the indexed dims where
// they are adjacent, else goes first (numpy's rule); the meta kernel's layout: dense in the stride order of self with
// the indexed dims restrided to B at stride 0.
void index_rule(RuleCall& call) {
  const SymTensorMeta& self = call.tensor(0);
  const auto* list = std::get_if<SymTensorList>(&call.arg(1));
  call.check(list != nullptr && !list->items.empty(), "indices that are not a tensor list");
  call.check(static_cast<int64_t>(list->items.size()) <= self.dim(), "more indices than dims");
  no_empty(call, self.sizes);
  std::vector<std::vector<Expr>> index_shapes;
  std::vector<int64_t> indexed;  // the dims with an index tensor, in order
  for (size_t d = 0; d < list->items.size(); ++d) {
    if (!list->items[d]) continue;
    call.check(is_index_dtype(list->items[d]->dtype), "an index that is not an integer tensor");
    index_shapes.push_back(list->items[d]->sizes);
    indexed.push_back(static_cast<int64_t>(d));
  }
  call.check(!indexed.empty(), "no index tensor");
  const std::vector<Expr> replacement = broadcast_shape(call, index_shapes);
  no_empty(call, replacement);
  const bool adjacent = indexed.back() - indexed.front() + 1 == static_cast<int64_t>(indexed.size());
  std::vector<int64_t> order;  // self's dims as the kernel sees them (indexed ones first when not adjacent)
  if (!adjacent) order = indexed;
  for (int64_t d = 0; d < self.dim(); ++d)
    if (adjacent || std::find(indexed.begin(), indexed.end(), d) == indexed.end()) order.push_back(d);
  const int64_t first = adjacent ? indexed.front() : 0;
  std::vector<Expr> sizes, src_strides;
  for (int64_t i = 0; i < first; ++i) {
    sizes.push_back(self.sizes[order[i]]);
    src_strides.push_back(self.strides[order[i]]);
  }
  for (const Expr& s : replacement) {
    sizes.push_back(s);
    src_strides.push_back(0);
  }
  for (size_t i = first + indexed.size(); i < order.size(); ++i) {
    sizes.push_back(self.sizes[order[i]]);
    src_strides.push_back(self.strides[order[i]]);
  }
  // compute_elementwise_output_logical_to_physical_perm of the restrided source: contiguous or channels-last where
  // it is exactly one of them, else its stride order.
  SymTensorMeta src = make_meta(sizes, src_strides, self.dtype, self.device);
  std::vector<Expr> strides;
  const bool contiguous = is_contiguous(call, src), channels_last = is_channels_last_contiguous(call, src);
  if (contiguous && !channels_last) {
    strides = contiguous_strides(sizes);
  } else if (channels_last && !contiguous) {
    strides = channels_last_strides(sizes);
  } else {
    call.check(sizes.size() != 5, "a 5-d result (channels_last_3d is not decided here)");
    strides = strides_in_operand_order(call, sizes, {src_strides});
  }
  call.add_output(make_meta(sizes, strides, self.dtype, self.device));
}

// index_select(self, dim, index): dim's size becomes the index's element count, contiguous.
void index_select_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &index = call.tensor(2);
  call.check(is_index_dtype(index.dtype) && index.dim() <= 1, "an index that is not a 1-d integer tensor");
  std::vector<Expr> sizes = self.sizes;
  if (self.dim() > 0) sizes[wrap_dim(call, call.const_int(1), self.dim())] = product(index.sizes);
  call.add_output(contiguous_meta(allocated_sizes(call, sizes), self.dtype, self.device));
}

// gather(self, dim, index, sparse_grad): the index's sizes, contiguous.
void gather_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &index = call.tensor(2);
  call.check(index.dtype == ScalarType::Long, "an index that is not int64");
  call.check(index.dim() == self.dim() || (index.dim() <= 1 && self.dim() <= 1), "the index's rank");
  const int64_t dim = wrap_dim(call, call.const_int(1), self.dim());
  for (int64_t d = 0; d < index.dim(); ++d)
    if (d != dim) call.require_le(index.sizes[d], self.sizes[d], "gather's index size");
  call.add_output(contiguous_meta(allocated_sizes(call, index.sizes), self.dtype, self.device));
}

// scatter.src / .value / .reduce / .value_reduce and scatter_add (self, dim, index, src or value, ...): self's sizes,
// contiguous; the index fits in self (and in src).
void scatter_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &index = call.tensor(2);
  call.check(index.dtype == ScalarType::Long, "an index that is not int64");
  call.check(index.dim() == self.dim() || (index.dim() <= 1 && self.dim() <= 1), "the index's rank");
  const int64_t dim = wrap_dim(call, call.const_int(1), self.dim());
  const SymTensorMeta* src = std::get_if<SymTensorMeta>(&call.arg(3));
  call.check(src != nullptr || call.is_number_arg(3), "a source that is neither a tensor nor a number");
  if (src) call.check(src->dtype == self.dtype && src->dim() == index.dim(), "the source's dtype or rank");
  for (int64_t d = 0; d < index.dim(); ++d) {
    if (d != dim) call.require_le(index.sizes[d], self.sizes[d], "scatter's index size");
    if (src) call.require_le(index.sizes[d], src->sizes[d], "scatter's index size against the source");
  }
  call.add_output(contiguous_meta(allocated_sizes(call, self.sizes), self.dtype, self.device));
}

// index_add(self, dim, index, source, alpha): self's sizes, contiguous.
void index_add_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &index = call.tensor(2), &source = call.tensor(3);
  call.check(is_index_dtype(index.dtype) && index.dim() <= 1, "an index that is not a 1-d integer tensor");
  call.check(source.dtype == self.dtype && source.dim() == self.dim(), "the source's dtype or rank");
  const int64_t dim = wrap_dim(call, call.const_int(1), self.dim());
  for (int64_t d = 0; d < self.dim(); ++d)
    call.require_eq(source.sizes[d], d == dim ? product(index.sizes) : self.sizes[d], "index_add's source size");
  // (the meta kernel orders size-1 dims by their strides, which are arbitrary: left to torch)
  for (const Expr& s : self.sizes) call.check(!call.size_is(s, 1), "a dim of size 1");
  call.add_output(contiguous_meta(allocated_sizes(call, self.sizes), self.dtype, self.device));
}

// index_put(self, indices, values, accumulate): empty_like(self).
void index_put_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &values = call.tensor(2);
  const auto* list = std::get_if<SymTensorList>(&call.arg(1));
  call.check(list != nullptr, "indices that are not a tensor list");
  for (const auto& item : list->items)
    call.check(!item || is_index_dtype(item->dtype), "an index that is not an integer tensor");
  call.check(values.dtype == self.dtype, "values of another dtype");
  call.bool_arg(3);
  no_empty(call, self.sizes);
  for (const Expr& s : self.sizes) call.check(!call.size_is(s, 1), "a dim of size 1 (placed by its arbitrary stride)");
  call.add_output(make_meta(self.sizes, empty_like_strides(call, self, std::nullopt), self.dtype, self.device));
}

// masked_fill.Scalar / .Tensor(self, mask, value): self and mask broadcast, contiguous.
void masked_fill_rule(RuleCall& call) {
  const SymTensorMeta &self = call.tensor(0), &mask = call.tensor(1);
  call.check(mask.dtype == ScalarType::Bool, "a mask that is not bool");
  if (const auto* value = std::get_if<SymTensorMeta>(&call.arg(2))) {
    call.check(value->dim() == 0, "a value tensor with dims");
  } else {
    call.check(call.is_number_arg(2), "a value that is not a number");
  }
  std::vector<Expr> shape = broadcast_shape(call, {self.sizes, mask.sizes});
  no_empty(call, shape);
  // (the meta kernel orders size-1 dims by their strides, which are arbitrary: left to torch)
  for (const Expr& s : shape) call.check(!call.size_is(s, 1), "a dim of size 1");
  call.add_output(contiguous_meta(shape, self.dtype, self.device));
}

// embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq): (num_weights, dim).
void embedding_dense_backward_rule(RuleCall& call) {
  const SymTensorMeta &grad = call.tensor(0), &indices = call.tensor(1);
  call.check(is_floating(grad.dtype) && grad.dim() >= 1 && is_index_dtype(indices.dtype), "dtypes or rank");
  call.check(grad.dim() == indices.dim() + 1, "the gradient's rank");
  for (int64_t d = 0; d < indices.dim(); ++d) call.require_eq(grad.sizes[d], indices.sizes[d], "the gradient's size");
  call.add_output(contiguous_meta(allocated_sizes(call, {call.int_arg(2), grad.sizes.back()}), grad.dtype, grad.device));
}

}  // namespace

void register_indexing_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  add("index.Tensor", index_rule);
  add("index_select.default", index_select_rule);
  add("gather.default", gather_rule);
  for (const char* op : {"scatter.src", "scatter.value", "scatter.reduce", "scatter.value_reduce",
                         "scatter_add.default"})
    add(op, scatter_rule);
  add("index_add.default", index_add_rule);
  add("index_put.default", index_put_rule);
  add("masked_fill.Scalar", masked_fill_rule);
  add("masked_fill.Tensor", masked_fill_rule);
  add("embedding_dense_backward.default", embedding_dense_backward_rule);
}

}  // namespace kiln::graph::shape
