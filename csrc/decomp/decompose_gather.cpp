// Decompositions that read a tensor at run-time indices: embedding, gather and index_select. Each output element
// is one element of the source, found through PrimBuilder::gather (a gathered load), so the rows an embedding
// picks are read where they are used (fused with the adds and the layer norm after them) instead of copied out
// first by an extern call. Index values outside the source dim are errors, as in eager (gather's checks).
//
// Only dense gathers: embedding's backward options (scale_grad_by_freq, sparse) matter to its gradient, not here.
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
}

}  // namespace kiln::decomp::detail
