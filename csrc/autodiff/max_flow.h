#pragma once
// Maximum flow / minimum cut on a small directed graph (Dinic's algorithm), header-only and free of
// torch and Python so that tests/cpp can check it on its own.
//
// The partitioner (autodiff/partition.cpp) builds one network per joint graph: a few thousand nodes at
// most, capacities in bytes. Dinic runs in O(V^2 E) in the worst case and far faster on these shallow,
// layered networks (every augmenting path is a short chain of recomputable ops).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace kiln::autodiff {

class MaxFlow {
 public:
  /// An edge that no cut may cross. Sums of a few of them cannot overflow int64_t.
  static constexpr int64_t kInfinite = std::numeric_limits<int64_t>::max() / 8;

  explicit MaxFlow(int num_nodes) : adjacency_(static_cast<size_t>(num_nodes)) {}

  int num_nodes() const { return static_cast<int>(adjacency_.size()); }

  /// A directed edge `from -> to` of `capacity` (>= 0; kInfinite for an uncuttable one).
  void add_edge(int from, int to, int64_t capacity) {
    adjacency_[from].push_back(static_cast<int>(edges_.size()));
    edges_.push_back({to, capacity});
    adjacency_[to].push_back(static_cast<int>(edges_.size()));
    edges_.push_back({from, 0});  // the residual twin: edge e's twin is e ^ 1
  }

  /// Pushes the maximum flow from `source` to `sink` and returns its value (capped at kInfinite: a
  /// result of kInfinite means no finite cut exists).
  int64_t run(int source, int sink) {
    int64_t total = 0;
    while (total < kInfinite && build_levels(source, sink)) {
      next_edge_.assign(adjacency_.size(), 0);
      while (int64_t pushed = augment(source, sink, kInfinite)) {
        total += pushed;
        if (total >= kInfinite) return kInfinite;
      }
    }
    return total;
  }

  /// After run(): per node, whether it can still reach the sink through edges with residual capacity.
  /// Those nodes form the sink side of the minimum cut that lies closest to the sink (the one that
  /// puts as many nodes as possible on the source side); every edge from a node outside this set to a
  /// node inside it is saturated, and their capacities sum to the maximum flow.
  std::vector<bool> reaches_sink(int sink) const { return residual_closure(sink, /*backwards=*/true); }

  /// After run(): per node, whether the source reaches it through edges with residual capacity (the
  /// source side of the minimum cut closest to the source).
  std::vector<bool> reached_from_source(int source) const { return residual_closure(source, /*backwards=*/false); }

 private:
  struct Edge {
    int to;
    int64_t capacity;  // residual capacity
  };

  // The nodes `start` reaches through edges with residual capacity, or (backwards) those that reach it.
  std::vector<bool> residual_closure(int start, bool backwards) const {
    std::vector<bool> seen(adjacency_.size(), false);
    std::vector<int> stack = {start};
    seen[start] = true;
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      for (int e : adjacency_[node]) {
        const int other = edges_[e].to;
        // Edge e is node -> other; its twin e ^ 1 is other -> node, the one that matters backwards.
        const int64_t residual = edges_[backwards ? e ^ 1 : e].capacity;
        if (!seen[other] && residual > 0) {
          seen[other] = true;
          stack.push_back(other);
        }
      }
    }
    return seen;
  }

  bool build_levels(int source, int sink) {
    level_.assign(adjacency_.size(), -1);
    std::vector<int> queue = {source};
    level_[source] = 0;
    for (size_t head = 0; head < queue.size(); ++head) {
      const int node = queue[head];
      for (int e : adjacency_[node]) {
        if (edges_[e].capacity > 0 && level_[edges_[e].to] < 0) {
          level_[edges_[e].to] = level_[node] + 1;
          queue.push_back(edges_[e].to);
        }
      }
    }
    return level_[sink] >= 0;
  }

  // One augmenting path along increasing levels (depth-first; paths are as long as the level graph is
  // deep, which the partitioner keeps short).
  int64_t augment(int node, int sink, int64_t limit) {
    if (node == sink) return limit;
    for (size_t& i = next_edge_[node]; i < adjacency_[node].size(); ++i) {
      const int e = adjacency_[node][i];
      Edge& edge = edges_[e];
      if (edge.capacity <= 0 || level_[edge.to] != level_[node] + 1) continue;
      const int64_t pushed = augment(edge.to, sink, std::min(limit, edge.capacity));
      if (pushed > 0) {
        // Infinite edges stay infinite: subtracting from them would let a long run of augmentations
        // make an uncuttable edge look finite.
        if (edge.capacity < kInfinite) edge.capacity -= pushed;
        if (edges_[e ^ 1].capacity < kInfinite) edges_[e ^ 1].capacity += pushed;
        return pushed;
      }
    }
    return 0;
  }

  std::vector<std::vector<int>> adjacency_;
  std::vector<Edge> edges_;
  std::vector<int> level_;
  std::vector<size_t> next_edge_;
};

}  // namespace kiln::autodiff
