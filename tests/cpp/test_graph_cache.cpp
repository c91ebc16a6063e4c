// graph/graph_bytes, cache/graph_cache and cache/joint_cache: graphs, compiled-graph records and autodiff's joint
// graphs survive the trip to disk exactly, and bad entries are refused, never half-read.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>

#include "cache/graph_cache.h"
#include "cache/joint_cache.h"
#include "cache/kernel_cache.h"
#include "common/error.h"
#include "graph/graph_bytes.h"

using namespace kiln;
using namespace kiln::graph;

namespace {

TensorMeta meta(std::vector<int64_t> sizes, ScalarType dtype = ScalarType::Float) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  m.dtype = dtype;
  return m;
}

// One node per argument kind, with the doubles that text formats lose (NaN, infinities, -0.0, 0.1).
Graph every_argument_kind() {
  Graph g;
  TensorMeta in = meta({4, 6});
  in.device = Device{DeviceType::CUDA, 1};
  in.requires_grad = true;
  in.storage_offset = 3;
  in.strides = {1, 4};
  const ValueId x = g.add_input(in);
  // A constant as read_graph gives it back: no tensor (add_constant wants one, and this test has no Python).
  Value constant;
  constant.id = static_cast<ValueId>(g.values.size());
  constant.meta = meta({6}, ScalarType::BFloat16);
  constant.is_constant = true;
  g.values.push_back(constant);
  const ValueId c = constant.id;
  Node n;
  n.op = "aten::fake";
  n.overload = "every_kind";
  n.args = {NoneArg{},
            TensorArg{x},
            TensorListArg{{x, std::nullopt, c}},
            true,
            int64_t{-(int64_t{1} << 62)},
            -0.0,
            std::complex<double>(std::numeric_limits<double>::quiet_NaN(), -INFINITY),
            std::string("reduce\0mean", 11),
            std::vector<int64_t>{-1, 0, 1 << 20},
            std::vector<double>{INFINITY, 0.1, -1e-300},
            std::vector<bool>{true, false, true},
            ScalarTypeArg{ScalarType::Half},
            LayoutArg{2},
            MemoryFormatArg{1},
            Device{DeviceType::CUDA, 3}};
  for (size_t i = 0; i < n.args.size(); ++i) n.arg_names.push_back("a" + std::to_string(i));
  n.num_positional = 5;
  n.returns_list = true;
  n.mutates_args = true;
  n.is_view = true;
  const auto outs = g.add_node(n, {meta({2, 6}), meta({2, 6}, ScalarType::Long)});
  g.set_outputs({outs[1], x, c});
  return g;
}

std::string bytes_of(const Graph& g) {
  ByteWriter w;
  write_graph(w, g);
  return w.take();
}

Graph read_back(const std::string& bytes) {
  ByteReader r(bytes);
  Graph g = read_graph(r);
  REQUIRE(r.at_end());
  return g;
}

}  // namespace

TEST_CASE("graph bytes read back to the same graph, every argument kind and odd double included") {
  const Graph g = every_argument_kind();
  const std::string bytes = bytes_of(g);
  const Graph back = read_back(bytes);
  CHECK(bytes_of(back) == bytes);  // bit for bit, NaN and -0.0 included
  CHECK(back.to_string() == g.to_string());
  CHECK_THROWS_AS(back.verify(), Error);  // until the caller attaches the constant's tensor
  REQUIRE(back.values.size() == g.values.size());
  CHECK(back.values[1].is_constant);
  CHECK(!back.values[1].constant);  // tensors are the caller's to attach
  CHECK(back.values[0].meta.storage_offset == 3);
  CHECK(back.values[0].meta.device == (Device{DeviceType::CUDA, 1}));
  const Node& n = back.nodes.at(0);
  CHECK(std::signbit(std::get<double>(n.args[5])));
  CHECK(std::isnan(std::get<std::complex<double>>(n.args[6]).real()));
  CHECK(std::get<std::string>(n.args[7]).size() == 11);
  CHECK(!std::get<TensorListArg>(n.args[2]).ids[1].has_value());
  CHECK(n.num_positional == 5);
  CHECK((n.returns_list && n.mutates_args && n.is_view));
}

TEST_CASE("graph bytes that differ in one double differ") {
  Graph a = every_argument_kind(), b = every_argument_kind();
  b.nodes[0].args[5] = 0.0;  // -0.0 before
  CHECK(bytes_of(a) != bytes_of(b));
  REQUIRE(cache::graph_key(a, "cpu"));
  CHECK(cache::graph_key(a, "cpu")->size() == 64);  // SHA-256 hex
  CHECK(cache::graph_key(a, "cpu") != cache::graph_key(b, "cpu"));
  CHECK(cache::graph_key(a, "cpu") != cache::graph_key(a, "cuda"));
  CHECK(cache::graph_key(a, "cpu") == cache::graph_key(every_argument_kind(), "cpu"));
}

TEST_CASE("truncated or damaged graph bytes throw instead of reading garbage") {
  const std::string bytes = bytes_of(every_argument_kind());
  for (size_t cut : {size_t{0}, size_t{1}, bytes.size() / 2, bytes.size() - 1}) {
    std::string prefix = bytes.substr(0, cut);
    ByteReader reader(prefix);
    CHECK_THROWS_AS(read_graph(reader), Error);
  }
  std::string damaged = bytes;
  damaged[0] = static_cast<char>(0x7f);  // a value count far beyond the data
  ByteReader reader(damaged);
  CHECK_THROWS_AS(read_graph(reader), Error);
}

TEST_CASE("a compiled artefact is stored and read back whole; a damaged entry is a miss") {
  const auto dir = std::filesystem::temp_directory_path() / ("kiln_graph_cache_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  cache::CompiledArtifact record;
  record.optimised = every_argument_kind();
  record.constant_sources = {-1, 1, -1, -1};
  record.steps = {{fusion::Step::Kind::Kernel, 0}, {fusion::Step::Kind::Extern, 0}, {fusion::Step::Kind::Kernel, 1}};
  record.kernels = {{"kernel_0_add", {{0, ScalarType::Float, false}, {2, ScalarType::Float, true}}, {-1, 0}},
                    {"kernel_1_mul", {{3, ScalarType::Long, true}}, {-1}}};
  record.code.backend = "cuda";
  record.code.parts = {"// part 0", "// part 1"};
  record.code.kernels = {{"kernel_0_add", 4096, 256, 1, "pointwise_vec4", 0}, {"kernel_1_mul", 1, 32, 8, "column", 1}};
  record.code.group = {"group_0", 7, 128, 1, "group", 0};
  record.code.group_members = {0};
  // max-autotune's variants of a kernel, in its part, each with its own launch and sizes
  record.code.kernels[1].variants = {{"kernel_1_mul_t1", 2, 16, 16, "column", 1, {5, 6}},
                                     {"kernel_1_mul_t2", 1, 32, 4, "column", 1}};
  record.code.kernels[1].tune_key = std::string(64, 'a');
  const std::string key = cache::graph_key(record.optimised, "test").value();
  REQUIRE(!cache::build_identity().empty());
  CHECK(!cache::load_artifact(key, record.optimised));
  cache::store_artifact(key, record);
  std::optional<cache::CompiledArtifact> back = cache::load_artifact(key, record.optimised);
  REQUIRE(back);
  CHECK(bytes_of(back->optimised) == bytes_of(record.optimised));
  CHECK(back->constant_sources == record.constant_sources);
  REQUIRE(back->steps.size() == 3);
  CHECK(back->steps[1].kind == fusion::Step::Kind::Extern);
  CHECK(back->steps[2].index == 1);
  REQUIRE(back->kernels.size() == 2);
  CHECK(back->kernels[0].in_place_from == std::vector<int32_t>{-1, 0});
  CHECK(back->kernels[0].buffers[1].is_output);
  CHECK(back->kernels[1].buffers[0].dtype == ScalarType::Long);
  CHECK(back->code.backend == "cuda");
  CHECK(back->code.parts == record.code.parts);
  CHECK(back->code.kernels[1].block_y == 8);
  CHECK(back->code.kernels[1].part == 1);
  CHECK(back->code.kernels[0].strategy == "pointwise_vec4");
  CHECK(back->code.group.grid == 7);
  CHECK(back->code.group_members == std::vector<int32_t>{0});
  CHECK(back->code.kernels[0].variants.empty());
  CHECK(back->code.kernels[0].tune_key.empty());
  REQUIRE(back->code.kernels[1].variants.size() == 2);
  CHECK(back->code.kernels[1].tune_key == record.code.kernels[1].tune_key);
  const cache::KernelEntry& variant = back->code.kernels[1].variants[0];
  CHECK(variant.name == "kernel_1_mul_t1");
  CHECK((variant.grid == 2 && variant.block_x == 16 && variant.block_y == 16 && variant.part == 1));
  CHECK(variant.sizes == std::vector<int64_t>{5, 6});
  CHECK(back->code.kernels[1].variants[1].strategy == "column");

  // Damage the entry: its checksum fails, so it reads as missing and is counted.
  const auto entry = dir / "graphs" / (key + ".kgraph");
  REQUIRE(std::filesystem::exists(entry));
  const int64_t corrupt_before = cache::stats().corrupt_entries;
  {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.write("garbage!", 8);
  }
  CHECK(!cache::load_artifact(key, record.optimised));
  CHECK(cache::stats().corrupt_entries == corrupt_before + 1);
  // A well-formed entry whose content does not parse (a checksum that matches garbage) is refused too.
  cache::publish_content("graphs", key, ".kgraph", "not a record");
  CHECK(!cache::load_artifact(key, record.optimised));
  CHECK(cache::stats().corrupt_entries == corrupt_before + 2);
  ::unsetenv("KILN_CACHE_DIR");
  std::filesystem::remove_all(dir);
}

TEST_CASE("autodiff's joint graphs are stored and read back whole; a damaged entry is a miss") {
  const auto dir = std::filesystem::temp_directory_path() / ("kiln_joint_cache_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  Graph captured;  // y = x * w
  TensorMeta grad_meta = meta({4});
  grad_meta.requires_grad = true;
  const ValueId x = captured.add_input(grad_meta);
  const ValueId w = captured.add_input(meta({4}));
  Node mul;
  mul.op = "aten::mul";
  mul.overload = "Tensor";
  mul.args = {TensorArg{x}, TensorArg{w}};
  mul.arg_names = {"self", "other"};
  mul.num_positional = 2;
  captured.set_outputs({captured.add_node(mul, {grad_meta})[0]});
  autodiff::JointGraphs joint;
  joint.forward = std::make_shared<Graph>(captured);
  joint.backward = std::make_shared<Graph>();  // grad * w
  const ValueId grad = joint.backward->add_input(meta({4}));
  const ValueId saved = joint.backward->add_input(meta({4}));
  mul.args = {TensorArg{grad}, TensorArg{saved}};
  joint.backward->set_outputs({joint.backward->add_node(mul, {meta({4})})[0]});
  joint.num_outputs = 1;
  joint.output_differentiable = {true};
  joint.saved_from_input = {1};
  joint.grad_inputs = {0};
  joint.output_inputs = {-1, 0};
  joint.output_views = {nullptr, std::make_shared<Graph>(captured)};
  joint.saved_bytes = 16;
  joint.saved_tensors = 1;
  joint.saved_bytes_before_partition = 32;
  joint.recomputed_nodes = 2;

  const std::string key = cache::graph_key(captured, "joint test").value();
  REQUIRE(!cache::build_identity().empty());
  CHECK(!cache::load_joint_graphs(key, captured));
  cache::store_joint_graphs(key, joint, captured);
  std::optional<autodiff::JointGraphs> back = cache::load_joint_graphs(key, captured);
  REQUIRE(back);
  CHECK(bytes_of(*back->forward) == bytes_of(*joint.forward));
  CHECK(bytes_of(*back->backward) == bytes_of(*joint.backward));
  CHECK(back->num_outputs == 1);
  CHECK(back->output_differentiable == joint.output_differentiable);
  CHECK(back->updated_inputs.empty());
  CHECK(back->saved_from_input == joint.saved_from_input);
  CHECK(back->grad_inputs == joint.grad_inputs);
  CHECK(back->output_inputs == joint.output_inputs);
  REQUIRE(back->output_views.size() == 2);
  CHECK(back->output_views[0] == nullptr);
  REQUIRE(back->output_views[1] != nullptr);
  CHECK(bytes_of(*back->output_views[1]) == bytes_of(captured));
  CHECK(back->saved_bytes == 16);
  CHECK(back->saved_tensors == 1);
  CHECK(back->saved_bytes_before_partition == 32);
  CHECK(back->recomputed_nodes == 2);

  // A record whose checksum matches but whose content does not parse reads as missing and is counted.
  const int64_t corrupt_before = cache::stats().corrupt_entries;
  cache::publish_content("joints", key, ".kgraph", "not a record");
  CHECK(!cache::load_joint_graphs(key, captured));
  CHECK(cache::stats().corrupt_entries == corrupt_before + 1);
  ::unsetenv("KILN_CACHE_DIR");
  std::filesystem::remove_all(dir);
}
