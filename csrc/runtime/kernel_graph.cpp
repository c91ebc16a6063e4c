// The "kiln" backend's compile pipeline and its CompiledGraph.
//
// Design: compile_kiln_graph is a straight line (checks -> graph passes -> schedule -> C++ source -> cached
// shared library -> run plan); any exception on the way turns into the eager interpreter for this graph,
// so a compiler problem costs speed, never an answer. The run plan is flat: per step either a kernel (a
// function pointer and the value ids whose data pointers it takes) or a prepared extern call.
#include "runtime/kernel_graph.h"

#include <atomic>

#include <Python.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/empty_strided.h>

#include <cstdlib>
#include <fstream>
#include <unordered_set>

#include "cache/kernel_cache.h"
#include "codegen/cpp/compile_cpp.h"
#include "codegen/cpp/emit_cpp.h"
#include "common/error.h"
#include "common/log.h"
#include "fusion/schedule_kernels.h"
#include "passes/pipeline.h"
#include "runtime/autograd_graph.h"
#include "runtime/eager_interpreter.h"
#include "runtime/node_call.h"
#include "runtime/torch_info.h"

namespace kiln::runtime {

namespace {

using graph::ValueId;
using KernelFn = void (*)(void* const*);

struct KernelCall {
  KernelFn fn = nullptr;
  std::vector<ValueId> buffers;
  std::vector<bool> is_output;
  std::vector<at::TensorOptions> options;  // per output buffer
};

struct PlanStep {
  int32_t kernel = -1;  // index into kernels_, or -1 for an extern call
  int32_t external = -1;  // index into externs_
  std::vector<ValueId> release_after;
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
    const graph::Graph& g = *graph_;
    KILN_CHECK(inputs.size() == g.inputs.size())
        << "compiled graph expects " << g.inputs.size() << " input tensors, got " << inputs.size();
    std::vector<at::Tensor> env = constants_;
    for (size_t i = 0; i < inputs.size(); ++i) env[g.inputs[i]] = inputs[i];
    std::vector<void*> pointers;
    for (const PlanStep& step : plan_) {
      if (step.kernel >= 0) {
        const KernelCall& k = kernels_[step.kernel];
        pointers.resize(k.buffers.size());
        size_t out = 0;
        for (size_t b = 0; b < k.buffers.size(); ++b) {
          at::Tensor& t = env[k.buffers[b]];
          if (k.is_output[b]) {
            const auto& meta = g.values[k.buffers[b]].meta;
            t = at::empty_strided(meta.sizes, meta.strides, k.options[out++]);
          }
          pointers[b] = t.data_ptr();
        }
        k.fn(pointers.data());
      } else {
        call_node(externs_[step.external], g, constants_, env);
      }
      for (ValueId id : step.release_after) env[id].reset();
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
};

// True when the graph must record autograd history: grad mode on and some value requires grad.
bool needs_autograd(const graph::Graph& g) {
  if (!at::GradMode::is_enabled()) return false;
  for (const graph::Value& v : g.values)
    if (v.meta.requires_grad) return true;
  return false;
}

// Why `g` must stay on the eager interpreter, or "".
std::string unsupported_reason(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes)
    if (node.mutates_args) return "in-place op " + node.qualified_name();
  for (const graph::Value& v : g.values) {
    if (v.meta.device.type != graph::DeviceType::CPU) return "tensors on " + graph::device_type_name(v.meta.device.type) + " (the C++ backend is CPU-only)";
  }
  return "";
}

void dump_debug(const std::string& name, const std::string& graph_text, const std::string& source) {
  const char* dir = std::getenv("KILN_DEBUG_DIR");
  if (!dir || !*dir) return;
  try {
    std::string path = std::string(dir) + "/" + name;
    std::ofstream(path + ".graph.txt") << graph_text;
    std::ofstream(path + ".cpp") << source;
  } catch (...) {
    // a debug dump never fails a compile
  }
}

void build_plan(KilnGraph& kg, const fusion::Schedule& schedule) {
  const graph::Graph& g = *kg.graph_;
  std::vector<int32_t> last_use(g.values.size(), -1);
  for (const fusion::Step& step : schedule.steps) {
    PlanStep plan_step;
    const auto position = static_cast<int32_t>(kg.plan_.size());
    if (step.kind == fusion::Step::Kind::Kernel) {
      const fusion::Kernel& k = schedule.kernels[step.index];
      KernelCall call;
      call.fn = reinterpret_cast<KernelFn>(kg.library_->symbol(k.name));
      for (const auto& buf : k.buffers) {
        call.buffers.push_back(buf.value);
        call.is_output.push_back(buf.is_output);
        if (buf.is_output) {
          call.options.push_back(at::TensorOptions().dtype(static_cast<at::ScalarType>(buf.dtype)).device(at::kCPU));
        } else {
          last_use[buf.value] = position;
        }
      }
      plan_step.kernel = static_cast<int32_t>(kg.kernels_.size());
      kg.kernels_.push_back(std::move(call));
      kg.summary.kernels.push_back(k.name);
    } else {
      const graph::Node& node = g.nodes[step.index];
      for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { last_use[id] = position; });
      plan_step.external = static_cast<int32_t>(kg.externs_.size());
      kg.externs_.push_back(prepare_node(g, node, kg.constants_));
      kg.summary.externs.push_back(node.qualified_name());
    }
    kg.plan_.push_back(std::move(plan_step));
  }
  std::unordered_set<ValueId> kept(g.outputs.begin(), g.outputs.end());
  for (const graph::Value& v : g.values)
    if (v.producer >= 0 && !kept.count(v.id) && last_use[v.id] >= 0) kg.plan_[last_use[v.id]].release_after.push_back(v.id);
}

std::shared_ptr<KilnGraph> compile_kernels(std::shared_ptr<const graph::Graph> original, const ConstantsOf& constants_of) {
  auto optimised = std::make_shared<graph::Graph>(*original);
  passes::run_graph_passes(*optimised);
  fusion::Schedule schedule = fusion::schedule_kernels(*optimised);
  if (passes::verify_enabled())
    for (const auto& k : schedule.kernels) fusion::verify_kernel(k);
  auto kg = std::make_shared<KilnGraph>();
  kg->graph_ = optimised;
  kg->constants_ = constants_of(*optimised);
  kg->constants_.resize(optimised->values.size());
  kg->summary.backend = "kiln";
  bool has_kernels = false;
  for (const auto& step : schedule.steps) has_kernels = has_kernels || step.kind == fusion::Step::Kind::Kernel;
  if (has_kernels) {
    kg->summary.source = codegen::cpp::emit_cpp_source(schedule, *optimised);
    KILN_LOG(output_code) << "kiln backend: " << schedule.summary() << "\n" << kg->summary.source;
    dump_debug("kiln_" + cache::hash_hex(kg->summary.source).substr(0, 12), optimised->to_string(), kg->summary.source);
    WithoutGil no_gil;
    kg->library_ = codegen::cpp::compile_cpp_library(kg->summary.source, "torch " + built_torch_version());
  }
  build_plan(*kg, schedule);
  return kg;
}

}  // namespace

KilnBackendStats& kiln_backend_stats() {
  static KilnBackendStats s;
  return s;
}

namespace {
std::atomic<bool> g_compiled_autograd{false};
}  // namespace

void set_compiled_autograd(bool on) { g_compiled_autograd = on; }
bool compiled_autograd() { return g_compiled_autograd; }

std::shared_ptr<CompiledGraph> compile_kiln_graph(std::shared_ptr<const graph::Graph> g, const ConstantsOf& constants_of) {
  std::string reason;
  if (needs_autograd(*g) && !compiled_autograd()) {
    reason = "the graph needs grad (compiled autograd is off: kiln.config.set_compiled_autograd)";
  } else if (needs_autograd(*g)) {
    // Forward and backward compiled ahead of time behind one autograd node; anything autodiff does not
    // cover keeps the eager interpreter, which records eager's autograd history op by op.
    try {
      auto joint = compile_autograd_graph(g, [&](std::shared_ptr<const graph::Graph> part) {
        at::AutoGradMode no_grad(false);  // the halves run with grad off: compile them as such
        return compile_kiln_graph(std::move(part), constants_of);
      });
      kiln_backend_stats().graphs_autograd++;
      return joint;
    } catch (const std::exception& e) {
      reason = std::string("autodiff: ") + e.what();
    }
  } else {
    reason = unsupported_reason(*g);
  }
  if (reason.empty()) {
    try {
      auto kg = compile_kernels(g, constants_of);
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
  kg->fallback_ = make_eager_interpreter(g, constants_of(*g));
  return kg;
}

const KilnGraphSummary* kiln_graph_summary(const CompiledGraph& compiled) {
  if (const auto* kg = dynamic_cast<const KilnGraph*>(&compiled)) return &kg->summary;
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
