#pragma once
// autodiff's joint graphs on disk: after its halves' own records (graph_cache.h), building the joint graphs is most of
// a training graph's warm compile (the partition, and the meta kernels of every backward op), so a new process reads
// them back instead. Kept as graph records are (kind "joints": checksums, atomic writes, kiln's build in the key);
// the key is the caller's (compile/split_for_autodiff.cpp: graph_key of the captured graph, with the torch version and
// cuDNN's batch-norm conditions).
//
// Torch-free.
#include <optional>
#include <string>

#include "autodiff/build_joint_graphs.h"
#include "graph/graph.h"

namespace kiln::cache {

/// The joint graphs stored under `key` with the tensors of `captured`'s constants attached, or nullopt when there are
/// none, their constants do not match, or they are unreadable (then counted as a corrupt entry and logged under
/// `fallbacks`).
std::optional<autodiff::JointGraphs> load_joint_graphs(const std::string& key, const graph::Graph& captured);

/// Stores `joint` under `key`, unless one of its halves holds a constant `captured` does not. I/O errors are logged,
/// never thrown.
void store_joint_graphs(const std::string& key, const autodiff::JointGraphs& joint, const graph::Graph& captured);

}  // namespace kiln::cache
