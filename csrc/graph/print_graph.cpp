// Graph::to_string: the readable form used by KILN_LOGS=graph, error messages and tests.
//
//   graph(%0 : f32[32, 10], %1 : f32[50, 10], %2 : f32[50]):
//     %3 : f32[10, 50](1, 10) = aten::t.default(%1)
//     %4 : f32[32, 50] = aten::addmm.default(%2, %0, %3, beta=1, alpha=1)
//     return (%4)
//
// A graph with symbolic sizes prints them (`%0 : f32[s0, 10]`), then its symbols, guards and specialisations as
// comment lines after the return.
#include <array>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "graph/graph.h"
#include "graph/symbolic_sizes.h"

namespace kiln::graph {

namespace {
constexpr std::array<const char*, 8> kLayoutNames = {
    "strided", "sparse_coo", "sparse_csr", "mkldnn", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged"};
constexpr std::array<const char*, 4> kMemoryFormatNames = {
    "contiguous_format", "preserve_format", "channels_last", "channels_last_3d"};

// The shortest text that reads back as the same double, always with a '.', 'e' or inf/nan so that
// floats never print like ints ("1.0", not "1").
void print_double(std::ostream& os, double d) {
  char buffer[32];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, d);
    if (std::strtod(buffer, nullptr) == d) break;
  }
  std::string text = buffer;
  if (text.find_first_of(".eEn") == std::string::npos) text += ".0";
  os << text;
}

template <typename T>
void print_list(std::ostream& os, const std::vector<T>& items) {
  os << "[";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) os << ", ";
    if constexpr (std::is_same_v<T, bool>)
      os << (items[i] ? "True" : "False");
    else if constexpr (std::is_same_v<T, double>)
      print_double(os, items[i]);
    else
      os << items[i];
  }
  os << "]";
}

std::string device_to_string(const Device& d) {
  std::ostringstream os;
  os << device_type_name(d.type);
  if (d.index >= 0) os << ":" << static_cast<int>(d.index);
  return os.str();
}

template <typename Table>
std::string enum_name(const Table& table, int code, const char* kind) {
  if (code >= 0 && static_cast<size_t>(code) < table.size()) return table[code];
  return std::string(kind) + std::to_string(code);
}

// One printer per ArgValue alternative, chosen by std::visit.
struct ArgPrinter {
  std::ostream& os;
  void operator()(const NoneArg&) const { os << "None"; }
  void operator()(const TensorArg& t) const { os << "%" << t.id; }
  void operator()(const TensorListArg& list) const {
    os << "[";
    for (size_t i = 0; i < list.ids.size(); ++i) {
      if (i) os << ", ";
      if (list.ids[i])
        os << "%" << *list.ids[i];
      else
        os << "None";
    }
    os << "]";
  }
  void operator()(bool b) const { os << (b ? "True" : "False"); }
  void operator()(int64_t i) const { os << i; }
  void operator()(double d) const { print_double(os, d); }
  void operator()(const std::complex<double>& c) const {
    os << "complex(";
    print_double(os, c.real());
    os << ", ";
    print_double(os, c.imag());
    os << ")";
  }
  void operator()(const std::string& s) const { os << "'" << s << "'"; }
  void operator()(const std::vector<int64_t>& v) const { print_list(os, v); }
  void operator()(const std::vector<double>& v) const { print_list(os, v); }
  void operator()(const std::vector<bool>& v) const { print_list(os, v); }
  void operator()(const ScalarTypeArg& t) const { os << scalar_type_name(t.type); }
  void operator()(const LayoutArg& l) const { os << enum_name(kLayoutNames, l.code, "layout"); }
  void operator()(const MemoryFormatArg& m) const {
    os << enum_name(kMemoryFormatNames, m.code, "memory_format");
  }
  void operator()(const Device& d) const { os << device_to_string(d); }
};

// A value's meta with its symbolic sizes where it has them: `%0 : f32[s0, 64]`.
void print_value_decl(std::ostream& os, const Graph& g, const Value& v) {
  const shape::SymTensorMeta* sym = g.symbolic ? g.symbolic->meta(v.id) : nullptr;
  os << "%" << v.id << " : " << (sym ? symbolic_meta_to_string(*sym, v.meta) : meta_to_string(v.meta));
}
}  // namespace

std::string meta_to_string(const TensorMeta& meta) {
  std::ostringstream os;
  os << scalar_type_name(meta.dtype);
  print_list(os, meta.sizes);
  if (meta.strides != contiguous_strides(meta.sizes) || meta.storage_offset != 0) {
    os << "(";
    for (size_t i = 0; i < meta.strides.size(); ++i) os << (i ? ", " : "") << meta.strides[i];
    if (meta.storage_offset != 0) os << (meta.strides.empty() ? "" : ", ") << "offset=" << meta.storage_offset;
    os << ")";
  }
  if (meta.device.type != DeviceType::CPU) os << "@" << device_to_string(meta.device);
  if (meta.requires_grad) os << " grad";
  return os.str();
}

std::string Graph::to_string() const {
  std::ostringstream os;
  os << "graph(";
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (i) os << ", ";
    print_value_decl(os, *this, value(inputs[i]));
  }
  os << "):\n";
  for (const Value& v : values) {
    if (!v.is_constant) continue;
    os << "  ";
    print_value_decl(os, *this, v);
    os << " = constant\n";
  }
  for (const Node& node : nodes) {
    os << "  ";
    for (size_t i = 0; i < node.outputs.size(); ++i) {
      if (i) os << ", ";
      print_value_decl(os, *this, value(node.outputs[i]));
    }
    os << (node.outputs.empty() ? "() = " : " = ") << node.qualified_name() << "(";
    for (size_t i = 0; i < node.args.size(); ++i) {
      if (i) os << ", ";
      if (static_cast<int32_t>(i) >= node.num_positional) os << node.arg_names[i] << "=";
      std::visit(ArgPrinter{os}, node.args[i]);
    }
    os << ")" << (node.returns_list ? "  # list" : "") << "\n";
  }
  os << "  return (";
  for (size_t i = 0; i < outputs.size(); ++i) os << (i ? ", " : "") << "%" << outputs[i];
  os << ")\n";
  if (symbolic) os << symbolic_sizes_to_string(*symbolic);
  return os.str();
}

}  // namespace kiln::graph
