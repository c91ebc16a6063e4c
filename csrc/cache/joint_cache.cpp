// autodiff's joint graphs on disk (joint_cache.h): both halves with the sources of their constants, then the fields
// of JointGraphs.
#include "cache/joint_cache.h"

#include <algorithm>

#include "cache/graph_cache.h"
#include "common/error.h"
#include "graph/graph_bytes.h"

namespace kiln::cache {

namespace {

constexpr const char* kJointKind = "joints";

void write_ids(graph::ByteWriter& w, const std::vector<int32_t>& ids) {
  w.integers(std::vector<int64_t>(ids.begin(), ids.end()));
}

std::vector<int32_t> read_ids(graph::ByteReader& r) {
  std::vector<int32_t> ids;
  for (int64_t v : r.integers()) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

// Null when a half holds a constant the captured graph does not (then nothing is stored).
std::optional<std::string> encode_joint(const autodiff::JointGraphs& j, const graph::Graph& captured) {
  graph::ByteWriter w;
  for (const auto* half : {j.forward.get(), j.backward.get()}) {
    const std::vector<graph::ValueId> sources = constant_sources(captured, *half);
    if (std::find(sources.begin(), sources.end(), kUnknownConstant) != sources.end()) return std::nullopt;
    graph::write_graph(w, *half);
    write_ids(w, sources);
  }
  w.integer(static_cast<int64_t>(j.num_outputs));
  write_ids(w, j.updated_inputs);
  w.integers(std::vector<int64_t>(j.output_differentiable.begin(), j.output_differentiable.end()));
  write_ids(w, j.saved_from_input);
  write_ids(w, j.grad_inputs);
  write_ids(w, j.output_inputs);
  for (const auto& view : j.output_views) {
    w.integer(view ? 1 : 0);
    if (view) graph::write_graph(w, *view);
  }
  for (int64_t v : {j.saved_bytes, j.saved_tensors, j.saved_bytes_before_partition, j.recomputed_nodes}) w.integer(v);
  return w.take();
}

// The joint graphs stored for `captured`, with its constant tensors attached, or nullopt.
std::optional<autodiff::JointGraphs> decode_joint(const std::string& bytes, const std::string& key, const graph::Graph& captured) {
  try {
    graph::ByteReader r(bytes);
    autodiff::JointGraphs j;
    for (auto* half : {&j.forward, &j.backward}) {
      auto g = std::make_shared<graph::Graph>(graph::read_graph(r));
      if (!attach_constants(*g, read_ids(r), captured)) return std::nullopt;
      g->verify();
      *half = std::move(g);
    }
    j.num_outputs = static_cast<size_t>(r.count(1 << 30));
    j.updated_inputs = read_ids(r);
    for (int64_t v : r.integers()) j.output_differentiable.push_back(v != 0);
    j.saved_from_input = read_ids(r);
    j.grad_inputs = read_ids(r);
    j.output_inputs = read_ids(r);
    for (size_t i = 0; i < j.output_inputs.size(); ++i) {
      std::shared_ptr<graph::Graph> view;
      if (r.integer() != 0) {
        view = std::make_shared<graph::Graph>(graph::read_graph(r));
        view->verify();
      }
      j.output_views.push_back(std::move(view));
    }
    for (int64_t* v : {&j.saved_bytes, &j.saved_tensors, &j.saved_bytes_before_partition, &j.recomputed_nodes}) *v = r.integer();
    KILN_CHECK(r.at_end()) << "trailing bytes";
    KILN_CHECK(j.output_differentiable.size() == j.num_outputs && j.grad_inputs.size() == j.backward->outputs.size())
        << "inconsistent joint record";
    return j;
  } catch (const std::exception& e) {
    ignore_unreadable(kJointKind, key, e);
    return std::nullopt;
  }
}

}  // namespace

std::optional<autodiff::JointGraphs> load_joint_graphs(const std::string& key, const graph::Graph& captured) {
  if (std::optional<std::string> bytes = load_record_bytes(kJointKind, key)) return decode_joint(*bytes, key, captured);
  return std::nullopt;
}

void store_joint_graphs(const std::string& key, const autodiff::JointGraphs& joint, const graph::Graph& captured) {
  if (std::optional<std::string> bytes = encode_joint(joint, captured)) store_record_bytes(kJointKind, key, *bytes);
}

}  // namespace kiln::cache
