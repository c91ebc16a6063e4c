#pragma once
// A compact, exact binary form of a Graph, for the on-disk graph cache (runtime/kernel_graph.cpp): the key of
// a compiled graph is the hash of its input graph's bytes, and the entry holds the optimised graph's bytes.
// Doubles keep their bits (NaN, infinities and -0.0 included), so a graph read back is the graph written.
// Constants come back as constant values without their tensors: the caller attaches them.
//
// Torch-free. The format has no version of its own: the cache key names kiln's build (graph cache entries
// are never read by another build).
#include <cstdint>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace kiln::graph {

/// Appends integers (zigzag LEB128), doubles (their 8 bytes), strings and lists to a byte string.
class ByteWriter {
 public:
  void integer(int64_t v);
  void real(double v);
  void text(const std::string& s);
  void integers(const std::vector<int64_t>& v);
  const std::string& bytes() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

/// Reads what a ByteWriter wrote, in the same order. Reading past the end, or a length that cannot fit,
/// throws kiln::Error ("truncated"): callers treat that as a bad cache entry.
class ByteReader {
 public:
  explicit ByteReader(const std::string& data) : data_(data) {}
  int64_t integer();
  double real();
  std::string text();
  std::vector<int64_t> integers();
  /// A count or index that must lie in [0, limit].
  int64_t count(int64_t limit);
  bool at_end() const { return pos_ == data_.size(); }

 private:
  const std::string& data_;
  size_t pos_ = 0;
};

void write_graph(ByteWriter& w, const Graph& g);
/// The graph write_graph wrote; constant values have is_constant set and no tensor. Throws kiln::Error on bytes
/// that do not describe a graph (then verify() is the caller's next check).
Graph read_graph(ByteReader& r);

}  // namespace kiln::graph
