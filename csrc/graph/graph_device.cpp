// The device a graph runs on (graph_device.h).
#include "graph/graph_device.h"

namespace kiln::graph {

std::optional<Device> single_device(const Graph& g, std::string& why) {
  std::optional<Device> device;
  for (const Value& v : g.values) {
    if (!v.is_tensor) continue;
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
