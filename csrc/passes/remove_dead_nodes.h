#pragma once
#include <vector>

#include "graph/graph.h"

namespace kiln::passes {

/// Removes nodes none of whose outputs reach a graph output. Needs: a verified graph. Guarantees: only
/// pure nodes are removed (ops with a decomposition and affine views: no in-place, random or otherwise
/// effectful op is ever dropped); value ids are renumbered densely.
void remove_dead_nodes(graph::Graph& g);

/// After nodes were removed: drops the values no node defines, renumbers the rest densely (in their order; inputs and
/// constants always stay) and resets Value::producer (shared by the passes). Returns each old id's new id (-1: dropped).
std::vector<graph::ValueId> renumber_producers(graph::Graph& g);

/// True for nodes the passes may drop or merge: no side effects, result determined by the arguments.
bool is_pure_node(const graph::Graph& g, const graph::Node& node);

/// `empty`, `empty_strided`, `empty_like`: nothing but a fresh, uninitialised tensor.
bool is_allocation(const graph::Node& node);

}  // namespace kiln::passes
