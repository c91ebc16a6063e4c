#pragma once
// The dtype names of kiln.export's files: program.json's (str(torch.float32) without "torch.") and
// weights.safetensors' (the safetensors specification's), one row per dtype either can hold, as python/kiln/export.py
// writes them.
#include <c10/core/ScalarType.h>

#include <string_view>

namespace kiln::exporting {

struct DtypeNames {
  c10::ScalarType type;
  std::string_view torch;        // "float32"
  std::string_view safetensors;  // "F32" ("" when the weights format has none)
};

inline constexpr DtypeNames kDtypeNames[] = {
    {c10::ScalarType::Float, "float32", "F32"},        {c10::ScalarType::Double, "float64", "F64"},
    {c10::ScalarType::Half, "float16", "F16"},         {c10::ScalarType::BFloat16, "bfloat16", "BF16"},
    {c10::ScalarType::Long, "int64", "I64"},           {c10::ScalarType::Int, "int32", "I32"},
    {c10::ScalarType::Short, "int16", "I16"},          {c10::ScalarType::Char, "int8", "I8"},
    {c10::ScalarType::Byte, "uint8", "U8"},            {c10::ScalarType::Bool, "bool", "BOOL"},
    {c10::ScalarType::UInt16, "uint16", "U16"},        {c10::ScalarType::UInt32, "uint32", "U32"},
    {c10::ScalarType::UInt64, "uint64", "U64"},        {c10::ScalarType::Float8_e4m3fn, "float8_e4m3fn", "F8_E4M3"},
    {c10::ScalarType::Float8_e5m2, "float8_e5m2", "F8_E5M2"}, {c10::ScalarType::ComplexFloat, "complex64", "C64"},
    {c10::ScalarType::ComplexDouble, "complex128", ""},
};

/// The row whose `field` equals `name`, or nullptr.
inline const DtypeNames* dtype_named(std::string_view DtypeNames::*field, std::string_view name) {
  for (const DtypeNames& d : kDtypeNames)
    if (!name.empty() && d.*field == name) return &d;
  return nullptr;
}

/// The row of `type`, or nullptr.
inline const DtypeNames* dtype_names_of(c10::ScalarType type) {
  for (const DtypeNames& d : kDtypeNames)
    if (d.type == type) return &d;
  return nullptr;
}

}  // namespace kiln::exporting
