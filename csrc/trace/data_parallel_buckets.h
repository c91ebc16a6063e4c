#pragma once
// Whether the frame being compiled runs inside a DistributedDataParallel forward, and which of its graph inputs are
// the parameters DDP reduces in buckets: DDP's forward runs untraced (kiln._tracing.forward_runs_untraced) and calls
// the module it wraps, whose frame kiln compiles, for kiln.compile(DDP(m)) and DDP(kiln.compile(m)) alike. The
// pipeline then cuts the graph at DDP's buckets (compile/options.h, passes/split_at_parameter_buckets.h).
#include <Python.h>

#include <memory>

#include "passes/split_at_parameter_buckets.h"

namespace kiln::trace {

/// The DDP parameters among `example_inputs` (the graph's real inputs, in order) and DDP's bucket sizes, as
/// kiln._tracing.data_parallel_buckets finds them; null outside a DDP forward or when no input is one of its
/// parameters. Never raises: a failure to ask is no DDP.
std::shared_ptr<const passes::ParameterBuckets> data_parallel_buckets(PyObject* example_inputs);

}  // namespace kiln::trace
