// passes/ that prepare a graph that needs grad for autodiff: buffer updates made functional, attention as a kernel with
// a backward, training batch norm on cuDNN. Torch-free: a canned OpOracle stands in for torch's meta kernels.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/op_oracle.h"
#include "passes/functionalize_buffer_updates.h"
#include "passes/lower_attention.h"
#include "passes/use_cudnn_batch_norm.h"

using namespace kiln::graph;

namespace {

TensorMeta meta(std::vector<int64_t> sizes, DeviceType device = DeviceType::CPU, ScalarType dtype = ScalarType::Float) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  m.dtype = dtype;
  m.device.type = device;
  m.device.index = device == DeviceType::CUDA ? 0 : -1;
  return m;
}

Node op(const std::string& name, const std::string& overload, std::vector<ArgValue> args) {
  Node n;
  n.op = name;
  n.overload = overload;
  n.args = std::move(args);
  for (size_t i = 0; i < n.args.size(); ++i) n.arg_names.push_back("a" + std::to_string(i));
  n.num_positional = static_cast<int32_t>(n.args.size());
  return n;
}

// Answers every question with the same metas (and positional argument names); remembers the ops it was asked about.
class CannedOracle final : public OpOracle {
 public:
  explicit CannedOracle(std::vector<TensorMeta> answer) : answer_(std::move(answer)) {}
  std::vector<TensorMeta> complete_node(const Graph&, Node& node) override {
    asked.push_back(node.qualified_name());
    node.arg_names.clear();
    for (size_t i = 0; i < node.args.size(); ++i) node.arg_names.push_back("a" + std::to_string(i));
    node.num_positional = static_cast<int32_t>(node.args.size());
    return answer_;
  }
  std::vector<std::string> asked;

 private:
  std::vector<TensorMeta> answer_;
};

}  // namespace

TEST_CASE("buffer updates of inputs become functional; an input a batch norm also writes stays in place") {
  Graph g;  // s.add_(1); x * s
  ValueId x = g.add_input(meta({3}));
  g.values[x].meta.requires_grad = true;
  ValueId s = g.add_input(meta({}));
  Node update = op("aten::add_", "Tensor", {TensorArg{s}, int64_t{1}, int64_t{1}});
  update.mutates_args = true;
  ValueId updated = g.add_node(update, {meta({})})[0];
  ValueId y = g.add_node(op("aten::mul", "Tensor", {TensorArg{x}, TensorArg{s}}), {meta({3})})[0];
  g.set_outputs({y});

  const std::vector<kiln::passes::BufferUpdate> updates = kiln::passes::functionalize_buffer_updates(g);
  REQUIRE(updates.size() == 1);
  CHECK(updates[0].input_index == 1);
  CHECK(updates[0].final_value == updated);
  CHECK(g.nodes[0].qualified_name() == "aten::add.Tensor");
  CHECK_FALSE(g.nodes[0].mutates_args);
  CHECK(std::get<TensorArg>(g.nodes[1].args[1]).id == updated);  // the reader sees the new value
  g.verify();

  Graph h;  // running_mean.add_(1), then a training batch norm that writes running_mean itself
  ValueId input = h.add_input(meta({2, 3, 4}));
  ValueId mean = h.add_input(meta({3}));
  ValueId var = h.add_input(meta({3}));
  Node bump = op("aten::add_", "Tensor", {TensorArg{mean}, int64_t{1}, int64_t{1}});
  bump.mutates_args = true;
  ValueId bumped = h.add_node(bump, {meta({3})})[0];
  Node norm = op("aten::native_batch_norm", "default",
                 {TensorArg{input}, NoneArg{}, NoneArg{}, TensorArg{bumped}, TensorArg{var}, true, 0.1, 1e-5});
  norm.mutates_args = true;
  ValueId out = h.add_node(norm, {meta({2, 3, 4}), meta({3}), meta({3})})[0];
  h.set_outputs({out});
  CHECK(kiln::passes::functionalize_buffer_updates(h).empty());
  CHECK(h.nodes[0].qualified_name() == "aten::add_.Tensor");  // aliased by an op that writes buffers: kept
}

TEST_CASE("attention that needs grad becomes the kernel with a backward; a masked one stays") {
  auto attention = [](ArgValue mask) {
    Graph g;
    std::vector<ValueId> qkv;
    for (int i = 0; i < 3; ++i) {
      qkv.push_back(g.add_input(meta({2, 2, 8, 16})));
      g.values[qkv.back()].meta.requires_grad = true;
    }
    Node node = op("aten::scaled_dot_product_attention", "default",
                   {TensorArg{qkv[0]}, TensorArg{qkv[1]}, TensorArg{qkv[2]}, mask, 0.0, true, NoneArg{}, false});
    ValueId out = g.add_node(node, {meta({2, 2, 8, 16})})[0];
    g.values[out].meta.requires_grad = true;
    g.set_outputs({out});
    return g;
  };
  Graph g = attention(NoneArg{});
  const ValueId out = g.outputs[0];
  CannedOracle oracle({meta({2, 2, 8, 16}), meta({2, 2, 8})});
  kiln::passes::lower_attention_for_autodiff(g, oracle);
  CHECK(oracle.asked == std::vector<std::string>{"aten::_scaled_dot_product_flash_attention_for_cpu.default"});
  REQUIRE(g.nodes.size() == 1);
  CHECK(g.nodes[0].qualified_name() == "aten::_scaled_dot_product_flash_attention_for_cpu.default");
  REQUIRE(g.nodes[0].outputs.size() == 2);
  CHECK(g.nodes[0].outputs[0] == out);  // the output keeps its id and recorded meta
  CHECK(g.value(out).meta.requires_grad);
  const Value& logsumexp = g.value(g.nodes[0].outputs[1]);
  CHECK(logsumexp.meta.sizes == std::vector<int64_t>{2, 2, 8});
  CHECK_FALSE(logsumexp.meta.requires_grad);
  CHECK(logsumexp.producer == 0);
  g.verify();

  Graph masked = attention(TensorArg{0});
  CannedOracle unused({});
  kiln::passes::lower_attention_for_autodiff(masked, unused);
  CHECK(masked.nodes[0].qualified_name() == "aten::scaled_dot_product_attention.default");
  CHECK(unused.asked.empty());
}

TEST_CASE("training batch norm on CUDA takes cuDNN's kernel where eager would, with an opaque workspace") {
  auto batch_norm = [](double eps) {
    Graph g;
    ValueId x = g.add_input(meta({4, 3, 8, 8}, DeviceType::CUDA));
    std::vector<ValueId> vectors;
    for (int i = 0; i < 4; ++i) vectors.push_back(g.add_input(meta({3}, DeviceType::CUDA)));
    Node norm = op("aten::native_batch_norm", "default",
                   {TensorArg{x}, TensorArg{vectors[0]}, TensorArg{vectors[1]}, TensorArg{vectors[2]},
                    TensorArg{vectors[3]}, true, 0.1, eps});
    norm.mutates_args = true;
    const TensorMeta vector = meta({3}, DeviceType::CUDA);
    std::vector<ValueId> outs = g.add_node(norm, {meta({4, 3, 8, 8}, DeviceType::CUDA), vector, vector});
    g.set_outputs({outs[0]});
    return g;
  };
  const TensorMeta workspace = meta({0}, DeviceType::CUDA, ScalarType::Byte);
  CHECK(kiln::passes::is_opaque_workspace(workspace));
  CHECK_FALSE(kiln::passes::is_opaque_workspace(meta({3}, DeviceType::CUDA)));
  CannedOracle oracle({meta({4, 3, 8, 8}, DeviceType::CUDA), meta({3}, DeviceType::CUDA), meta({3}, DeviceType::CUDA),
                       workspace});
  const kiln::passes::CudnnBatchNorm cudnn{true, 1e-5};

  Graph g = batch_norm(1e-5);
  const std::vector<ValueId> recorded = g.nodes[0].outputs;
  CHECK_FALSE(kiln::passes::use_cudnn_batch_norm(g, oracle, kiln::passes::CudnnBatchNorm{}));  // no cuDNN here
  CHECK(kiln::passes::use_cudnn_batch_norm(g, oracle, cudnn));
  CHECK(g.nodes[0].qualified_name() == "aten::cudnn_batch_norm.default");
  REQUIRE(g.nodes[0].outputs.size() == 4);
  CHECK(std::vector<ValueId>(g.nodes[0].outputs.begin(), g.nodes[0].outputs.begin() + 3) == recorded);
  CHECK(kiln::passes::is_opaque_workspace(g.value(g.nodes[0].outputs[3]).meta));
  g.verify();

  Graph small_eps = batch_norm(1e-6);  // below cuDNN's minimum: eager keeps the native kernel
  CHECK_FALSE(kiln::passes::use_cudnn_batch_norm(small_eps, oracle, cudnn));
  CHECK(small_eps.nodes[0].qualified_name() == "aten::native_batch_norm.default");
}
