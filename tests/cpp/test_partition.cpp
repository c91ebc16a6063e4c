// autodiff/max_flow.h: the max-flow / min-cut routine the autograd partitioner (autodiff/partition.cpp)
// decides saved versus recomputed values with. partition.cpp itself lives in the LibTorch library, which
// kiln_cpp_tests does not link; its decisions are tested from Python (tests/python/test_partition.py).
#include <catch2/catch.hpp>

#include <vector>

#include "autodiff/max_flow.h"

using kiln::autodiff::MaxFlow;

namespace {
// The edges leaving the sink side chosen by reaches_sink, and their capacity sum.
int64_t cut_capacity(const std::vector<std::vector<int64_t>>& capacity, const std::vector<bool>& sink_side) {
  int64_t total = 0;
  for (size_t from = 0; from < capacity.size(); ++from)
    for (size_t to = 0; to < capacity.size(); ++to)
      if (capacity[from][to] > 0 && !sink_side[from] && sink_side[to]) total += capacity[from][to];
  return total;
}
}  // namespace

TEST_CASE("max flow of the textbook network (CLRS 26.1) is 23 and its cut has that capacity") {
  // s=0, v1..v4 = 1..4, t=5.
  std::vector<std::vector<int64_t>> capacity(6, std::vector<int64_t>(6, 0));
  capacity[0][1] = 16, capacity[0][2] = 13, capacity[1][3] = 12, capacity[2][1] = 4, capacity[2][4] = 14,
  capacity[3][2] = 9, capacity[3][5] = 20, capacity[4][3] = 7, capacity[4][5] = 4;
  MaxFlow flow(6);
  for (int a = 0; a < 6; ++a)
    for (int b = 0; b < 6; ++b)
      if (capacity[a][b] > 0) flow.add_edge(a, b, capacity[a][b]);
  REQUIRE(flow.run(0, 5) == 23);
  const std::vector<bool> sink_side = flow.reaches_sink(5);
  CHECK(sink_side[5]);
  CHECK_FALSE(sink_side[0]);
  CHECK(cut_capacity(capacity, sink_side) == 23);
  const std::vector<bool> source_side = flow.reached_from_source(0);
  std::vector<bool> complement(6);
  for (int i = 0; i < 6; ++i) complement[i] = !source_side[i];
  CHECK(cut_capacity(capacity, complement) == 23);
}

TEST_CASE("no path means zero flow; an all-infinite path reports kInfinite") {
  MaxFlow disconnected(3);
  disconnected.add_edge(0, 1, 5);
  CHECK(disconnected.run(0, 2) == 0);

  MaxFlow unbounded(3);
  unbounded.add_edge(0, 1, MaxFlow::kInfinite);
  unbounded.add_edge(1, 2, MaxFlow::kInfinite);
  CHECK(unbounded.run(0, 2) == MaxFlow::kInfinite);
}

TEST_CASE("node splitting: the cut picks the cheapest values between what is computed and what is needed") {
  // The pattern of the partitioner: value v is in-node 2v and out-node 2v+1 joined by its byte size; uses
  // are infinite edges out(v) -> in(user). Chain a(100) -> b(40) -> c(70) -> d(90), a fed by the source,
  // d needed: the cut is b alone (40), and the nearest-to-sink and nearest-to-source cuts agree.
  const int64_t bytes[] = {100, 40, 70, 90};
  const int source = 8, sink = 9;
  MaxFlow flow(10);
  for (int v = 0; v < 4; ++v) flow.add_edge(2 * v, 2 * v + 1, bytes[v]);
  for (int v = 0; v + 1 < 4; ++v) flow.add_edge(2 * v + 1, 2 * (v + 1), MaxFlow::kInfinite);
  flow.add_edge(source, 0, MaxFlow::kInfinite);
  flow.add_edge(2 * 3 + 1, sink, MaxFlow::kInfinite);
  REQUIRE(flow.run(source, sink) == 40);
  const std::vector<bool> sink_side = flow.reaches_sink(sink);
  for (int v = 0; v < 4; ++v) {
    const bool cut = !sink_side[2 * v] && sink_side[2 * v + 1];
    CHECK(cut == (v == 1));
  }
}

TEST_CASE("ties between cuts: reaches_sink gives the cut nearest the sink, reached_from_source the nearest the source") {
  // a(50) -> b(50), b needed: both {a} and {b} cost 50.
  MaxFlow flow(6);
  const int source = 4, sink = 5;
  flow.add_edge(0, 1, 50);
  flow.add_edge(2, 3, 50);
  flow.add_edge(1, 2, MaxFlow::kInfinite);
  flow.add_edge(source, 0, MaxFlow::kInfinite);
  flow.add_edge(3, sink, MaxFlow::kInfinite);
  REQUIRE(flow.run(source, sink) == 50);
  const std::vector<bool> sink_side = flow.reaches_sink(sink);
  CHECK(!sink_side[2]);  // b's in-node on the source side: b itself is cut (saved), nothing recomputed
  CHECK(sink_side[3]);
  const std::vector<bool> source_side = flow.reached_from_source(source);
  CHECK(source_side[0]);
  CHECK_FALSE(source_side[1]);  // a is cut: b would be recomputed from it
}

TEST_CASE("two needed values sharing an ancestor: saving the shared ancestor beats saving both") {
  // x(0, a graph input) -> m(64, a matmul: fed by the source) -> t(64) and s(64), t and s needed.
  // Saving m alone (64) is cheaper than saving t and s (128).
  enum { x, m, t, s };
  const int64_t bytes[] = {0, 64, 64, 64};
  const int source = 8, sink = 9;
  MaxFlow flow(10);
  for (int v = 0; v < 4; ++v) flow.add_edge(2 * v, 2 * v + 1, bytes[v]);
  flow.add_edge(source, 2 * x, MaxFlow::kInfinite);
  flow.add_edge(source, 2 * m, MaxFlow::kInfinite);
  flow.add_edge(2 * m + 1, 2 * t, MaxFlow::kInfinite);
  flow.add_edge(2 * m + 1, 2 * s, MaxFlow::kInfinite);
  flow.add_edge(2 * t + 1, sink, MaxFlow::kInfinite);
  flow.add_edge(2 * s + 1, sink, MaxFlow::kInfinite);
  REQUIRE(flow.run(source, sink) == 64);
  const std::vector<bool> sink_side = flow.reaches_sink(sink);
  CHECK((!sink_side[2 * m] && sink_side[2 * m + 1]));
  CHECK_FALSE((!sink_side[2 * t] && sink_side[2 * t + 1]));
  CHECK_FALSE((!sink_side[2 * s] && sink_side[2 * s + 1]));
}

TEST_CASE("a long augmenting chain and many parallel paths") {
  // 2000 nodes in a chain with one cheap link, plus 300 parallel unit paths: the flow is their sum.
  const int chain = 2000;
  MaxFlow flow(chain + 300 + 2);
  const int source = chain + 300, sink = chain + 301;
  flow.add_edge(source, 0, MaxFlow::kInfinite);
  for (int i = 0; i + 1 < chain; ++i) flow.add_edge(i, i + 1, i == 1234 ? 7 : 1000);
  flow.add_edge(chain - 1, sink, MaxFlow::kInfinite);
  for (int p = 0; p < 300; ++p) {
    flow.add_edge(source, chain + p, 1);
    flow.add_edge(chain + p, sink, 2);
  }
  CHECK(flow.run(source, sink) == 7 + 300);
}
