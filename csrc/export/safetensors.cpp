// safetensors reading and writing (safetensors.h), with the dtype names of export/dtype_names.h.
#include "export/safetensors.h"

#include <ATen/ops/empty.h>

#include <cstring>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "export/dtype_names.h"

namespace kiln::exporting {

namespace {
using json = nlohmann::json;
}  // namespace

std::map<std::string, at::Tensor> tensors_from_safetensors(std::string_view bytes, const std::string& what) {
  KILN_CHECK(bytes.size() >= 8) << what << " is shorter than its header: the file is truncated or corrupted";
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(bytes[i]);
  KILN_CHECK(length <= bytes.size() - 8) << what << ": the header is longer than the entry";
  const std::string_view body = bytes.substr(8 + length);
  std::map<std::string, at::Tensor> tensors;
  try {
    const json header = json::parse(bytes.substr(8, length));
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") continue;
      const std::string dtype = info.at("dtype").get<std::string>();
      const DtypeNames* found = dtype_named(&DtypeNames::safetensors, dtype);
      KILN_CHECK(found) << what << ": tensor " << name << " has the unknown dtype " << dtype;
      const auto shape = info.at("shape").get<std::vector<int64_t>>();
      const auto offsets = info.at("data_offsets").get<std::vector<uint64_t>>();
      KILN_CHECK(offsets.size() == 2 && offsets[0] <= offsets[1] && offsets[1] <= body.size())
          << what << ": tensor " << name << " points outside the data";
      at::Tensor t = at::empty(shape, at::TensorOptions().dtype(found->type));
      KILN_CHECK(static_cast<uint64_t>(t.nbytes()) == offsets[1] - offsets[0])
          << what << ": tensor " << name << " holds " << offsets[1] - offsets[0] << " bytes, not the " << t.nbytes()
          << " its shape and dtype need";
      if (t.nbytes() > 0) std::memcpy(t.data_ptr(), body.data() + offsets[0], t.nbytes());
      tensors.emplace(name, std::move(t));
    }
  } catch (const json::exception& e) {
    KILN_CHECK(false) << what << ": the header is malformed (" << e.what() << ")";
  }
  return tensors;
}

std::string safetensors_bytes(const std::map<std::string, at::Tensor>& tensors) {
  json header = json::object();
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const DtypeNames* found = dtype_names_of(tensor.scalar_type());
    KILN_CHECK(found && !found->safetensors.empty()) << "tensor " << name << " has dtype " << tensor.scalar_type()
                      << ", which the safetensors format cannot hold";
    at::Tensor cpu = tensor.detach().to(at::kCPU).contiguous();
    header[name] = {{"dtype", found->safetensors}, {"shape", cpu.sizes().vec()},
                    {"data_offsets", {offset, offset + cpu.nbytes()}}};
    offset += cpu.nbytes();
    data.push_back(std::move(cpu));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(text.size()) >> (8 * i)) & 0xff);
  out += text;
  for (const at::Tensor& t : data) out.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  return out;
}

}  // namespace kiln::exporting
