// The "kiln" backend's compile pipeline and its CompiledGraph.
//
// Design: compile_kiln_graph is a straight line (checks -> graph passes -> schedule -> source -> compiled
// kernels -> run plan); any exception on the way turns into the eager interpreter for this graph, so a
// compiler problem costs speed, never an answer. CPU graphs become one C++/OpenMP shared library
// (codegen/cpp), CUDA graphs one NVRTC program (codegen/cuda) whose kernels launch on torch's current
// stream, with buffers from torch's caching allocator and no host synchronisation. The run plan is flat: per
// step either a kernel (a function and the value ids whose data pointers it takes) or a prepared extern call.
#include "runtime/kernel_graph.h"

#include <algorithm>
#include <atomic>

#include <Python.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/empty_strided.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "autodiff/functionalize_buffer_updates.h"
#include "cache/graph_cache.h"
#include "cache/kernel_cache.h"
#include "codegen/cpp/compile_cpp.h"
#include "codegen/cpp/emit_cpp.h"
#include "codegen/cuda/cuda_device_lib.h"
#include "codegen/cuda/cuda_program_cache.h"
#include "codegen/cuda/emit_cuda.h"
#include "codegen/cuda/nvrtc_compiler.h"
#include "common/error.h"
#include "common/log.h"
#include "fusion/in_place_outputs.h"
#include "fusion/launch_groups.h"
#include "fusion/schedule_kernels.h"
#include "passes/channels_last.h"
#include "passes/functionalize.h"
#include "passes/lower_batch_norm.h"
#include "passes/pipeline.h"
#include "passes/sink_into_copies.h"
#include "passes/split_addmm.h"
#include "passes/stage_row_sums.h"
#include "runtime/autograd_graph.h"
#include "runtime/cuda_driver.h"
#include "runtime/cuda_launch.h"
#include "runtime/eager_interpreter.h"
#include "runtime/fold_graph_constants.h"
#include "runtime/host_buffers.h"
#include "runtime/node_call.h"
#include "runtime/packed_outputs.h"
#include "runtime/torch_info.h"

namespace kiln::runtime {

namespace {

using graph::ValueId;
using KernelFn = void (*)(void* const*);

// Parameters of one launch group: 8 bytes each, well inside the 4 KiB every CUDA architecture accepts.
constexpr size_t kMaxGroupBuffers = 256;

// Held while a CPU kernel with gathered loads runs and its library's index-error flag is read (KilnGraph::execute).
std::mutex g_gathering_kernels;

struct KernelCall {
  KernelFn fn = nullptr;               // CPU
  cuda::CudaFunction cuda_fn = nullptr;  // CUDA, with its launch configuration
  cuda::LaunchConfig launch;
  std::string name;
  std::vector<ValueId> buffers;
  std::vector<bool> is_output;
  std::vector<at::TensorOptions> options;  // per output buffer
  // Per buffer: the input buffer whose storage this output takes when nothing else holds it (in_place_outputs.h
  // and build_plan), or -1.
  std::vector<int32_t> in_place_from;
  int* index_error = nullptr;  // CPU kernels with gathered loads: the library's flag for an index out of range
};

struct PlanStep {
  int32_t kernel = -1;  // index into kernels_, or -1 for an extern call
  int32_t external = -1;  // index into externs_
  std::vector<ValueId> release_after;
  std::vector<ValueId> release_inputs_after;  // graph inputs last read here (freed under run_consuming)
};

// Drops the GIL while the C++ compiler runs (other Python threads keep going), if this thread holds it.
class WithoutGil {
 public:
  WithoutGil() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~WithoutGil() {
    if (state_) PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

class KilnGraph final : public CompiledGraph {
 public:
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    if (fallback_) return fallback_->run(inputs);
    return execute(std::vector<at::Tensor>(inputs), /*release_inputs=*/false);
  }

  std::vector<at::Tensor> run_consuming(std::vector<at::Tensor>&& inputs) override {
    if (fallback_) return fallback_->run_consuming(std::move(inputs));
    return execute(std::move(inputs), /*release_inputs=*/true);
  }

  std::vector<at::Tensor> run_packing(std::vector<at::Tensor>&& inputs, bool consuming,
                                      const std::vector<bool>& packed) override {
    if (fallback_) return fallback_->run_packing(std::move(inputs), consuming, packed);
    std::shared_ptr<const PackPlan> plan;
    if (std::find(packed.begin(), packed.end(), true) != packed.end()) plan = pack_plan(packed);
    return execute(std::move(inputs), consuming, plan.get());
  }

  // The buckets for `packed` (packed_outputs.h): planned on first use, then reused while the mask stays the same.
  std::shared_ptr<const PackPlan> pack_plan(const std::vector<bool>& packed) {
    std::lock_guard<std::mutex> lock(pack_mutex_);
    if (pack_plan_ && pack_plan_->packed == packed) return pack_plan_;
    std::vector<MadeAt> made(graph_->values.size());
    for (size_t position = 0; position < plan_.size(); ++position) {
      const PlanStep& step = plan_[position];
      if (step.kernel >= 0) {
        const KernelCall& k = kernels_[step.kernel];
        for (size_t b = 0; b < k.buffers.size(); ++b)
          if (k.is_output[b]) made[k.buffers[b]] = {static_cast<int32_t>(position), -1};
      } else {
        for (ValueId out : externs_[step.external].outputs) made[out] = {static_cast<int32_t>(position), step.external};
      }
    }
    pack_plan_ = std::make_shared<const PackPlan>(
        plan_packed_outputs(*graph_, packed, made, externs_.size(), [&](int32_t external) {
          return externs_[external].out_op.has_value() || prepare_out_variant(externs_[external]);
        }));
    return pack_plan_;
  }

  std::vector<at::Tensor> execute(std::vector<at::Tensor> inputs, bool release_inputs, const PackPlan* pack = nullptr) {
    const graph::Graph& g = *graph_;
    KILN_CHECK(inputs.size() == g.inputs.size())
        << "compiled graph expects " << g.inputs.size() << " input tensors, got " << inputs.size();
    std::vector<at::Tensor> env = constants_;
    for (size_t i = 0; i < inputs.size(); ++i) env[g.inputs[i]] = std::move(inputs[i]);
    std::vector<void*> pointers;
    std::vector<void*> arguments;
    cuda::CudaStream stream = cuda_device_ >= 0 ? cuda::torch_current_stream(cuda_device_) : nullptr;
    std::optional<HostBufferScope> host_buffers;  // CPU: large buffers reused across calls (host_buffers.h)
    if (cuda_device_ < 0) host_buffers.emplace();
    // Held to the end of the call: while a bucket is referenced here, no kernel takes a packed value's storage
    // for an in-place output (that needs the storage's only reference).
    std::vector<at::Tensor> buckets(pack ? pack->bucket_bytes.size() : 0);
    for (const PlanStep& step : plan_) {
      if (step.kernel >= 0) {
        const KernelCall& k = kernels_[step.kernel];
        pointers.resize(k.buffers.size());
        size_t out = 0;
        for (size_t b = 0; b < k.buffers.size(); ++b) {
          at::Tensor& t = env[k.buffers[b]];
          if (k.is_output[b]) {
            const auto& meta = g.values[k.buffers[b]].meta;
            const at::TensorOptions& options = k.options[out++];
            at::Tensor* source = k.in_place_from.empty() || k.in_place_from[b] < 0 ? nullptr : &env[k.buffers[k.in_place_from[b]]];
            if (pack && pack->bucket[k.buffers[b]] >= 0)
              t = packed_slot(g, *pack, buckets, k.buffers[b]);
            else if (source && source->defined() && source->use_count() == 1 && source->storage().use_count() == 1)
              t = *source;  // the input's last use, and no view or caller holds its storage: overwrite it
            else
              t = at::empty_strided(meta.sizes, meta.strides, options);
          }
          pointers[b] = t.data_ptr();
        }
        if (k.fn && k.index_error) {
          // The flag is the library's: two threads running its gathering kernels at once (the GIL is released
          // here) would read each other's error, so such a kernel and the read of the flag hold one lock.
          bool out_of_range = false;
          {
            std::lock_guard<std::mutex> lock(g_gathering_kernels);
            k.fn(pointers.data());
            out_of_range = *k.index_error != 0;
            *k.index_error = 0;
          }
          // eager's error, type and message: "index out of range in self" (an IndexError in Python)
          TORCH_CHECK_INDEX(!out_of_range, "index out of range in self (kiln kernel ", k.name,
                            ": an embedding, gather or index_select index outside its dim)");
        } else if (k.fn) {
          k.fn(pointers.data());
        } else if (k.launch.grid.x > 0) {
          arguments.resize(pointers.size());
          for (size_t b = 0; b < pointers.size(); ++b) arguments[b] = &pointers[b];
          cuda::launch_kernel(cuda_device_, k.cuda_fn, k.name, k.launch, stream, arguments.data());
        }
      } else if (pack && pack->extern_into[step.external]) {
        const PreparedNode& external = externs_[step.external];
        std::vector<at::Tensor> outs;
        for (ValueId out : external.outputs) {
          const graph::TensorMeta& meta = g.values[out].meta;
          outs.push_back(pack->bucket[out] >= 0
                             ? packed_slot(g, *pack, buckets, out)
                             : at::empty_strided(meta.sizes, meta.strides,
                                                 at::TensorOptions()
                                                     .dtype(static_cast<at::ScalarType>(meta.dtype))
                                                     .device(to_c10(meta.device))));
        }
        call_node_into(external, g, constants_, env, std::move(outs));
      } else {
        call_node(externs_[step.external], g, constants_, env);
      }
      for (ValueId id : step.release_after) env[id].reset();
      if (release_inputs)
        for (ValueId id : step.release_inputs_after) env[id].reset();
    }
    std::vector<at::Tensor> outputs;
    outputs.reserve(g.outputs.size());
    for (ValueId id : g.outputs) outputs.push_back(env[id]);
    return outputs;
  }

  KilnGraphSummary summary;
  std::shared_ptr<CompiledGraph> fallback_;
  std::shared_ptr<const graph::Graph> graph_;
  std::vector<at::Tensor> constants_;
  std::vector<KernelCall> kernels_;
  std::vector<PreparedNode> externs_;
  std::vector<PlanStep> plan_;
  std::shared_ptr<codegen::cpp::SharedLibrary> library_;
  std::vector<std::string> cpp_functions_;  // CPU: per schedule kernel, its function in library_
  int cuda_device_ = -1;  // the CUDA device of a CUDA graph, -1 for CPU
  std::vector<codegen::cuda::CudaProgram> cuda_programs_;  // per part of the CUDA source
  std::vector<codegen::cuda::CudaKernelLaunch> cuda_launches_;  // per schedule kernel
  codegen::cuda::CudaKernelLaunch cuda_group_;  // the launch group (fusion/launch_groups.h), if any
  std::vector<int32_t> cuda_group_members_;
  std::mutex pack_mutex_;
  std::shared_ptr<const PackPlan> pack_plan_;  // the last mask's (pack_plan)
};

// True when the graph must record autograd history: grad mode on and some value requires grad.
bool needs_autograd(const graph::Graph& g) {
  if (!at::GradMode::is_enabled()) return false;
  for (const graph::Value& v : g.values)
    if (v.meta.requires_grad) return true;
  return false;
}

// The device all of the graph's tensors live on (CPU, or one CUDA device), or nullopt with `why` set.
std::optional<graph::Device> graph_device(const graph::Graph& g, std::string& why) {
  std::optional<graph::Device> device;
  for (const graph::Value& v : g.values) {
    if (!v.is_tensor) continue;
    const graph::Device& d = v.meta.device;
    if (d.type != graph::DeviceType::CPU && d.type != graph::DeviceType::CUDA) {
      why = "tensors on " + graph::device_type_name(d.type) + " (kiln generates code for CPU and CUDA)";
      return std::nullopt;
    }
    if (d.type == graph::DeviceType::CUDA && d.index < 0) {
      why = "a CUDA tensor without a device index";
      return std::nullopt;
    }
    if (device && !(*device == d)) {
      why = "tensors on more than one device (" + graph::device_type_name(device->type) + " and " +
            graph::device_type_name(d.type) + ")";
      return std::nullopt;
    }
    device = d;
  }
  return device ? device : graph::Device{};
}

// Why `g` must stay on the eager interpreter, or "".
std::string unsupported_reason(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes)
    if (node.mutates_args) return "in-place op " + node.qualified_name();
  std::string why;
  graph_device(g, why);
  return why;
}

void dump_debug(const std::string& name, const std::string& graph_text, const std::string& source) {
  const char* dir = std::getenv("KILN_DEBUG_DIR");
  if (!dir || !*dir) return;
  try {
    std::string path = std::string(dir) + "/" + name;
    std::ofstream(path + ".graph.txt") << graph_text;
    std::ofstream(path + (source.rfind("// generated by kiln", 0) == 0 ? ".cu" : ".cpp")) << source;
  } catch (...) {
    // a debug dump never fails a compile
  }
}

std::atomic<bool> g_cuda_ptx_check{false};

CudaPtxCheck& ptx_check_state() {
  static CudaPtxCheck state;
  return state;
}

// The test suite's check that CUDA code generation works for every graph it compiles on CPU: the same
// schedule emitted as CUDA C and compiled to PTX by NVRTC (no GPU needed). Failures are recorded, not
// thrown: the CPU graph itself is fine.
void check_cuda_ptx(const fusion::Schedule& schedule, const graph::Graph& g) {
  if (!g_cuda_ptx_check) return;
  CudaPtxCheck& state = ptx_check_state();
  std::string source;
  try {
    fusion::Schedule grouped = schedule;  // the launch group's code is checked too
    const std::vector<int32_t> group = fusion::hoist_input_kernels(grouped, g, kMaxGroupBuffers);
    const codegen::cuda::CudaSource cuda = codegen::cuda::emit_cuda_source(grouped, g, group);
    source = cuda.source;
    KILN_LOG(output_code) << "kiln backend, PTX check of the same schedule as CUDA C:\n" << source;
    codegen::cuda::NvrtcOptions options;
    options.arch = "compute_90";
    options.headers = codegen::cuda::cuda_device_headers();
    for (const std::string& part : cuda.parts) codegen::cuda::compile_cuda(part, "kiln_ptx_check", options);
    state.compiled++;
  } catch (const std::exception& e) {
    state.failures.push_back(std::string(e.what()) + "\n--- source ---\n" + source);
  }
}

void build_plan(KilnGraph& kg, const cache::GraphRecord& record) {
  const graph::Graph& g = *kg.graph_;
  std::vector<int32_t> last_use(g.values.size(), -1);
  for (const fusion::Step& step : record.steps) {
    PlanStep plan_step;
    const auto position = static_cast<int32_t>(kg.plan_.size());
    if (step.kind == fusion::Step::Kind::Kernel) {
      const bool grouped = std::find(kg.cuda_group_members_.begin(), kg.cuda_group_members_.end(), step.index) !=
                           kg.cuda_group_members_.end();
      if (grouped && step.index != kg.cuda_group_members_.front()) continue;  // launched with the first member
      const cache::PlannedKernel& k = record.kernels[step.index];
      KernelCall call;
      call.name = grouped ? kg.cuda_group_.name : k.name;
      if (kg.cuda_device_ >= 0) {
        const auto& launch = grouped ? kg.cuda_group_ : kg.cuda_launches_[step.index];
        // may be a twin's (emit_cuda_source), in the part that defines it
        call.cuda_fn = kg.cuda_programs_[launch.part].loaded->function(launch.name);
        call.launch.grid.x = launch.grid;
        call.launch.block.x = launch.block_x;
        call.launch.block.y = launch.block_y;
      } else {
        call.fn = reinterpret_cast<KernelFn>(kg.library_->symbol(kg.cpp_functions_[step.index]));
        if (k.gathers) call.index_error = static_cast<int*>(kg.library_->symbol("kiln_index_error"));
      }
      const at::Device device = kg.cuda_device_ >= 0 ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(kg.cuda_device_))
                                                      : at::Device(at::kCPU);
      // a launch group passes its members' buffers one after the other (emit_cuda_source)
      const std::vector<int32_t> members = grouped ? kg.cuda_group_members_ : std::vector<int32_t>{step.index};
      for (int32_t member : members) {
        for (const auto& buf : record.kernels[member].buffers) {
          call.buffers.push_back(buf.value);
          call.is_output.push_back(buf.is_output);
          if (buf.is_output) {
            call.options.push_back(at::TensorOptions().dtype(static_cast<at::ScalarType>(buf.dtype)).device(device));
          } else {
            last_use[buf.value] = position;
          }
        }
        kg.summary.kernels.push_back(record.kernels[member].name);
      }
      if (!grouped) call.in_place_from = k.in_place_from;  // a group's members may run at once
      kg.summary.plan.push_back(call.name);
      plan_step.kernel = static_cast<int32_t>(kg.kernels_.size());
      kg.kernels_.push_back(std::move(call));
    } else {
      const graph::Node& node = g.nodes[step.index];
      for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { last_use[id] = position; });
      plan_step.external = static_cast<int32_t>(kg.externs_.size());
      kg.externs_.push_back(prepare_node(g, node, kg.constants_));
      kg.summary.externs.push_back(node.qualified_name());
      kg.summary.plan.push_back(node.qualified_name());
    }
    kg.plan_.push_back(std::move(plan_step));
  }
  // Generated kernels read extern outputs with the recorded strides baked in. ATen may lay a result out
  // differently from its meta kernel (an op recorded whole): call_node then copies it into the recorded layout.
  std::vector<bool> read_by_kernel(g.values.size(), false);
  for (const auto& k : kg.kernels_)
    for (size_t b = 0; b < k.buffers.size(); ++b)
      if (!k.is_output[b]) read_by_kernel[k.buffers[b]] = true;
  for (PreparedNode& external : kg.externs_)
    for (size_t o = 0; o < external.outputs.size(); ++o)
      if (read_by_kernel[external.outputs[o]]) restore_recorded_layout(external, o);
  std::unordered_set<ValueId> kept(g.outputs.begin(), g.outputs.end());
  // In-place outputs: only into an intermediate laid out as the output, at its last use.
  for (size_t position = 0; position < kg.plan_.size(); ++position) {
    if (kg.plan_[position].kernel < 0) continue;
    KernelCall& call = kg.kernels_[kg.plan_[position].kernel];
    for (size_t b = 0; b < call.in_place_from.size(); ++b) {
      int32_t& from = call.in_place_from[b];
      if (from < 0) continue;
      const graph::Value& in = g.values[call.buffers[from]];
      const graph::TensorMeta& out = g.values[call.buffers[b]].meta;
      const bool free = in.producer >= 0 && !in.is_input && !kept.count(in.id) &&
                        last_use[in.id] == static_cast<int32_t>(position) && in.meta.device == out.device &&
                        in.meta.dtype == out.dtype && in.meta.sizes == out.sizes &&
                        in.meta.strides == out.strides && in.meta.storage_offset == 0 && out.storage_offset == 0;
      if (!free) {
        from = -1;
        continue;
      }
      kg.summary.in_place.push_back(call.name + ": %" + std::to_string(call.buffers[b]) + " into %" +
                                    std::to_string(in.id));
    }
  }
  for (const graph::Value& v : g.values)
    if (!kept.count(v.id) && last_use[v.id] >= 0) {
      if (v.producer >= 0) kg.plan_[last_use[v.id]].release_after.push_back(v.id);
      if (v.is_input) kg.plan_[last_use[v.id]].release_inputs_after.push_back(v.id);
    }
}

// What compile_kernels makes of a graph before loading anything: graph passes, the schedule and its source.
// `training_half`: the graph is the forward or backward of a compiled training step (its CPU convolutions keep
// their layout: passes/channels_last.h).
cache::GraphRecord build_record(const graph::Graph& original, const graph::Device& device, bool training_half,
                                const log::Stopwatch& started, double& schedule_ms, double& codegen_ms) {
  cache::GraphRecord record;
  record.optimised = original;
  graph::Graph& optimised = record.optimised;
  passes::lower_inference_batch_norm(optimised);
  if (device.type == graph::DeviceType::CUDA &&
      passes::split_addmm_bias(optimised, cuda::multiprocessor_count(std::max<int>(device.index, 0))))
    KILN_LOG(perf) << "kiln backend: addmm bias adds fused after plain matmuls";
  if (passes::sink_pointwise_into_copies(optimised)) KILN_LOG(perf) << "kiln backend: pointwise ops computed in their copies' layout";
  if (passes::stage_row_sums(optimised)) KILN_LOG(perf) << "kiln backend: row sums of flattened views staged";
  if (passes::relayout_convolutions_channels_last(optimised, /*cpu=*/!training_half)) {
    KILN_LOG(perf) << "kiln backend: convolutions run channels-last";
    if (passes::verify_enabled()) optimised.verify();
  }
  passes::run_graph_passes(optimised);
  fusion::Schedule schedule = fusion::schedule_kernels(optimised);
  if (passes::verify_enabled())
    for (const auto& k : schedule.kernels) fusion::verify_kernel(k);
  schedule_ms = started.ms();
  bool has_kernels = false;
  for (const auto& step : schedule.steps) has_kernels = has_kernels || step.kind == fusion::Step::Kind::Kernel;
  if (has_kernels && device.type == graph::DeviceType::CUDA) {
    const std::vector<int32_t> group =
        fusion::hoist_input_kernels(schedule, optimised, kMaxGroupBuffers, /*keep_peak=*/training_half);
    codegen::cuda::CudaSource cuda = codegen::cuda::emit_cuda_source(schedule, optimised, group);
    record.cuda_parts = std::move(cuda.parts);
    record.cuda_launches = std::move(cuda.kernels);
    record.cuda_group = std::move(cuda.group);
    record.cuda_group_members = std::move(cuda.group_members);
  } else if (has_kernels) {
    codegen::cpp::CppSource cpp = codegen::cpp::emit_cpp_source(schedule, optimised);
    record.cpp_source = std::move(cpp.text);
    record.cpp_functions = std::move(cpp.functions);
    check_cuda_ptx(schedule, optimised);
  }
  codegen_ms = started.ms() - schedule_ms;
  KILN_LOG(output_code) << "kiln backend: " << schedule.summary();
  record.steps = schedule.steps;
  for (const fusion::Kernel& k : schedule.kernels) {
    bool gathers = false;
    for (const fusion::Expr& e : k.exprs) gathers = gathers || fusion::Kernel::is_gathered(e);
    record.kernels.push_back({k.name, k.buffers, fusion::in_place_sources(k), gathers});
  }
  // Constants by the captured graph's ids (passes may renumber values), so a record read back finds its tensors.
  record.constant_sources = cache::constant_sources(original, optimised);
  return record;
}

// The source text of a record, as logs, debug dumps and summaries show it.
std::string record_source(const cache::GraphRecord& record) {
  std::string source = record.cpp_source;
  for (const std::string& part : record.cuda_parts) source += part;
  return source;
}

// The KilnGraph a record describes: its programs compiled or found in their caches, and its run plan.
std::shared_ptr<KilnGraph> instantiate(cache::GraphRecord record, const graph::Device& device, const ConstantsOf& constants_of) {
  auto kg = std::make_shared<KilnGraph>();
  auto optimised = std::make_shared<graph::Graph>(std::move(record.optimised));
  kg->graph_ = optimised;
  kg->constants_ = constants_of(*optimised);
  kg->constants_.resize(optimised->values.size());
  kg->summary.backend = "kiln";
  kg->summary.device = device.type == graph::DeviceType::CUDA ? "cuda:" + std::to_string(device.index) : "cpu";
  kg->summary.source = record_source(record);
  if (!kg->summary.source.empty()) {
    KILN_LOG(output_code) << "kiln backend (" << kg->summary.device << "):\n" << kg->summary.source;
    dump_debug("kiln_" + cache::hash_hex(kg->summary.source).substr(0, 12), optimised->to_string(), kg->summary.source);
  }
  if (!record.cuda_parts.empty()) {
    for (const auto& launch : record.cuda_launches) kg->summary.strategies.push_back(launch.strategy);
    codegen::cuda::nvrtc_version();  // opens NVRTC with the GIL held: its search may ask importlib
    codegen::cuda::cuda_device_headers();
    WithoutGil no_gil;
    kg->cuda_device_ = device.index;
    kg->cuda_programs_ = codegen::cuda::cuda_programs_for_device(device.index, record.cuda_parts, "kiln_graph");
    kg->cuda_launches_ = std::move(record.cuda_launches);
    kg->cuda_group_ = std::move(record.cuda_group);
    kg->cuda_group_members_ = std::move(record.cuda_group_members);
  } else if (!record.cpp_source.empty()) {
    kg->cpp_functions_ = std::move(record.cpp_functions);
    WithoutGil no_gil;
    kg->library_ = codegen::cpp::compile_cpp_library(kg->summary.source, "torch " + built_torch_version());
  }
  build_plan(*kg, record);
  return kg;
}

// `training_half`: the graph is the forward or backward of a compiled training step (build_record).
std::shared_ptr<KilnGraph> compile_kernels(std::shared_ptr<const graph::Graph> original, const ConstantsOf& constants_of,
                                           bool training_half) {
  const log::Stopwatch started;
  std::string why;
  const graph::Device device = *graph_device(*original, why);  // checked by unsupported_reason
  std::string context = "torch " + built_torch_version() + (training_half ? ", training half" : "");
  if (device.type == graph::DeviceType::CUDA)
    context += ", cuda with " + std::to_string(cuda::multiprocessor_count(std::max<int>(device.index, 0))) + " SMs";
  const std::string key = cache::graph_key(*original, context);
  // The PTX check (a test switch) needs the schedule, so it always builds.
  std::optional<cache::GraphRecord> cached = g_cuda_ptx_check ? std::nullopt : cache::load_graph_record(key, *original);
  if (cached) {
    const double read_ms = started.ms();
    auto kg = instantiate(std::move(*cached), device, constants_of);
    cache::stats().graph_hits++;
    KILN_LOG(perf) << "kiln backend: found in the graph cache (" << kg->summary.kernels.size() << " kernels, "
                   << kg->externs_.size() << " extern calls); read " << log::whole_ms(read_ms)
                   << " ms, compiler or cache " << log::whole_ms(started.ms() - read_ms) << " ms";
    return kg;
  }
  double schedule_ms = 0, codegen_ms = 0;
  cache::GraphRecord record = build_record(*original, device, training_half, started, schedule_ms, codegen_ms);
  cache::store_graph_record(key, record);
  auto kg = instantiate(std::move(record), device, constants_of);
  KILN_LOG(perf) << "kiln backend: " << kg->summary.kernels.size() << " kernels, " << kg->externs_.size()
                 << " extern calls; passes and fusion " << log::whole_ms(schedule_ms) << " ms, code generation "
                 << log::whole_ms(codegen_ms) << " ms, compiler or cache "
                 << log::whole_ms(started.ms() - schedule_ms - codegen_ms) << " ms";
  return kg;
}

}  // namespace

KilnBackendStats& kiln_backend_stats() {
  static KilnBackendStats s;
  return s;
}

namespace {
std::atomic<bool> g_compiled_autograd{true};
}  // namespace

void set_compiled_autograd(bool on) { g_compiled_autograd = on; }

void set_cuda_ptx_check(bool on) { g_cuda_ptx_check = on; }
CudaPtxCheck& cuda_ptx_check() { return ptx_check_state(); }
bool compiled_autograd() { return g_compiled_autograd; }

namespace {

// A graph that updates buffers in place (train-mode BatchNorm's num_batches_tracked.add_(1) run under no_grad):
// compiled with the updates made functional, then the final values copied into the caller's tensors, as eager's
// in-place ops would have left them (same storage, version counter bumped).
class BufferUpdatingGraph final : public CompiledGraph {
 public:
  BufferUpdatingGraph(std::shared_ptr<CompiledGraph> inner, std::vector<autodiff::BufferUpdate> updates, size_t num_outputs)
      : inner_(std::move(inner)), updates_(std::move(updates)), num_outputs_(num_outputs) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    std::vector<at::Tensor> results = inner_->run(inputs);
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < updates_.size(); ++i) inputs.at(updates_[i].input_index).copy_(results.at(num_outputs_ + i));
    results.resize(num_outputs_);
    return results;
  }
  const CompiledGraph& inner() const { return *inner_; }

 private:
  std::shared_ptr<CompiledGraph> inner_;
  std::vector<autodiff::BufferUpdate> updates_;
  size_t num_outputs_;
};

// A compiled graph that updates some inputs in place, run on the eager interpreter for a call where another
// input shares memory with an updated one (a view of it passed alongside): eager's in-place op shows through
// that view, while the compiled graph reads each input as its own buffer.
class AliasCheckedGraph final : public CompiledGraph {
 public:
  AliasCheckedGraph(std::shared_ptr<CompiledGraph> inner, std::shared_ptr<CompiledGraph> eager, std::vector<int32_t> updated)
      : inner_(std::move(inner)), eager_(std::move(eager)), updated_(std::move(updated)) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    for (int32_t u : updated_)
      for (size_t j = 0; j < inputs.size(); ++j)
        if (j != static_cast<size_t>(u) && inputs[j].defined() && inputs[j].is_alias_of(inputs.at(u)))
          return eager_->run(inputs);
    return inner_->run(inputs);
  }
  const CompiledGraph& inner() const { return *inner_; }

 private:
  std::shared_ptr<CompiledGraph> inner_;
  std::shared_ptr<CompiledGraph> eager_;
  std::vector<int32_t> updated_;
};

// Null when the graph's in-place ops are not all buffer updates (autodiff/functionalize_buffer_updates.h).
std::shared_ptr<CompiledGraph> compile_with_buffer_updates(const std::shared_ptr<const graph::Graph>& g,
                                                           const ConstantsOf& constants_of, bool training_half) {
  auto functional = std::make_shared<graph::Graph>(*g);
  std::vector<autodiff::BufferUpdate> updates;
  try {
    updates = autodiff::functionalize_buffer_updates(*functional);
  } catch (const std::exception&) {
    return nullptr;
  }
  if (updates.empty() || !unsupported_reason(*functional).empty()) return nullptr;
  const size_t num_outputs = functional->outputs.size();
  std::vector<graph::ValueId> outputs = functional->outputs;
  for (const autodiff::BufferUpdate& update : updates) outputs.push_back(update.final_value);
  functional->set_outputs(outputs);
  if (passes::verify_enabled()) functional->verify();
  try {
    auto kg = compile_kernels(functional, constants_of, training_half);
    kiln_backend_stats().graphs_compiled++;
    std::vector<int32_t> updated;
    for (const autodiff::BufferUpdate& update : updates) updated.push_back(update.input_index);
    auto updating = std::make_shared<BufferUpdatingGraph>(std::move(kg), std::move(updates), num_outputs);
    return std::make_shared<AliasCheckedGraph>(std::move(updating), make_eager_interpreter(g, constants_of(*g)),
                                               std::move(updated));
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln backend: a graph with buffer updates: " << e.what();
    return nullptr;
  }
}

}  // namespace

std::shared_ptr<CompiledGraph> compile_kiln_graph(std::shared_ptr<const graph::Graph> g, const ConstantsOf& constants_of,
                                                  bool training_half) {
  bool mutates = false;
  for (const graph::Node& node : g->nodes) mutates = mutates || node.mutates_args;
  if (mutates) {  // in-place ops on the graph's own intermediates become functional (passes/functionalize.h)
    auto functional = std::make_shared<graph::Graph>(*g);
    if (passes::functionalize_inplace_ops(*functional)) {
      if (passes::verify_enabled()) functional->verify();
      g = std::move(functional);
    }
  }
  // After functionalization: a mask built in place (`torch.full(...).triu_(1)`) is functional by now.
  std::vector<std::string> folded;
  g = fold_graph_constants(std::move(g), constants_of, folded);
  std::string reason;
  if (needs_eager_for_grad_mode(*g)) {
    reason = "the graph switches grad mode over values that require grad (eager_interpreter.h)";
  } else if (needs_autograd(*g) && !compiled_autograd()) {
    reason = "the graph needs grad (compiled autograd is off: kiln.config.set_compiled_autograd)";
  } else if (needs_autograd(*g)) {
    // Forward and backward compiled ahead of time behind one autograd node; anything autodiff does not
    // cover keeps the eager interpreter, which records eager's autograd history op by op.
    try {
      auto joint = compile_autograd_graph(g, [&](std::shared_ptr<const graph::Graph> part) {
        at::AutoGradMode no_grad(false);  // the halves run with grad off: compile them as such
        return compile_kiln_graph(std::move(part), constants_of, /*training_half=*/true);
      });
      kiln_backend_stats().graphs_autograd++;
      std::vector<int32_t> updated = joint->updated_inputs();
      if (updated.empty()) return joint;
      return std::make_shared<AliasCheckedGraph>(std::move(joint), make_eager_interpreter(g, constants_of(*g)),
                                                 std::move(updated));
    } catch (const std::exception& e) {
      reason = std::string("autodiff: ") + e.what();
    }
  } else {
    reason = unsupported_reason(*g);
    if (!reason.empty()) {
      if (auto updating = compile_with_buffer_updates(g, constants_of, training_half)) return updating;
    }
  }
  if (reason.empty()) {
    try {
      auto kg = compile_kernels(g, constants_of, training_half);
      kg->summary.folded = folded;
      kiln_backend_stats().graphs_compiled++;
      return kg;
    } catch (const std::exception& e) {
      reason = e.what();
    }
  }
  KILN_LOG(fallbacks) << "kiln backend: running the graph on the eager interpreter: " << reason;
  kiln_backend_stats().graphs_fallback++;
  kiln_backend_stats().last_fallback_reason = reason;
  auto kg = std::make_shared<KilnGraph>();
  kg->summary.backend = "eager";
  kg->summary.fallback_reason = reason;
  kg->summary.folded = folded;
  if (needs_autograd(*g)) g = with_cudnn_batch_norm(std::move(g));
  kg->fallback_ = make_eager_interpreter(g, constants_of(*g));
  return kg;
}

const KilnGraphSummary* kiln_graph_summary(const CompiledGraph& compiled) {
  if (const auto* kg = dynamic_cast<const KilnGraph*>(&compiled)) return &kg->summary;
  if (const auto* updating = dynamic_cast<const BufferUpdatingGraph*>(&compiled)) return kiln_graph_summary(updating->inner());
  if (const auto* checked = dynamic_cast<const AliasCheckedGraph*>(&compiled)) return kiln_graph_summary(checked->inner());
  const auto* joint = dynamic_cast<const AutogradGraph*>(&compiled);
  if (!joint) return nullptr;
  // One summary for both halves, built on first request and kept with the compiled graph.
  auto& slot = joint->summary_cache;
  if (!slot) {
    slot = std::make_shared<KilnGraphSummary>();
    const KilnGraphSummary* forward = kiln_graph_summary(joint->forward());
    const KilnGraphSummary* backward = kiln_graph_summary(joint->backward());
    slot->backend = "kiln_autograd";
    const std::pair<const KilnGraphSummary*, std::string> parts[] = {{forward, "forward:"}, {backward, "backward:"}};
    for (const auto& [part, prefix] : parts) {
      if (!part) continue;
      if (part->backend != "kiln") slot->fallback_reason += prefix + " " + part->fallback_reason + "; ";
      for (const auto& k : part->kernels) slot->kernels.push_back(prefix + k);
      for (const auto& e : part->externs) slot->externs.push_back(prefix + e);
      slot->source += part->source;
    }
  }
  return slot.get();
}

}  // namespace kiln::runtime
