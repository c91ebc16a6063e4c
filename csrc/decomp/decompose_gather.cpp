// Decompositions that read a tensor at run-time indices: embedding, gather and index_select. Each output element
// is one element of the source, found through PrimBuilder::gather (a gathered load), so the rows an embedding
// picks are read where they are used (fused with the adds and the layer norm after them) instead of copied out
// first by an extern call. Index values outside the source dim are errors, as in eager (gather's checks).
//
// Only dense gathers: embedding's backward options (scale_grad_by_freq, sparse) matter to its gradient, not here.
//
// And the scatters that write one element per slice: scatter/scatter_add whose index has size 1 along `dim` (and
// self's sizes elsewhere) are pointwise over self, out = where(iota(dim) == index, src or self + src, self), so a
// gather's gradient (a zero fill and a scatter_add, autodiff/derivative_rules_more.cpp) is one fused pass rather
// than a fill and an extern scatter; the index is checked as a gathered load's is. Larger indices stay extern
// calls: several of them may hit one element, which scatter_add sums.
#include "decomp/decomposition_helpers.h"

namespace kiln::decomp::detail {

namespace {

bool integer_index(const Graph& g, const Node& n, int i) {
  const auto* m = tensor_arg_meta(g, n, i);
  return m && (m->dtype == ScalarType::Long || m->dtype == ScalarType::Int);
}

int64_t dim_arg(const Node& n, int i, int64_t rank) {
  const int64_t d = static_cast<int64_t>(number_arg(n, i));
  return d < 0 ? d + rank : d;
}

std::vector<int> iota(size_t n, int first = 0) {
  std::vector<int> dims(n);
  for (size_t j = 0; j < n; ++j) dims[j] = first + static_cast<int>(j);
  return dims;
}

}  // namespace

void add_gather_decompositions(std::map<std::string, Decomposition>& table) {
  // embedding(weight[V, H], indices[*]) -> out[*, H] = weight[indices[*], :]
  Decomposition embedding;
  embedding.gathered_reads = true;
  embedding.supports = [](const Graph& g, const Node& n) {
    const auto* w = tensor_arg_meta(g, n, 0);
    return w && w->sizes.size() == 2 && integer_index(g, n, 1);
  };
  embedding.build = [](PrimBuilder& b, const Graph& g, const Node& n) {
    const size_t index_rank = tensor_arg_meta(g, n, 1)->sizes.size();
    b.set_output(0, b.gather(0, 0, {-1, static_cast<int>(index_rank)}, 1, iota(index_rank)));
  };
  table["aten::embedding.default"] = std::move(embedding);

  // index_select(self, dim, index[n]) -> out: self with dim `dim` replaced by the n picked entries
  Decomposition index_select;
  index_select.gathered_reads = true;
  index_select.supports = [](const Graph& g, const Node& n) {
    const auto* self = tensor_arg_meta(g, n, 0);
    const auto* index = tensor_arg_meta(g, n, 2);
    return self && !self->sizes.empty() && index && index->sizes.size() == 1 && is_number(n, 1) && integer_index(g, n, 2);
  };
  index_select.build = [](PrimBuilder& b, const Graph& g, const Node& n) {
    const size_t rank = tensor_arg_meta(g, n, 0)->sizes.size();
    const int dim = static_cast<int>(dim_arg(n, 1, static_cast<int64_t>(rank)));
    b.set_output(0, b.gather(0, dim, iota(rank), 2, {dim}));
  };
  table["aten::index_select.default"] = std::move(index_select);

  // gather(self, dim, index) -> out[i] = self[i with dim `dim` replaced by index[i]] (index has self's rank)
  Decomposition gather;
  gather.gathered_reads = true;
  gather.supports = [](const Graph& g, const Node& n) {
    const auto* self = tensor_arg_meta(g, n, 0);
    const auto* index = tensor_arg_meta(g, n, 2);
    if (!self || !index || self->sizes.empty() || index->sizes.size() != self->sizes.size() || !is_number(n, 1) ||
        !integer_index(g, n, 2))
      return false;
    const int64_t dim = dim_arg(n, 1, static_cast<int64_t>(self->sizes.size()));
    for (size_t d = 0; d < self->sizes.size(); ++d)  // eager checks these sizes; a graph only holds calls that passed
      if (static_cast<int64_t>(d) != dim && index->sizes[d] > self->sizes[d]) return false;
    return true;
  };
  gather.build = [](PrimBuilder& b, const Graph& g, const Node& n) {
    const size_t rank = tensor_arg_meta(g, n, 0)->sizes.size();
    const int dim = static_cast<int>(dim_arg(n, 1, static_cast<int64_t>(rank)));
    b.set_output(0, b.gather(0, dim, iota(rank), 2, iota(rank)));
  };
  table["aten::gather.default"] = std::move(gather);

  // scatter_add(self, dim, index, src), scatter.src(self, dim, index, src), scatter.value(self, dim, index, value):
  // pointwise where index has one entry per slice along dim (see the design note above).
  auto one_per_slice = [](bool tensor_source) {
    return [tensor_source](const Graph& g, const Node& n) {
      const auto* self = tensor_arg_meta(g, n, 0);
      const auto* index = tensor_arg_meta(g, n, 2);
      const auto* source = tensor_arg_meta(g, n, 3);
      if (!self || !index || self->sizes.empty() || index->sizes.size() != self->sizes.size() || !is_number(n, 1) ||
          index->dtype != ScalarType::Long || out_meta(g, n).dtype == ScalarType::Bool)
        return false;
      if (tensor_source ? !source || source->sizes != index->sizes : !is_number(n, 3)) return false;
      const int64_t dim = dim_arg(n, 1, static_cast<int64_t>(self->sizes.size()));
      for (size_t d = 0; d < self->sizes.size(); ++d)
        if (index->sizes[d] != (static_cast<int64_t>(d) == dim ? 1 : self->sizes[d])) return false;
      return self->sizes[dim] > 0;
    };
  };
  auto write_one_per_slice = [](bool accumulate) {
    return [accumulate](PrimBuilder& b, const Graph& g, const Node& n) {
      const ScalarType t = out_meta(g, n).dtype;
      const auto& self_sizes = tensor_arg_meta(g, n, 0)->sizes;
      const int dim = static_cast<int>(dim_arg(n, 1, static_cast<int64_t>(self_sizes.size())));
      const Prim extent = b.constant(static_cast<double>(self_sizes[dim]), ScalarType::Long);
      const Prim index = b.binary(PrimOp::CheckedIndex, arg_as(b, 2, ScalarType::Long), extent);
      const Prim hit = b.binary(PrimOp::Eq, b.iota(dim), index);
      const Prim self = arg_as(b, 0, t);
      const Prim source = arg_as(b, 3, t);
      b.set_output(0, b.where(hit, accumulate ? b.binary(PrimOp::Add, self, source) : source, self));
    };
  };
  table["aten::scatter_add.default"] = Decomposition{one_per_slice(true), nullptr, write_one_per_slice(true), 1};
  table["aten::scatter.src"] = Decomposition{one_per_slice(true), nullptr, write_one_per_slice(false), 1};
  table["aten::scatter.value"] = Decomposition{one_per_slice(false), nullptr, write_one_per_slice(false), 1};
}

}  // namespace kiln::decomp::detail
