#pragma once
// The safetensors layout (https://github.com/huggingface/safetensors, the format's specification): an 8-byte
// little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}} (and "__metadata__"), then
// the raw little-endian data. kiln.export's weights.safetensors uses it (python/kiln/export.py writes it).
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <string_view>

namespace kiln::exporting {

/// {name: CPU tensor} from safetensors bytes (copied out of `bytes`); throws kiln::Error naming `what` when the
/// header does not parse, names an unknown dtype, or points outside the data.
std::map<std::string, at::Tensor> tensors_from_safetensors(std::string_view bytes, const std::string& what);

/// The safetensors bytes of `tensors` (copied to the CPU, contiguous); throws kiln::Error for a dtype the format
/// has no name for.
std::string safetensors_bytes(const std::map<std::string, at::Tensor>& tensors);

}  // namespace kiln::exporting
