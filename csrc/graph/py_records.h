#pragma once
// Converts the recorder's output (python/kiln/_fake.py, plain Python tuples) into a Graph. The only
// file of graph/ that uses the CPython API; call with the GIL held.
#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace kiln::graph {

/// Record format (all sequences may be lists or tuples):
///   values:  [(kind, meta, extra)]  in ValueId order; kind is "input" (extra: input index),
///            "constant" (extra: the real tensor, referenced by the graph) or "node" (extra: node index);
///            meta = (sizes, strides, storage_offset, dtype_code, device_type_code, device_index, requires_grad)
///   nodes:   [(op, overload, args, arg_names, num_positional, outputs, returns_list, mutates_args, is_view)]
///            args = [(tag, payload)], tag one of: none, tensor (id), tensors ([id | None]), bool, int,
///            float, complex, str, ints, floats, bools, dtype (code), layout (code), memory_format (code),
///            device ((type_code, index))
///   outputs: [ValueId]
/// The result is verified; malformed records raise an internal error naming the record.
std::shared_ptr<Graph> graph_from_records(PyObject* values, PyObject* nodes, PyObject* outputs);
/// One node's `args` records ([(tag, payload)], as above) as its ArgValues; `op` names the node in errors.
std::vector<ArgValue> args_from_records(PyObject* records, const std::string& op);

}  // namespace kiln::graph
