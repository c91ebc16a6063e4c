// Graph construction and the small name tables shared by the printer and JSON writer.
#include "graph/graph.h"

#include <algorithm>
#include <array>

#include "common/error.h"

namespace kiln::graph {

namespace {
struct ScalarTypeName {
  ScalarType type;
  const char* name;
  bool floating_or_complex;
};
constexpr std::array<ScalarTypeName, 23> kScalarTypeNames = {{
    {ScalarType::Byte, "u8", false},          {ScalarType::Char, "i8", false},
    {ScalarType::Short, "i16", false},        {ScalarType::Int, "i32", false},
    {ScalarType::Long, "i64", false},         {ScalarType::Half, "f16", true},
    {ScalarType::Float, "f32", true},         {ScalarType::Double, "f64", true},
    {ScalarType::ComplexHalf, "c32", true},   {ScalarType::ComplexFloat, "c64", true},
    {ScalarType::ComplexDouble, "c128", true}, {ScalarType::Bool, "b8", false},
    {ScalarType::QInt8, "qi8", false},        {ScalarType::QUInt8, "qu8", false},
    {ScalarType::QInt32, "qi32", false},      {ScalarType::BFloat16, "bf16", true},
    {ScalarType::Float8_e5m2, "f8e5m2", true}, {ScalarType::Float8_e4m3fn, "f8e4m3fn", true},
    {ScalarType::Float8_e5m2fnuz, "f8e5m2fnuz", true},
    {ScalarType::Float8_e4m3fnuz, "f8e4m3fnuz", true},
    {ScalarType::UInt16, "u16", false},       {ScalarType::UInt32, "u32", false},
    {ScalarType::UInt64, "u64", false},
}};

struct DeviceTypeName {
  DeviceType type;
  const char* name;
};
constexpr std::array<DeviceTypeName, 7> kDeviceTypeNames = {{
    {DeviceType::CPU, "cpu"}, {DeviceType::CUDA, "cuda"}, {DeviceType::HIP, "hip"},
    {DeviceType::XLA, "xla"}, {DeviceType::XPU, "xpu"},   {DeviceType::MPS, "mps"},
    {DeviceType::Meta, "meta"},
}};

const ScalarTypeName* find_scalar_type(ScalarType t) {
  for (const auto& entry : kScalarTypeNames)
    if (entry.type == t) return &entry;
  return nullptr;
}
}  // namespace

std::string scalar_type_name(ScalarType t) {
  const ScalarTypeName* entry = find_scalar_type(t);
  return entry ? entry->name : "dtype" + std::to_string(static_cast<int>(t));
}

bool is_floating_or_complex(ScalarType t) {
  const ScalarTypeName* entry = find_scalar_type(t);
  return entry && entry->floating_or_complex;
}

std::string device_type_name(DeviceType t) {
  for (const auto& entry : kDeviceTypeNames)
    if (entry.type == t) return entry.name;
  return "device" + std::to_string(static_cast<int>(t));
}

const TensorMeta* tensor_meta(const Graph& g, const ArgValue& arg) {
  const auto* t = std::get_if<TensorArg>(&arg);
  return t ? &g.value(t->id).meta : nullptr;
}

std::vector<ValueId> storage_roots(const Graph& g) {
  std::vector<ValueId> root(g.values.size());
  for (size_t v = 0; v < root.size(); ++v) root[v] = static_cast<ValueId>(v);
  for (const Node& node : g.nodes) {  // execution order: an argument's root is final before its use
    if (!node.is_view && !node.mutates_args) continue;
    ValueId base = -1;
    for (const ArgValue& arg : node.args)
      for_each_tensor(arg, [&](ValueId id) {
        if (base < 0) base = root[id];
      });
    if (base >= 0)
      for (ValueId out : node.outputs) root[out] = base;
  }
  return root;
}

bool is_read(const Graph& g, ValueId v) {
  if (std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end()) return true;
  for (const Node& node : g.nodes)
    for (const ArgValue& arg : node.args) {
      bool read = false;
      for_each_tensor(arg, [&](ValueId id) { read = read || id == v; });
      if (read) return true;
    }
  return false;
}

namespace {

struct ElementSize {
  ScalarType type;
  int64_t bytes;
};
constexpr ElementSize kElementSizes[] = {
    {ScalarType::Byte, 1},        {ScalarType::Char, 1},          {ScalarType::Short, 2},
    {ScalarType::Int, 4},         {ScalarType::Long, 8},          {ScalarType::Half, 2},
    {ScalarType::Float, 4},       {ScalarType::Double, 8},        {ScalarType::ComplexHalf, 4},
    {ScalarType::ComplexFloat, 8}, {ScalarType::ComplexDouble, 16}, {ScalarType::Bool, 1},
    {ScalarType::QInt8, 1},       {ScalarType::QUInt8, 1},        {ScalarType::QInt32, 4},
    {ScalarType::BFloat16, 2},    {ScalarType::Float8_e5m2, 1},   {ScalarType::Float8_e4m3fn, 1},
    {ScalarType::Float8_e5m2fnuz, 1}, {ScalarType::Float8_e4m3fnuz, 1}, {ScalarType::UInt16, 2},
    {ScalarType::UInt32, 4},      {ScalarType::UInt64, 8},
};

}  // namespace

int64_t nbytes(const TensorMeta& meta) {
  int64_t numel = 1;
  for (int64_t size : meta.sizes) numel *= size;
  for (const ElementSize& entry : kElementSizes)
    if (entry.type == meta.dtype) return numel * entry.bytes;
  KILN_ASSERT(false) << "no element size for dtype " << scalar_type_name(meta.dtype);
  return 0;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t running = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = running;
    running *= sizes[i] > 1 ? sizes[i] : 1;
  }
  return strides;
}

std::vector<int64_t> broadcast_strides(const TensorMeta& meta, const std::vector<int64_t>& sizes) {
  KILN_ASSERT(meta.sizes.size() <= sizes.size()) << "broadcast to fewer dims";
  const size_t lead = sizes.size() - meta.sizes.size();
  std::vector<int64_t> strides(sizes.size(), 0);
  for (size_t d = 0; d < meta.sizes.size(); ++d) {
    KILN_ASSERT(meta.sizes[d] == sizes[lead + d] || meta.sizes[d] == 1) << "broadcast of a non-broadcastable dim";
    strides[lead + d] = meta.sizes[d] == 1 ? 0 : meta.strides[d];
  }
  return strides;
}

bool is_number(const ArgValue& arg, double value) {
  if (const auto* i = std::get_if<int64_t>(&arg)) return static_cast<double>(*i) == value;
  if (const auto* d = std::get_if<double>(&arg)) return *d == value;
  return false;
}

ValueId Graph::add_input(TensorMeta meta) {
  Value v;
  v.id = static_cast<ValueId>(values.size());
  v.meta = std::move(meta);
  v.is_input = true;
  v.input_index = static_cast<int32_t>(inputs.size());
  inputs.push_back(v.id);
  values.push_back(std::move(v));
  return values.back().id;
}

ValueId Graph::add_constant(TensorMeta meta, PyObjectRef tensor) {
  Value v;
  v.id = static_cast<ValueId>(values.size());
  v.meta = std::move(meta);
  v.is_constant = true;
  v.constant = std::move(tensor);
  values.push_back(std::move(v));
  return values.back().id;
}

std::vector<ValueId> Graph::add_node(Node node, std::vector<TensorMeta> output_metas) {
  KILN_ASSERT_EQ(node.args.size(), node.arg_names.size()) << "for " << node.qualified_name();
  const auto index = static_cast<NodeIndex>(nodes.size());
  node.outputs.clear();
  for (auto& meta : output_metas) {
    Value v;
    v.id = static_cast<ValueId>(values.size());
    v.meta = std::move(meta);
    v.producer = index;
    node.outputs.push_back(v.id);
    values.push_back(std::move(v));
  }
  nodes.push_back(std::move(node));
  return nodes.back().outputs;
}

const Value& Graph::value(ValueId id) const {
  KILN_ASSERT(id >= 0 && static_cast<size_t>(id) < values.size())
      << "value %" << id << " does not exist (graph has " << values.size() << " values)";
  return values[id];
}

}  // namespace kiln::graph
