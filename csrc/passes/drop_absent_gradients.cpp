// The backward graph without the gradients that never arrive (passes/drop_absent_gradients.h).
#include "passes/drop_absent_gradients.h"

#include <set>
#include <string>

#include "common/error.h"

namespace kiln::passes {

using graph::Node;
using graph::TensorMeta;
using graph::ValueId;

namespace {

// Ops whose result is zero wherever their first tensor operand is (any operand, for the products).
const std::set<std::string>& zero_from_first() {
  static const std::set<std::string> ops = {
      "aten::neg.default",     "aten::clone.default",  "aten::_to_copy.default",   "aten::_unsafe_view.default",
      "aten::reshape.default", "aten::sum.dim_IntList", "aten::sum.default",       "aten::mul.Scalar",
      "aten::div.Scalar",      "aten::div.Tensor",      "aten::alias.default"};
  return ops;
}
const std::set<std::string>& zero_from_any() {
  static const std::set<std::string> ops = {"aten::mul.Tensor", "aten::mm.default", "aten::bmm.default",
                                            "aten::matmul.default"};
  return ops;
}

ValueId tensor_id(const Node& n, size_t i) {
  const auto* t = i < n.args.size() ? std::get_if<graph::TensorArg>(&n.args[i]) : nullptr;
  return t ? t->id : -1;
}

bool same_layout(const TensorMeta& a, const TensorMeta& b) {
  return a.dtype == b.dtype && a.device == b.device && a.sizes == b.sizes && a.strides == b.strides &&
         a.storage_offset == b.storage_offset;
}

bool result_is_zero(const Node& n, const std::vector<bool>& zero) {
  const ValueId first = tensor_id(n, 0), second = tensor_id(n, 1);
  const bool first_zero = first >= 0 && zero[first];
  const bool second_zero = second >= 0 && zero[second];
  const std::string name = n.qualified_name();
  if (n.is_view || zero_from_first().count(name)) return first_zero;
  if (zero_from_any().count(name)) return first_zero || second_zero;
  if (name == "aten::add.Tensor" || name == "aten::sub.Tensor") return first_zero && second_zero;
  return false;
}

// The value a sum with a zero operand equals (its other operand), or -1.
ValueId sum_operand(const Node& n, const std::vector<bool>& zero) {
  const std::string name = n.qualified_name();
  if (name != "aten::add.Tensor" && name != "aten::sub.Tensor") return -1;
  const ValueId x = tensor_id(n, 0), y = tensor_id(n, 1);
  if (x < 0 || y < 0) return -1;
  if (zero[y]) return x;  // x + alpha * 0, x - alpha * 0
  const bool unit = n.args.size() < 3 || graph::is_number(n.args[2], 1.0);
  if (zero[x] && name == "aten::add.Tensor" && unit) return y;
  return -1;
}

}  // namespace

std::shared_ptr<graph::Graph> drop_absent_gradients(const graph::Graph& backward, const std::vector<bool>& absent,
                                                    int* dropped) {
  if (backward.symbolic) return nullptr;
  for (const Node& n : backward.nodes)
    if (n.mutates_args) return nullptr;
  auto out = std::make_shared<graph::Graph>();
  std::vector<ValueId> map(backward.values.size(), -1);
  std::vector<bool> zero(backward.values.size(), false);
  for (size_t i = 0; i < backward.inputs.size(); ++i)
    if (i >= absent.size() || !absent[i]) map[backward.inputs[i]] = out->add_input(backward.values[backward.inputs[i]].meta);
  for (const graph::Value& v : backward.values)
    if (v.is_constant) map[v.id] = out->add_constant(v.meta, v.constant);
  for (size_t i = 0; i < absent.size() && i < backward.inputs.size(); ++i) {
    if (!absent[i]) continue;
    const ValueId v = backward.inputs[i];
    TensorMeta meta = backward.values[v].meta;
    if (meta.storage_offset != 0 || meta.strides != graph::contiguous_strides(meta.sizes)) return nullptr;
    meta.requires_grad = false;
    Node fill{.op = "aten::zeros",
              .overload = "default",
              .args = {meta.sizes, graph::ScalarTypeArg{meta.dtype}, graph::NoneArg{}, meta.device, graph::NoneArg{}},
              .arg_names = {"size", "dtype", "layout", "device", "pin_memory"},
              .num_positional = 1};
    map[v] = out->add_node(std::move(fill), {meta}).at(0);
    zero[v] = true;
  }
  std::vector<bool> is_output(backward.values.size(), false);
  for (ValueId o : backward.outputs) is_output[o] = true;
  int sums = 0;
  for (const Node& n : backward.nodes) {
    if (n.outputs.size() == 1 && !is_output[n.outputs[0]]) {
      const ValueId other = sum_operand(n, zero);
      if (other >= 0 && same_layout(backward.values[other].meta, backward.values[n.outputs[0]].meta)) {
        map[n.outputs[0]] = map[other];
        zero[n.outputs[0]] = zero[other];
        ++sums;
        continue;
      }
    }
    Node copy = n;
    for (graph::ArgValue& arg : copy.args)
      graph::remap_tensors(arg, [&](ValueId id) {
        KILN_ASSERT(map[id] >= 0) << "%" << id << " read before it is defined";
        return map[id];
      });
    std::vector<TensorMeta> metas;
    for (ValueId o : n.outputs) metas.push_back(backward.values[o].meta);
    const std::vector<ValueId> ids = out->add_node(std::move(copy), std::move(metas));
    const bool result_zero = result_is_zero(n, zero);
    for (size_t k = 0; k < ids.size(); ++k) {
      map[n.outputs[k]] = ids[k];
      zero[n.outputs[k]] = result_zero;
    }
  }
  std::vector<ValueId> outputs;
  for (ValueId o : backward.outputs) outputs.push_back(map[o]);
  out->set_outputs(std::move(outputs));
  if (dropped) *dropped = sums;
  return out;
}

}  // namespace kiln::passes
