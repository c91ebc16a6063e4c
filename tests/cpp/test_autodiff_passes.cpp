// passes/ that prepare a graph that needs grad for autodiff: buffer updates made functional, attention as a kernel with
// a backward, training batch norm on cuDNN, cross entropy without its log_softmax. Torch-free: a canned OpOracle
// stands in for torch's meta kernels.
#include <catch2/catch.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/op_oracle.h"
#include "passes/functionalize_buffer_updates.h"
#include "passes/lower_attention.h"
#include "passes/lower_cross_entropy.h"
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

// Answers each op by name (an op it has no answer for fails the test).
class ScriptedOracle final : public OpOracle {
 public:
  explicit ScriptedOracle(std::map<std::string, std::vector<TensorMeta>> answers) : answers_(std::move(answers)) {}
  std::vector<TensorMeta> complete_node(const Graph& g, Node& node) override {
    auto it = answers_.find(node.qualified_name());
    REQUIRE(it != answers_.end());
    return CannedOracle(it->second).complete_node(g, node);
  }

 private:
  std::map<std::string, std::vector<TensorMeta>> answers_;
};

// Answers through a function of the node (arguments named positionally).
class FunctionOracle final : public OpOracle {
 public:
  explicit FunctionOracle(std::function<std::vector<TensorMeta>(const Graph&, const Node&)> answer)
      : answer_(std::move(answer)) {}
  std::vector<TensorMeta> complete_node(const Graph& g, Node& node) override {
    CannedOracle({}).complete_node(g, node);
    return answer_(g, node);
  }

 private:
  std::function<std::vector<TensorMeta>(const Graph&, const Node&)> answer_;
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

TEST_CASE("attention that needs grad becomes the kernel with a backward; a mask that needs grad stays") {
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

TEST_CASE("a CUDA attention mask becomes the memory-efficient kernel's bias, its rows padded to 16 where needed") {
  auto attention = [](int64_t length, ScalarType mask_dtype, std::vector<int64_t> mask_sizes) {
    Graph g;
    std::vector<ValueId> qkv;
    for (int i = 0; i < 3; ++i) {
      qkv.push_back(g.add_input(meta({2, 2, length, 16}, DeviceType::CUDA)));
      g.values[qkv.back()].meta.requires_grad = true;
    }
    const ValueId mask = g.add_input(meta(std::move(mask_sizes), DeviceType::CUDA, mask_dtype));
    Node node = op("aten::scaled_dot_product_attention", "default",
                   {TensorArg{qkv[0]}, TensorArg{qkv[1]}, TensorArg{qkv[2]}, TensorArg{mask}, 0.0, false, NoneArg{}, false});
    ValueId out = g.add_node(node, {meta({2, 2, length, 16}, DeviceType::CUDA)})[0];
    g.values[out].meta.requires_grad = true;
    g.set_outputs({out});
    return g;
  };
  auto names = [](const Graph& g) {
    std::vector<std::string> n;
    for (const Node& node : g.nodes) n.push_back(node.qualified_name());
    return n;
  };
  const std::vector<TensorMeta> kernel = {meta({2, 2, 37, 16}, DeviceType::CUDA), meta({2, 2, 64}, DeviceType::CUDA),
                                          meta({}, DeviceType::CUDA, ScalarType::Long),
                                          meta({}, DeviceType::CUDA, ScalarType::Long)};
  // A boolean (batch, 1, 37, 37) mask: 0 / -inf in the query's dtype, written into rows of 48 and viewed back.
  Graph g = attention(37, ScalarType::Bool, {2, 1, 37, 37});
  TensorMeta sliced = meta({2, 1, 37, 37}, DeviceType::CUDA);
  sliced.strides = {37 * 48, 37 * 48, 48, 1};
  ScriptedOracle oracle({{"aten::logical_not.default", {meta({2, 1, 37, 37}, DeviceType::CUDA, ScalarType::Bool)}},
                         {"aten::masked_fill.Scalar", {meta({2, 1, 37, 37}, DeviceType::CUDA)}},
                         {"aten::constant_pad_nd.default", {meta({2, 1, 37, 48}, DeviceType::CUDA)}},
                         {"aten::slice.Tensor", {sliced}},
                         {"aten::_scaled_dot_product_efficient_attention.default", kernel}});
  kiln::passes::lower_attention_for_autodiff(g, oracle);
  CHECK(names(g) == std::vector<std::string>{"aten::logical_not.default", "aten::_to_copy.default",
                                             "aten::masked_fill.Scalar", "aten::constant_pad_nd.default",
                                             "aten::slice.Tensor", "aten::expand.default",
                                             "aten::_scaled_dot_product_efficient_attention.default"});
  CHECK(std::get<std::vector<int64_t>>(g.nodes[3].args[1]) == std::vector<int64_t>{0, 11});
  const TensorMeta& bias = g.value(std::get<TensorArg>(g.nodes.back().args[3]).id).meta;
  CHECK(bias.sizes == std::vector<int64_t>{2, 2, 37, 37});
  CHECK(bias.strides == std::vector<int64_t>{37 * 48, 0, 48, 1});
  CHECK(g.nodes.back().outputs[0] == g.outputs[0]);
  g.verify();

  // An additive mask of the query's dtype whose rows are already aligned: only broadcast.
  Graph aligned = attention(32, ScalarType::Float, {32, 32});
  ScriptedOracle kernel_only({{"aten::_scaled_dot_product_efficient_attention.default", kernel}});
  kiln::passes::lower_attention_for_autodiff(aligned, kernel_only);
  CHECK(names(aligned) == std::vector<std::string>{"aten::expand.default",
                                                   "aten::_scaled_dot_product_efficient_attention.default"});
  CHECK(aligned.value(std::get<TensorArg>(aligned.nodes.back().args[3]).id).meta.strides ==
        std::vector<int64_t>{0, 0, 32, 1});

  // A float64 mask with float32 attention: left to the math backward.
  Graph other = attention(32, ScalarType::Double, {32, 32});
  ScriptedOracle none({});
  kiln::passes::lower_attention_for_autodiff(other, none);
  CHECK(names(other) == std::vector<std::string>{"aten::scaled_dot_product_attention.default"});
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

TEST_CASE("cross entropy reads one logit per row instead of a log_softmax; other readers keep the log_softmax") {
  // the metas of the lowering's ops over a [4, 5] input, as ATen's rules give them
  FunctionOracle oracle([](const Graph& g, const Node& n) -> std::vector<TensorMeta> {
    const std::string name = n.qualified_name();
    const TensorMeta& first = g.value(std::get<TensorArg>(n.args[0]).id).meta;
    if (name == "aten::unsqueeze.default") return {meta({4, 1}, DeviceType::CPU, first.dtype)};
    if (name == "aten::eq.Scalar" || name == "aten::ne.Scalar")
      return {meta({4, 1}, DeviceType::CPU, ScalarType::Bool)};
    if (name == "aten::masked_fill.Scalar") return {meta({4, 1}, DeviceType::CPU, first.dtype)};
    if (name == "aten::sum.default") {
      const auto* dtype = std::get_if<ScalarTypeArg>(&n.args[1]);
      return {meta({}, DeviceType::CPU, dtype ? dtype->type : first.dtype)};
    }
    if (name == "aten::div.Tensor" || name == "aten::view.default") return {meta({})};
    if (name == "aten::squeeze.dim") return {meta({4})};
    return {meta({4, 1})};  // logsumexp, gather, sub
  });
  // x -> log_softmax (and autograd's dead detach of it) -> nll_loss_forward(reduction, weight)
  auto loss = [](int64_t reduction, bool weighted, bool return_log_softmax, bool read_total_weight) {
    Graph g;
    ValueId x = g.add_input(meta({4, 5}));
    g.values[x].meta.requires_grad = true;
    ValueId t = g.add_input(meta({4}, DeviceType::CPU, ScalarType::Long));
    ValueId w = g.add_input(meta({5}));
    TensorMeta log_probs = meta({4, 5});
    log_probs.requires_grad = true;
    ValueId ls = g.add_node(op("aten::_log_softmax", "default", {TensorArg{x}, int64_t{1}, false}), {log_probs})[0];
    Node detach = op("aten::detach", "default", {TensorArg{ls}});
    detach.is_view = true;
    g.add_node(detach, {meta({4, 5})});
    TensorMeta out = meta(reduction == 0 ? std::vector<int64_t>{4} : std::vector<int64_t>{});
    out.requires_grad = true;
    std::vector<ValueId> nll = g.add_node(
        op("aten::nll_loss_forward", "default",
           {TensorArg{ls}, TensorArg{t}, weighted ? ArgValue{TensorArg{w}} : ArgValue{NoneArg{}}, reduction,
            int64_t{-100}}),
        {out, meta({})});
    std::vector<ValueId> outputs{nll[0]};
    if (return_log_softmax) outputs.push_back(ls);
    if (read_total_weight)
      outputs.push_back(g.add_node(op("aten::mul", "Tensor", {TensorArg{nll[1]}, 2.0}), {meta({})})[0]);
    g.set_outputs(outputs);
    return g;
  };
  auto reads = [](const Graph& g, ValueId v) {
    std::vector<std::string> readers;
    for (const Node& n : g.nodes)
      for (const ArgValue& a : n.args)
        if (const auto* t = std::get_if<TensorArg>(&a); t && t->id == v) readers.push_back(n.qualified_name());
    return readers;
  };

  Graph mean = loss(1, false, false, false);
  const ValueId output = mean.outputs[0], total_weight = mean.nodes[2].outputs[1];
  REQUIRE(kiln::passes::lower_cross_entropy(mean, oracle));
  mean.verify();
  CHECK(reads(mean, 3) == std::vector<std::string>{"aten::detach.default"});  // the log_softmax: only its dead detach
  CHECK(mean.nodes[mean.value(output).producer].qualified_name() == "aten::div.Tensor");
  CHECK(mean.nodes[mean.value(total_weight).producer].qualified_name() == "aten::sum.default");
  bool gathers = false;
  for (const Node& n : mean.nodes) {
    if (n.qualified_name() != "aten::gather.default") continue;
    gathers = true;
    CHECK(mean.value(n.outputs[0]).meta.requires_grad);  // computed from x
    const ValueId index = std::get<TensorArg>(n.args[2]).id;
    CHECK(mean.nodes[mean.value(index).producer].qualified_name() == "aten::masked_fill.Scalar");
    CHECK_FALSE(mean.value(index).meta.requires_grad);
  }
  CHECK(gathers);

  Graph none = loss(0, false, false, false);
  REQUIRE(kiln::passes::lower_cross_entropy(none, oracle));
  CHECK(none.nodes[none.value(none.outputs[0]).producer].qualified_name() == "aten::squeeze.dim");
  none.verify();

  for (Graph kept : {loss(1, false, true, false), loss(1, true, false, false), loss(0, false, false, true)}) {
    CHECK_FALSE(kiln::passes::lower_cross_entropy(kept, oracle));  // returned log_softmax, class weights, total_weight
    CHECK(kept.nodes[2].qualified_name() == "aten::nll_loss_forward.default");
  }
}
