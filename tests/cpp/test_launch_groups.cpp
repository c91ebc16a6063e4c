// fusion/launch_groups on a hand-built schedule (torch-free): the live-bytes timeline, and hoisting that keeps
// the schedule's peak.
#include <catch2/catch.hpp>

#include "fusion/launch_groups.h"

using kiln::fusion::Kernel;
using kiln::fusion::Schedule;
using kiln::fusion::Step;
using kiln::graph::Graph;
using kiln::graph::Node;
using kiln::graph::ScalarType;
using kiln::graph::TensorArg;
using kiln::graph::TensorMeta;
using kiln::graph::ValueId;

namespace {

TensorMeta floats(int64_t n) {
  TensorMeta m;
  m.sizes = {n};
  m.strides = {1};
  return m;
}

ValueId op(Graph& g, const char* name, std::vector<ValueId> reads, int64_t n) {
  Node node;
  node.op = name;
  node.overload = "default";
  for (ValueId v : reads) {
    node.args.push_back(TensorArg{v});
    node.arg_names.push_back("self");
  }
  node.num_positional = static_cast<int32_t>(node.args.size());
  return g.add_node(node, {floats(n)}).at(0);
}

Kernel copy_kernel(ValueId from, ValueId to, int64_t n) {
  Kernel k;
  k.name = "kernel_copy";
  k.domain = {n};
  k.reduced = {false};
  k.buffers = {{from, ScalarType::Float, false}, {to, ScalarType::Float, true}};
  return k;
}

// Steps: e = copy(w) [kernel, 1 KiB]; a = relu(x) [extern, 4 KiB]; b = mm(a, e) [extern, 4 KiB];
// c = copy(w) [kernel, 1 KiB]; d = mm(b, c) [extern, 1 KiB, the graph's output].
struct Fixture {
  Graph g;
  Schedule schedule;
  Fixture() {
    const ValueId x = g.add_input(floats(1024));
    const ValueId w = g.add_input(floats(256));
    const ValueId e = op(g, "aten::clone", {w}, 256);
    const ValueId a = op(g, "aten::relu", {x}, 1024);
    const ValueId b = op(g, "aten::mm", {a, e}, 1024);
    const ValueId c = op(g, "aten::clone", {w}, 256);
    const ValueId d = op(g, "aten::mm", {b, c}, 256);
    g.set_outputs({d});
    (void)a;
    schedule.kernels = {copy_kernel(w, e, 256), copy_kernel(w, c, 256)};
    schedule.steps = {{Step::Kind::Kernel, 0}, {Step::Kind::Extern, 1}, {Step::Kind::Extern, 2},
                      {Step::Kind::Kernel, 1}, {Step::Kind::Extern, 4}};
    schedule.materialised.assign(g.values.size(), true);
  }
};

}  // namespace

TEST_CASE("live bytes per step follow each value from its maker to its last reader", "[launch_groups]") {
  Fixture f;
  // e 1 KiB from step 0 to 2; a 4 KiB from 1 to 2; b 4 KiB from 2 to 4; c 1 KiB from 3 to 4; d 1 KiB at 4.
  REQUIRE(kiln::fusion::live_bytes_per_step(f.schedule, f.g) == std::vector<int64_t>{1024, 5120, 9216, 5120, 6144});
  // Inputs counted: x (4 KiB) until relu reads it at step 1, w (1 KiB) until its second copy at step 3.
  REQUIRE(kiln::fusion::live_bytes_per_step(f.schedule, f.g, /*count_inputs=*/true) ==
          std::vector<int64_t>{6144, 10240, 10240, 6144, 6144});
}

TEST_CASE("counting inputs keeps a copy for the end of a graph that starts at its peak", "[launch_groups]") {
  // A backward: saved activations s1, s2 (4 KiB each) are inputs read by the first steps; weight copies at the
  // start and at the end. The second copy, hoisted, would be alive with both activations.
  Graph g;
  const ValueId s1 = g.add_input(floats(1024));
  const ValueId s2 = g.add_input(floats(1024));
  const ValueId w = g.add_input(floats(256));
  const ValueId e = op(g, "aten::clone", {w}, 256);
  const ValueId a = op(g, "aten::mm", {s1, s2, e}, 256);
  const ValueId c = op(g, "aten::clone", {w}, 256);
  const ValueId d = op(g, "aten::mm", {a, c}, 256);
  g.set_outputs({d});
  Schedule schedule;
  schedule.kernels = {copy_kernel(w, e, 256), copy_kernel(w, c, 256)};
  schedule.steps = {{Step::Kind::Kernel, 0}, {Step::Kind::Extern, 1}, {Step::Kind::Kernel, 1},
                    {Step::Kind::Extern, 3}};
  schedule.materialised.assign(g.values.size(), true);
  Schedule plain = schedule;
  REQUIRE(kiln::fusion::hoist_input_kernels(plain, g, 64, /*keep_peak=*/false).size() == 2);
  REQUIRE(kiln::fusion::hoist_input_kernels(schedule, g, 64, /*keep_peak=*/true).empty());
}

TEST_CASE("input-only kernels are hoisted, unless that raises the peak and the peak is to be kept", "[launch_groups]") {
  Fixture plain;
  REQUIRE(kiln::fusion::hoist_input_kernels(plain.schedule, plain.g, 64) == std::vector<int32_t>{0, 1});
  REQUIRE(plain.schedule.steps[1].kind == Step::Kind::Kernel);
  REQUIRE(plain.schedule.steps[1].index == 1);  // c's copy now runs second, alive through the peak at b

  // Hoisting c's copy would put its 1 KiB on top of step 2's 9 KiB peak: kept in place, which leaves one
  // kernel to hoist, and a group of one does not move anything.
  Fixture kept;
  REQUIRE(kiln::fusion::hoist_input_kernels(kept.schedule, kept.g, 64, /*keep_peak=*/true).empty());
  REQUIRE(kept.schedule.steps[3].kind == Step::Kind::Kernel);
  REQUIRE(kept.schedule.steps[3].index == 1);
}
