#pragma once
// kiln's ATen-level graph IR (DESIGN.md "Graph IR is ATen-level").
//
// A Graph is a straight-line list of Nodes; each Node calls one ATen op overload ("aten::addmm",
// "default") with its complete schema argument list (defaults filled, positional then kwarg-only) and
// defines one Value per returned tensor. Values carry the meta PyTorch's own meta kernels computed:
// sizes, strides, storage offset, dtype, device, requires_grad.
//
// This header is torch-free: dtype and device codes use c10's numbering (ScalarType, DeviceType,
// Layout, MemoryFormat) so the runtime converts them with a cast. The only CPython dependency is the
// owned PyObject* of constant tensors, taken and released by graph/py_records.cpp (with the GIL held): code that
// never steals a Python reference (the C++ loader of exported programs) links no CPython symbol through a Graph.
//
// Aliasing: values are not SSA in the functional sense. An in-place op (add_) or out= variant defines a
// new Value for its result, but that Value shares storage with the mutated argument, and views share
// storage with their base. Replaying nodes in order on real tensors (the eager runtime) is exact;
// passes that reorder or fuse must respect Node::mutates_args / Node::is_view first.
#include <complex>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

struct _object;
typedef struct _object PyObject;  // the CPython object type, without Python.h

namespace kiln::graph {

struct SymbolicSizes;  // graph/symbolic_sizes.h

using ValueId = int32_t;
using NodeIndex = int32_t;

/// c10::ScalarType numbering (torch/headeronly/core/ScalarType.h); only the common ones are named.
enum class ScalarType : int8_t {
  Byte = 0, Char = 1, Short = 2, Int = 3, Long = 4, Half = 5, Float = 6, Double = 7,
  ComplexHalf = 8, ComplexFloat = 9, ComplexDouble = 10, Bool = 11,
  QInt8 = 12, QUInt8 = 13, QInt32 = 14, BFloat16 = 15,
  Float8_e5m2 = 23, Float8_e4m3fn = 24, Float8_e5m2fnuz = 25, Float8_e4m3fnuz = 26,
  UInt16 = 27, UInt32 = 28, UInt64 = 29,
};
/// c10::DeviceType numbering (torch/headeronly/core/DeviceType.h).
enum class DeviceType : int8_t { CPU = 0, CUDA = 1, HIP = 6, XLA = 9, XPU = 12, MPS = 13, Meta = 14 };

/// Short dtype name as printed in graphs: f32, bf16, i64, b8 ... ("dtype<N>" for unnamed codes).
std::string scalar_type_name(ScalarType t);
/// "cpu", "cuda", "meta" ... ("device<N>" for unnamed codes).
std::string device_type_name(DeviceType t);
bool is_floating_or_complex(ScalarType t);

struct Device {
  DeviceType type = DeviceType::CPU;
  int8_t index = -1;  // -1: the current device of that type
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
};

struct TensorMeta {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t storage_offset = 0;
  ScalarType dtype = ScalarType::Float;
  Device device;
  bool requires_grad = false;
};

/// Owns one reference to a Python object (a constant tensor). Copying shares the reference; the last
/// owner releases it with the GIL taken (PyGILState_Ensure), so graphs may die on any thread. The release is the
/// function steal() (py_records.cpp) stored with the object, so that only code which takes Python references
/// links against CPython.
class PyObjectRef {
 public:
  PyObjectRef() = default;
  /// Takes over one reference the caller already owns (a "new reference").
  static PyObjectRef steal(PyObject* obj);
  PyObject* get() const { return holder_ ? holder_->obj : nullptr; }
  explicit operator bool() const { return get() != nullptr; }

 private:
  struct Holder {
    PyObject* obj = nullptr;
    void (*release)(PyObject*) = nullptr;  // py_records.cpp: Py_DECREF under the GIL
    ~Holder() {
      if (obj && release) release(obj);
    }
  };
  std::shared_ptr<Holder> holder_;
};

struct Value {
  ValueId id = -1;
  bool is_tensor = true;  // every value is a tensor today; ops returning other things are Unsupported
  TensorMeta meta;
  NodeIndex producer = -1;  // the node that defines it, or -1 for inputs and constants
  bool is_input = false;
  int32_t input_index = -1;
  bool is_constant = false;
  PyObjectRef constant;  // the real tensor, held by reference, when is_constant
};

// ---- node arguments: one alternative per schema argument kind ----------------------------------
struct NoneArg {
  bool operator==(const NoneArg&) const { return true; }
};
struct TensorArg {  // Tensor / Tensor? with a tensor
  ValueId id;
};
struct TensorListArg {  // Tensor[] (all set) and Tensor?[] (nullopt for None elements)
  std::vector<std::optional<ValueId>> ids;
};
struct ScalarTypeArg {
  ScalarType type;
};
struct LayoutArg {
  int8_t code;  // c10::Layout
};
struct MemoryFormatArg {
  int8_t code;  // c10::MemoryFormat
};
/// int, SymInt (concrete), Scalar, float, bool, complex, str, lists and enums are stored by kind; the
/// runtime converts them by the schema's argument type (a Scalar argument takes int64_t or double).
/// A Tensor argument may hold a Python number (bool, int64_t, double, complex): `x + 1.0` reaches the
/// recorder as add.Tensor(x, 1.0), standing for a CPU "wrapped number" tensor, as in eager.
using ArgValue = std::variant<NoneArg, TensorArg, TensorListArg, bool, int64_t, double,
                              std::complex<double>, std::string, std::vector<int64_t>,
                              std::vector<double>, std::vector<bool>, ScalarTypeArg, LayoutArg,
                              MemoryFormatArg, Device>;

struct Node {
  std::string op;        // "aten::addmm"
  std::string overload;  // "default" for the unnamed overload, else "Tensor", "out" ...
  std::vector<ArgValue> args;           // the full schema argument list, in schema order
  std::vector<std::string> arg_names;   // schema names, parallel to args
  int32_t num_positional = 0;           // args[num_positional:] are kwarg-only in the schema
  std::vector<ValueId> outputs;
  bool returns_list = false;            // the op returns Tensor[] (split, unbind): outputs are its items
  bool mutates_args = false;            // in-place or out= (the schema writes an argument)
  bool is_view = false;                 // some output aliases an argument without writing it

  std::string qualified_name() const { return op + "." + overload; }  // "aten::addmm.default"
};

class Graph {
 public:
  std::vector<Value> values;     // indexed by ValueId
  std::vector<ValueId> inputs;   // in calling order
  std::vector<Node> nodes;       // in execution order
  std::vector<ValueId> outputs;  // may name inputs or constants directly
  /// Sizes as expressions over size symbols, beside the concrete metas (graph/symbolic_sizes.h); null, as in every
  /// graph nothing marked dynamic, when all sizes are concrete. Copies of a graph share it: change it only through
  /// mutable_symbolic(), which copies it first when shared.
  std::shared_ptr<SymbolicSizes> symbolic;

  // ---- builder ----------------------------------------------------------------------------
  ValueId add_input(TensorMeta meta);
  /// A constant value holding `tensor` (empty: a constant whose tensor the caller keeps apart, as graphs read back
  /// from bytes or JSON do).
  ValueId add_constant(TensorMeta meta, PyObjectRef tensor = {});
  /// Appends a node that defines one new value per entry of `output_metas`; returns their ids.
  std::vector<ValueId> add_node(Node node, std::vector<TensorMeta> output_metas);
  void set_outputs(std::vector<ValueId> ids) { outputs = std::move(ids); }

  const Value& value(ValueId id) const;

  // ---- printer / verifier / serialisation (print_graph.cpp, verify_graph.cpp, graph_json.cpp) ----
  /// One line per input, node and output: `%3 : f32[32, 50] = aten::addmm.default(%2, %0, %1, beta=1, alpha=1)`.
  std::string to_string() const;
  /// Throws an internal error naming the node and op when a reference is undefined or used before its
  /// definition, an output is undefined, or a value lacks meta. Constants must hold their tensor, unless
  /// `constants_hold_tensors` is false: a graph read back from JSON, whose constant tensors the caller keeps apart.
  void verify(bool constants_hold_tensors = true) const;
  /// The whole graph as JSON (values with meta, nodes with named args, inputs, outputs). Constants
  /// appear by meta only; non-finite doubles are the strings "nan", "inf", "-inf". Needs nlohmann_json at build time.
  std::string to_json(int indent = 2) const;
};

/// The graph Graph::to_json wrote, its constants without tensors (the caller keeps them apart). Throws kiln::Error
/// (a user error) when the text does not parse or does not describe a graph; call verify(false) on the result for the
/// references between values and nodes.
Graph graph_from_json(const std::string& text);

/// `f32[32, 50]` (strides are printed only when not contiguous: `f32[4, 3](1, 4)`).
std::string meta_to_string(const TensorMeta& meta);
/// Row-major contiguous strides for `sizes`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes);
/// `meta`'s strides when broadcast to `sizes` (its dims aligned to the right): 0 along dims it lacks or has as 1.
/// `meta` must broadcast to `sizes`.
std::vector<int64_t> broadcast_strides(const TensorMeta& meta, const std::vector<int64_t>& sizes);
/// True when the argument is a Python number (int or float) equal to `value`.
bool is_number(const ArgValue& arg, double value);
/// Bytes of a dense tensor with `meta`'s sizes and dtype.
int64_t nbytes(const TensorMeta& meta);
/// True when some node argument or a graph output refers to `v` (linear in the graph's size).
bool is_read(const Graph& g, ValueId v);
/// Per value, the value whose storage it shares first: a view's or an in-place node's results alias the first
/// tensor among its arguments (its root); every other value is its own.
std::vector<ValueId> storage_roots(const Graph& g);
/// The meta of the tensor an argument holds, or nullptr when it holds anything else (None, a number, a list).
const TensorMeta* tensor_meta(const Graph& g, const ArgValue& arg);
/// Calls `fn(ValueId)` for every tensor an argument refers to.
template <typename Fn>
void for_each_tensor(const ArgValue& arg, Fn&& fn) {
  if (auto* t = std::get_if<TensorArg>(&arg)) {
    fn(t->id);
  } else if (auto* list = std::get_if<TensorListArg>(&arg)) {
    for (const auto& id : list->ids)
      if (id) fn(*id);
  }
}
/// Replaces every tensor an argument refers to with `fn(ValueId) -> ValueId`.
template <typename Fn>
void remap_tensors(ArgValue& arg, Fn&& fn) {
  if (auto* t = std::get_if<TensorArg>(&arg)) {
    t->id = fn(t->id);
  } else if (auto* list = std::get_if<TensorListArg>(&arg)) {
    for (auto& id : list->ids)
      if (id) id = fn(*id);
  }
}

}  // namespace kiln::graph
