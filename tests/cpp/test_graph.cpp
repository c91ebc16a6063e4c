// graph/: builder, printer, verifier, JSON and the recorder-record conversion (all torch-free).
#include <catch2/catch.hpp>

#include <cmath>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/graph_device.h"
#include "graph/py_records.h"
#include "python_env.h"

#if __has_include(<nlohmann/json.hpp>)
#include <nlohmann/json.hpp>
#endif

using namespace kiln::graph;

namespace {
TensorMeta f32(std::vector<int64_t> sizes) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  return m;
}

// The graph F.linear(x, w, b) records: t(w), then addmm(b, x, t).
Graph linear_graph() {
  Graph g;
  ValueId x = g.add_input(f32({32, 10}));
  ValueId w = g.add_input(f32({50, 10}));
  ValueId b = g.add_input(f32({50}));
  Node t;
  t.op = "aten::t";
  t.overload = "default";
  t.args = {TensorArg{w}};
  t.arg_names = {"self"};
  t.num_positional = 1;
  t.is_view = true;
  TensorMeta t_meta = f32({10, 50});
  t_meta.strides = {1, 10};
  ValueId wt = g.add_node(t, {t_meta})[0];
  Node addmm;
  addmm.op = "aten::addmm";
  addmm.overload = "default";
  addmm.args = {TensorArg{b}, TensorArg{x}, TensorArg{wt}, int64_t{1}, int64_t{1}};
  addmm.arg_names = {"self", "mat1", "mat2", "beta", "alpha"};
  addmm.num_positional = 3;
  ValueId out = g.add_node(addmm, {f32({32, 50})})[0];
  g.set_outputs({out});
  return g;
}
}  // namespace

TEST_CASE("builder assigns value ids in order and links producers") {
  Graph g = linear_graph();
  REQUIRE(g.values.size() == 5);
  CHECK(g.inputs == std::vector<ValueId>{0, 1, 2});
  CHECK(g.values[3].producer == 0);
  CHECK(g.values[4].producer == 1);
  CHECK(g.values[1].is_input);
  CHECK(g.values[1].input_index == 1);
  CHECK(g.nodes[1].qualified_name() == "aten::addmm.default");
  CHECK_NOTHROW(g.verify());
}

TEST_CASE("printer names ops, shapes, strides and kwarg-only arguments") {
  const std::string text = linear_graph().to_string();
  CHECK(text ==
        "graph(%0 : f32[32, 10], %1 : f32[50, 10], %2 : f32[50]):\n"
        "  %3 : f32[10, 50](1, 10) = aten::t.default(%1)\n"
        "  %4 : f32[32, 50] = aten::addmm.default(%2, %0, %3, beta=1, alpha=1)\n"
        "  return (%4)\n");
}

TEST_CASE("printer shows list outputs, enums, devices and grad") {
  Graph g;
  TensorMeta in = f32({4, 6});
  in.device = Device{DeviceType::CUDA, 0};
  in.requires_grad = true;
  ValueId x = g.add_input(in);
  Node split;
  split.op = "aten::split";
  split.overload = "Tensor";
  split.args = {TensorArg{x}, int64_t{2}, int64_t{0}};
  split.arg_names = {"self", "split_size", "dim"};
  split.num_positional = 3;
  split.returns_list = true;
  auto parts = g.add_node(split, {f32({2, 6}), f32({2, 6})});
  Node zeros;
  zeros.op = "aten::zeros";
  zeros.overload = "default";
  zeros.args = {std::vector<int64_t>{3}, ScalarTypeArg{ScalarType::BFloat16}, NoneArg{},
                Device{DeviceType::CUDA, 0}, false};
  zeros.arg_names = {"size", "dtype", "layout", "device", "pin_memory"};
  zeros.num_positional = 1;
  g.add_node(zeros, {f32({3})});
  Node add;
  add.op = "aten::add";
  add.overload = "Tensor";
  add.args = {TensorArg{parts[0]}, 1.0, 0.1, std::vector<double>{2.0, 0.5}};
  add.arg_names = {"self", "other", "alpha", "scales"};  // not add's real schema: printing only
  add.num_positional = 2;
  g.add_node(add, {f32({2, 6})});
  g.set_outputs({parts[1]});
  const std::string text = g.to_string();
  CHECK_THAT(text, Catch::Contains("aten::add.Tensor(%1, 1.0, alpha=0.1, scales=[2.0, 0.5])"));
  CHECK_THAT(text, Catch::Contains("%0 : f32[4, 6]@cuda:0 grad"));
  CHECK_THAT(text, Catch::Contains("%1 : f32[2, 6], %2 : f32[2, 6] = aten::split.Tensor(%0, 2, 0)  # list"));
  CHECK_THAT(text,
             Catch::Contains("aten::zeros.default([3], dtype=bf16, layout=None, device=cuda:0, pin_memory=False)"));
  CHECK_THAT(text, Catch::Contains("return (%2)"));
}

TEST_CASE("verifier rejects uses before definitions and undefined outputs") {
  SECTION("use before definition") {
    Graph g = linear_graph();
    std::swap(g.nodes[0], g.nodes[1]);  // addmm now reads %3 before t defines it
    g.values[3].producer = 1;
    g.values[4].producer = 0;
    CHECK_THROWS_WITH(g.verify(), Catch::Contains("aten::addmm.default") && Catch::Contains("uses %3 before"));
  }
  SECTION("undefined output") {
    Graph g = linear_graph();
    g.outputs = {17};
    CHECK_THROWS_WITH(g.verify(), Catch::Contains("graph output %17 is never defined"));
  }
  SECTION("meta without strides") {
    Graph g = linear_graph();
    g.values[4].meta.strides.clear();
    CHECK_THROWS_WITH(g.verify(), Catch::Contains("%4 has 2 sizes but 0 strides"));
  }
  SECTION("errors are internal errors") {
    Graph g = linear_graph();
    g.outputs = {-1};
    try {
      g.verify();
      FAIL("no throw");
    } catch (const kiln::Error& e) {
      CHECK(e.kind() == kiln::ErrorKind::Internal);
    }
  }
}

#if __has_include(<nlohmann/json.hpp>)
TEST_CASE("JSON carries values, named args and outputs") {
  auto doc = nlohmann::json::parse(linear_graph().to_json());
  REQUIRE(doc["nodes"].size() == 2);
  const auto& addmm = doc["nodes"][1];
  CHECK(addmm["op"] == "aten::addmm");
  CHECK(addmm["args"][3]["name"] == "beta");
  CHECK(addmm["args"][3]["kwarg_only"] == true);
  CHECK(addmm["args"][0]["kind"] == "tensor");
  CHECK(addmm["args"][0]["value"] == 2);
  CHECK(doc["values"][3]["meta"]["strides"] == nlohmann::json::array({1, 10}));
  CHECK(doc["values"][0]["meta"]["dtype"] == "f32");
  CHECK(doc["outputs"] == nlohmann::json::array({4}));
}

TEST_CASE("graph_from_json reads back what to_json wrote, constants without tensors") {
  Graph g = linear_graph();
  TensorMeta scalar = f32({});
  const ValueId c = g.add_constant(scalar);
  Node mixed;
  mixed.op = "kiln::test";
  mixed.overload = "default";
  mixed.args = {TensorListArg{{c, std::nullopt}}, std::nan(""), std::vector<double>{1.5, -INFINITY},
                std::complex<double>(1, -2), ScalarTypeArg{ScalarType::BFloat16}, Device{DeviceType::CUDA, 1},
                std::vector<bool>{true, false}, std::string("mean"), NoneArg{}, LayoutArg{0}, MemoryFormatArg{2}};
  mixed.arg_names = {"tensors", "a", "b", "c", "dtype", "device", "flags", "reduction", "none", "layout", "format"};
  mixed.num_positional = 4;
  g.add_node(mixed, {f32({2})});
  const std::string text = g.to_json();
  const Graph back = graph_from_json(text);
  back.verify(/*constants_hold_tensors=*/false);
  CHECK_THROWS(back.verify());
  CHECK(back.to_json() == text);
  CHECK(back.values[c].is_constant);
  CHECK_FALSE(back.values[c].constant);
  CHECK(back.nodes[2].num_positional == 4);
  CHECK(std::isnan(std::get<double>(back.nodes[2].args[1])));
}

TEST_CASE("graph_from_json rejects text that is not a graph, naming what is wrong") {
  CHECK_THROWS_WITH(graph_from_json("{not json"), Catch::Contains("does not parse"));
  CHECK_THROWS_WITH(graph_from_json("{\"values\": []}"), Catch::Contains("malformed"));
  std::string text = linear_graph().to_json();
  text.replace(text.find("\"tensor\""), 8, "\"tensr\"");
  CHECK_THROWS_WITH(graph_from_json(text), Catch::Contains("unknown argument kind 'tensr'"));
}
#endif

TEST_CASE("recorder records become a verified graph; constants are held and released") {
  kiln::testing::ensure_python();
  PyObject* records = kiln::testing::run_and_get(R"(
class Payload:  # stands in for a constant tensor
    pass
const = Payload()
meta = ((2, 3), (3, 1), 0, 6, 0, -1, False)
values = [("input", meta, 0), ("constant", meta, const), ("node", meta, 0), ("node", ((2,), (1,), 0, 6, 0, -1, False), 1)]
nodes = [
    ("aten::add", "Tensor", [("tensor", 0), ("tensor", 1), ("int", 1)], ["self", "other", "alpha"], 2, [2], False, False, False),
    ("aten::sum", "dim_IntList", [("tensor", 2), ("ints", [1]), ("bool", False), ("dtype", 15)],
     ["self", "dim", "keepdim", "dtype"], 3, [3], False, False, False),
]
records = (values, nodes, [3, 1], const)
)",
                                                 "records");
  PyObject* constant = PyTuple_GET_ITEM(records, 3);
  const Py_ssize_t refs_before = Py_REFCNT(constant);
  {
    auto g = graph_from_records(PyTuple_GET_ITEM(records, 0), PyTuple_GET_ITEM(records, 1),
                                PyTuple_GET_ITEM(records, 2));
    CHECK(Py_REFCNT(constant) == refs_before + 1);  // the graph owns one reference
    REQUIRE(g->nodes.size() == 2);
    CHECK(g->values[1].is_constant);
    CHECK(g->values[1].constant.get() == constant);
    CHECK(g->inputs == std::vector<ValueId>{0});
    CHECK(g->outputs == std::vector<ValueId>{3, 1});
    CHECK(std::get<ScalarTypeArg>(g->nodes[1].args[3]).type == ScalarType::BFloat16);
    CHECK_THAT(g->to_string(), Catch::Contains("%1 : f32[2, 3] = constant"));
    CHECK_THAT(g->to_string(),
               Catch::Contains("%3 : f32[2] = aten::sum.dim_IntList(%2, [1], False, dtype=bf16)"));
  }
  CHECK(Py_REFCNT(constant) == refs_before);  // released with the graph

  PyObject* bad = kiln::testing::run_and_get(
      "bad = ([], [('aten::relu', 'default', [('tensor', 0)], ['self'], 1, [], False, False, False)], [])", "bad");
  CHECK_THROWS_WITH(graph_from_records(PyTuple_GET_ITEM(bad, 0), PyTuple_GET_ITEM(bad, 1), PyTuple_GET_ITEM(bad, 2)),
                    Catch::Contains("aten::relu.default") && Catch::Contains("uses %0 before"));
  PyObject* bad_tag = kiln::testing::run_and_get(
      "bad = ([], [('aten::relu', 'default', [('pointer', 0)], ['self'], 1, [], False, False, False)], [])", "bad");
  CHECK_THROWS_WITH(
      graph_from_records(PyTuple_GET_ITEM(bad_tag, 0), PyTuple_GET_ITEM(bad_tag, 1), PyTuple_GET_ITEM(bad_tag, 2)),
      Catch::Contains("unknown argument tag 'pointer'"));
  Py_DECREF(records);
  Py_DECREF(bad);
  Py_DECREF(bad_tag);
}

TEST_CASE("a graph's device ignores values nothing refers to") {
  // A value nothing refers to any more (a folded node's result) stays in the value table: it is no second device.
  Graph g = linear_graph();
  for (Value& v : g.values) v.meta.device = Device{DeviceType::CUDA, 0};
  TensorMeta cpu = f32({4});
  g.add_constant(cpu);
  std::string why;
  std::optional<Device> device = single_device(g, why);
  REQUIRE(device);
  CHECK(device->type == DeviceType::CUDA);
  // Read by a node, it is one.
  Node neg;
  neg.op = "aten::neg";
  neg.overload = "default";
  neg.args = {TensorArg{static_cast<ValueId>(g.values.size() - 1)}};
  neg.arg_names = {"self"};
  neg.num_positional = 1;
  g.add_node(neg, {cpu});
  CHECK_FALSE(single_device(g, why));
  CHECK(why.find("more than one device") != std::string::npos);
}
