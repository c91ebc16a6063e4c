#pragma once
// The device a graph runs on, read from its tensors' metas: what the pipeline (compile/pipeline.cpp) compiles the
// graph for and what the C++ loader of exported programs (csrc/export) loads its compiled code on.
#include <optional>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace kiln::graph {

/// The one device all of `g`'s tensors live on (CPU for a graph without tensors), or nullopt with `why` set: tensors
/// on two devices, or a non-CPU device without an index. Which devices have code generators is codegen/'s to say.
std::optional<Device> single_device(const Graph& g, std::string& why);

/// Whether each value of `g` is an input, an output, or an argument or result of some node.
std::vector<bool> used_values(const Graph& g);

}  // namespace kiln::graph
