// The device a graph runs on (graph_device.h).
#include "graph/graph_device.h"

namespace kiln::graph {

// Values some node, input or output of `g` refers to: the results of nodes that constant folding removed stay in
// the value table, read by nothing (passes/fold_constants.cpp).
std::vector<bool> used_values(const Graph& g) {
  std::vector<bool> used(g.values.size(), false);
  for (ValueId id : g.inputs) used[id] = true;
  for (ValueId id : g.outputs) used[id] = true;
  for (const Node& node : g.nodes) {
    for (const ArgValue& arg : node.args) for_each_tensor(arg, [&](ValueId id) { used[id] = true; });
    for (ValueId id : node.outputs) used[id] = true;
  }
  return used;
}

std::optional<Device> single_device(const Graph& g, std::string& why) {
  std::optional<Device> device;
  const std::vector<bool> used = used_values(g);
  for (const Value& v : g.values) {
    if (!v.is_tensor || !used[v.id]) continue;
    const Device& d = v.meta.device;
    if (d.type != DeviceType::CPU && d.index < 0) {
      why = "a " + device_type_name(d.type) + " tensor without a device index";
      return std::nullopt;
    }
    if (device && !(*device == d)) {
      why = "tensors on more than one device (" + device_type_name(device->type) + " and " +
            device_type_name(d.type) + ")";
      return std::nullopt;
    }
    device = d;
  }
  return device ? device : Device{};
}

}  // namespace kiln::graph
