// Running a CompiledArtifact (kernel_graph.h): its device code loaded through the device backend that emitted it,
// and a flat run plan, per step either a kernel (a loaded kernel and the value ids whose data pointers it takes)
// or a prepared extern call. Buffers come from torch's allocators (CPU: large ones from host_buffers.h); kernels
// run on torch's current stream (CUDA) with no host synchronisation.
#include "runtime/kernel_graph.h"

#include <algorithm>
#include <atomic>
#include <sstream>
#include <optional>

#include <c10/core/GradMode.h>
#include <ATen/ops/empty_strided.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <unordered_set>

#include "codegen/device_backend.h"
#include "common/error.h"
#include "common/log.h"
#include "common/sha256.h"
#include "runtime/autograd_graph.h"
#include "runtime/autotune.h"
#include "runtime/cuda_launch.h"
#include "runtime/eager_interpreter.h"
#include "runtime/host_buffers.h"
#include "runtime/node_call.h"
#include "runtime/packed_outputs.h"

namespace kiln::runtime {

namespace {

using graph::ValueId;

struct KernelCall {
  std::unique_ptr<codegen::LoadedKernel> kernel;  // null: nothing to run (never for a built plan)
  std::string name;
  std::vector<ValueId> buffers;
  std::vector<bool> is_output;
  std::vector<at::TensorOptions> options;  // per output buffer
  // Per buffer: the input buffer whose storage this output takes when nothing else holds it (in_place_outputs.h
  // and build_plan), or -1.
  std::vector<int32_t> in_place_from;
  // Autotuning (autotune.h): the kernel's other schedules, loaded, until the first call outside a CUDA graph capture
  // times them; then `kernel` is the fastest and these are dropped. labels[0] is `kernel`'s.
  std::vector<std::unique_ptr<codegen::LoadedKernel>> variants;
  std::vector<std::string> labels;
  std::string tune_key;
};

// An extern call's tuning (autotune.h): which kind applies, and for BLAS ops the candidate chosen (-1: not yet).
struct ExternTune {
  ExternTuning kind = ExternTuning::kNone;
  int choice = -1;
};

struct PlanStep {
  int32_t kernel = -1;  // index into kernels_, or -1 for an extern call
  int32_t external = -1;  // index into externs_
  std::vector<ValueId> release_after;
  std::vector<ValueId> release_inputs_after;  // graph inputs last read here (freed under run_consuming)
};

LoadUnlock g_load_unlock;

// Drops the embedding interpreter's lock (the GIL) while code loads, so other Python threads keep going while the
// C++ compiler or NVRTC runs; nothing to drop in a program without Python.
class WithoutGil {
 public:
  WithoutGil() : state_(g_load_unlock.release ? g_load_unlock.release() : nullptr) {}
  ~WithoutGil() {
    if (state_) g_load_unlock.restore(state_);
  }

 private:
  void* state_;
};


class KilnGraph final : public CompiledGraph {
 public:
  bool reenters_python() const override { return fallback_ ? fallback_->reenters_python() : custom_ops_; }
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
    if (tuning_pending_.load(std::memory_order_acquire)) {
      void* stream = cuda::torch_current_stream(device_.index);
      // Timing synchronises with the device, which a CUDA graph capture forbids: a captured call runs the defaults,
      // and the next call outside a capture tunes (reduce-overhead's warm-up call comes first).
      if (!timer_backend_->capturing(stream)) {
        std::lock_guard<std::mutex> lock(tune_mutex_);
        if (tuning_pending_.load(std::memory_order_relaxed)) {
          TuneProgress progress(pending_questions());
          const TuneTimer timer(*timer_backend_, device_.index, stream);
          std::vector<at::Tensor> outputs = execute_plan(std::move(inputs), release_inputs, pack, &timer, &progress);
          tuning_pending_.store(false, std::memory_order_release);
          return outputs;
        }
      }
    }
    return execute_plan(std::move(inputs), release_inputs, pack, nullptr, nullptr);
  }

  size_t pending_questions() const {
    size_t n = 0;
    for (const KernelCall& k : kernels_) n += k.variants.empty() ? 0 : 1;
    for (const ExternTune& e : extern_tune_) n += e.kind == ExternTuning::kBlas && e.choice < 0 ? 1 : 0;
    return n;
  }

  // Chooses the schedule of `k` (autotune.h), timing its candidates on scratch outputs: inputs are only read, so the
  // graph's values are what they would have been, whatever in-place reuse the real call makes.
  void tune_kernel(KernelCall& k, const std::vector<void*>& pointers, const graph::Graph& g, const TuneTimer& timer,
                   void* stream, TuneProgress* progress) {
    std::vector<void*> scratch_pointers = pointers;
    std::vector<at::Tensor> scratch;
    size_t out = 0;
    for (size_t b = 0; b < k.buffers.size(); ++b) {
      if (!k.is_output[b]) continue;
      const graph::TensorMeta& meta = g.values[k.buffers[b]].meta;
      scratch.push_back(at::empty_strided(meta.sizes, meta.strides, k.options[out++]));
      scratch_pointers[b] = scratch.back().data_ptr();
    }
    const TuneQuestion question{k.tune_key, k.name, k.labels};
    const size_t chosen = choose(question, timer, [&](size_t i) {
      const codegen::LoadedKernel& candidate = i == 0 ? *k.kernel : *k.variants[i - 1];
      candidate.run(scratch_pointers.data(), scratch_pointers.size(), stream);  // an index error: the real run says so
    }, progress);
    if (chosen > 0) k.kernel = std::move(k.variants[chosen - 1]);
    k.variants.clear();
  }

  // Chooses the BLAS library of a matmul extern, timing the call itself (an out-of-place op: each run only makes a
  // new result).
  void tune_extern(size_t index, std::vector<at::Tensor>& env, const graph::Graph& g, const TuneTimer& timer,
                   TuneProgress* progress) {
    const PreparedNode& external = externs_[index];
    std::ostringstream key;
    key << external.name;
    for (const c10::IValue& v : argument_stack(external, g, constants_, env)) {
      if (v.isTensor()) key << " " << v.toTensor().scalar_type() << v.toTensor().sizes() << v.toTensor().strides();
      else key << " " << v;
    }
    key << " preferred " << static_cast<int>(at::globalContext().blasPreferredBackend());
    const TuneQuestion question{key.str(), external.name, blas_candidate_labels()};
    extern_tune_[index].choice = static_cast<int>(choose(question, timer, [&](size_t i) {
      ExternChoiceGuard choice(ExternTuning::kBlas, static_cast<int>(i));
      call_node(external, g, constants_, env);
    }, progress));
  }

  // Extern call `index`: into the output buckets a pack plan gives it, else as call_node makes its results.
  void run_extern(int32_t index, std::vector<at::Tensor>& env, const PackPlan* pack, std::vector<at::Tensor>& buckets) {
    const graph::Graph& g = *graph_;
    const PreparedNode& external = externs_[index];
    if (!pack || !pack->extern_into[index]) {
      call_node(external, g, constants_, env);
      return;
    }
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
  }

  std::vector<at::Tensor> execute_plan(std::vector<at::Tensor> inputs, bool release_inputs, const PackPlan* pack,
                                       const TuneTimer* timer, TuneProgress* progress) {
    const graph::Graph& g = *graph_;
    KILN_CHECK(inputs.size() == g.inputs.size())
        << "compiled graph expects " << g.inputs.size() << " input tensors, got " << inputs.size();
    std::vector<at::Tensor> env = constants_;
    for (size_t i = 0; i < inputs.size(); ++i) env[g.inputs[i]] = std::move(inputs[i]);
    std::vector<void*> pointers;
    void* stream = device_.type == graph::DeviceType::CUDA ? cuda::torch_current_stream(device_.index) : nullptr;
    std::optional<HostBufferScope> host_buffers;  // CPU: large buffers reused across calls (host_buffers.h)
    if (device_.type == graph::DeviceType::CPU) host_buffers.emplace();
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
        if (timer && !k.variants.empty()) tune_kernel(kernels_[step.kernel], pointers, g, *timer, stream, progress);
        const bool in_range = k.kernel->run(pointers.data(), pointers.size(), stream);
        // eager's error, type and message: "index out of range in self" (an IndexError in Python)
        TORCH_CHECK_INDEX(in_range, "index out of range in self (kiln kernel ", k.name,
                          ": an embedding, gather, index_select or scatter index outside its dim)");
      } else {
        // Tuned before either way of calling it, and both calls run under the choice (a packed training graph's
        // matmuls go through call_node_into).
        ExternTune& tune = extern_tune_[step.external];
        if (timer && tune.kind == ExternTuning::kBlas && tune.choice < 0) tune_extern(step.external, env, g, *timer, progress);
        ExternChoiceGuard choice(tune.kind, tune.choice);
        run_extern(step.external, env, pack, buckets);
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
  bool custom_ops_ = false;  // some extern call is a custom op, whose kernel may be Python (reenters_python)
  std::vector<at::Tensor> constants_;
  std::vector<KernelCall> kernels_;
  std::vector<PreparedNode> externs_;
  std::vector<PlanStep> plan_;
  graph::Device device_;
  const codegen::DeviceBackend* backend_ = nullptr;  // null when the graph has no generated kernel
  std::shared_ptr<const codegen::LoadedCode> code_;
  std::mutex pack_mutex_;
  std::shared_ptr<const PackPlan> pack_plan_;  // the last mask's (pack_plan)
  // Autotuning (make_kiln_graph's `autotune`): per extern, its tuning; whether choices remain to be timed, by the
  // device backend's timer, one call at a time.
  std::vector<ExternTune> extern_tune_;
  std::atomic<bool> tuning_pending_{false};
  std::mutex tune_mutex_;
  const codegen::DeviceBackend* timer_backend_ = nullptr;
};

// A kernel candidate as autotuning's logs and disk entries name it: its strategy and launch.
std::string tuning_label(const cache::KernelEntry& entry) {
  return entry.strategy + " grid " + std::to_string(entry.grid) + " block " + std::to_string(entry.block_x) + "x" +
         std::to_string(entry.block_y);
}

// The run plan of `record`'s loaded code: per step a bound kernel or a prepared extern call, in-place outputs where
// nothing else holds the input, and each value released after its last use.
void build_plan(KilnGraph& kg, const cache::CompiledArtifact& record, bool autotune) {
  const cache::DeviceCode& code = record.code;
  const graph::Graph& g = *kg.graph_;
  std::vector<int32_t> last_use(g.values.size(), -1);
  for (const fusion::Step& step : record.steps) {
    PlanStep plan_step;
    const auto position = static_cast<int32_t>(kg.plan_.size());
    if (step.kind == fusion::Step::Kind::Kernel) {
      const bool grouped = std::find(code.group_members.begin(), code.group_members.end(), step.index) !=
                           code.group_members.end();
      if (grouped && step.index != code.group_members.front()) continue;  // launched with the first member
      const cache::PlannedKernel& k = record.kernels[step.index];
      KernelCall call;
      call.name = grouped ? code.group.name : k.name;
      call.kernel = kg.code_->kernel(grouped ? code.group : code.kernels[step.index], k.gathers);
      const at::Device device = to_c10(kg.device_);
      // a launch group passes its members' buffers one after the other (emit_cuda_source)
      const std::vector<int32_t> members = grouped ? code.group_members : std::vector<int32_t>{step.index};
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
      if (!grouped && autotune && !code.kernels[step.index].variants.empty()) {
        const cache::KernelEntry& entry = code.kernels[step.index];
        call.tune_key = entry.tune_key;
        call.labels.push_back(tuning_label(entry));
        for (const cache::KernelEntry& variant : entry.variants) {
          call.variants.push_back(kg.code_->kernel(variant, k.gathers));
          call.labels.push_back(tuning_label(variant));
        }
      }
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
  kg.extern_tune_.assign(kg.externs_.size(), ExternTune{});
  if (autotune && kg.device_.type == graph::DeviceType::CUDA) {
    for (size_t e = 0; e < kg.externs_.size(); ++e) kg.extern_tune_[e].kind = extern_tuning(kg.externs_[e].name);
    kg.timer_backend_ = &codegen::device_backend(graph::DeviceType::CUDA);
    kg.tuning_pending_ = kg.pending_questions() > 0;
  }
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

// Writes the graph and its source into `dir` (KILN_DEBUG_DIR, or the compile's debug_dir option), creating it when
// missing. A debug dump never fails a compile: a directory that cannot be written is logged under `fallbacks`.
void dump_debug(const std::string& dir, const std::string& name, const std::string& graph_text, const std::string& source,
                const std::string& backend) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = dir + "/" + name;
  std::ofstream graph_file(path + ".graph.txt");
  std::ofstream source_file(path + (backend == "cuda" ? ".cu" : ".cpp"));
  graph_file << graph_text;
  source_file << source;
  if (!graph_file || !source_file)
    KILN_LOG(fallbacks) << "debug dump: cannot write " << path << ".* (" << (ec ? ec.message() : "write failed")
                        << "); the compile goes on without it";
}

// A graph whose in-place updates of inputs were made functional (make_buffer_updating_graph).
class BufferUpdatingGraph final : public CompiledGraph {
 public:
  BufferUpdatingGraph(std::shared_ptr<CompiledGraph> inner, std::vector<int32_t> updated_inputs, size_t num_outputs)
      : inner_(std::move(inner)), updated_inputs_(std::move(updated_inputs)), num_outputs_(num_outputs) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    std::vector<at::Tensor> results = inner_->run(inputs);
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < updated_inputs_.size(); ++i) inputs.at(updated_inputs_[i]).copy_(results.at(num_outputs_ + i));
    results.resize(num_outputs_);
    return results;
  }
  const CompiledGraph* wrapped() const override { return inner_.get(); }

 private:
  std::shared_ptr<CompiledGraph> inner_;
  std::vector<int32_t> updated_inputs_;
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
  const CompiledGraph* wrapped() const override { return inner_.get(); }
  bool reenters_python() const override { return inner_->reenters_python() || eager_->reenters_python(); }

 private:
  std::shared_ptr<CompiledGraph> inner_;
  std::shared_ptr<CompiledGraph> eager_;
  std::vector<int32_t> updated_;
};

}  // namespace

void set_load_unlock(LoadUnlock unlock) { g_load_unlock = unlock; }

std::shared_ptr<CompiledGraph> make_kiln_graph(cache::CompiledArtifact artifact, const graph::Device& device,
                                               const ConstantsOf& constants_of, const std::string& load_context,
                                               const std::string& dump_dir, std::vector<std::string> folded,
                                               bool autotune) {
  auto kg = std::make_shared<KilnGraph>();
  auto optimised = std::make_shared<graph::Graph>(std::move(artifact.optimised));
  kg->graph_ = optimised;
  kg->custom_ops_ = calls_custom_ops(*optimised);
  kg->constants_ = constants_of(*optimised);
  kg->constants_.resize(optimised->values.size());
  kg->device_ = device;
  kg->summary.backend = "kiln";
  kg->summary.folded = std::move(folded);
  kg->summary.device = device.type == graph::DeviceType::CUDA ? "cuda:" + std::to_string(device.index) : "cpu";
  const cache::DeviceCode& code = artifact.code;
  kg->summary.source = code.source();
  if (!code.empty()) {
    KILN_LOG(output_code) << "kiln backend (" << kg->summary.device << "):\n" << kg->summary.source;
    if (!dump_dir.empty())  // named by the source's digest; without libcrypto, by the standard library's hash
      dump_debug(dump_dir,
                 "kiln_" + sha256_hex(kg->summary.source)
                               .value_or(std::to_string(std::hash<std::string>{}(kg->summary.source)))
                               .substr(0, 12),
                 optimised->to_string(), kg->summary.source, code.backend);
    for (const cache::KernelEntry& entry : code.kernels)
      if (!entry.strategy.empty()) kg->summary.strategies.push_back(entry.strategy);
    kg->backend_ = &codegen::device_backend_named(code.backend);
    kg->backend_->prepare_load();
    WithoutGil no_gil;
    kg->code_ = kg->backend_->load(code, device.index, load_context);
  }
  build_plan(*kg, artifact, autotune);
  return kg;
}

std::shared_ptr<CompiledGraph> make_fallback_graph(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants,
                                                   std::string reason, std::vector<std::string> folded) {
  auto kg = std::make_shared<KilnGraph>();
  kg->summary.backend = "eager";
  kg->summary.fallback_reason = std::move(reason);
  kg->summary.folded = std::move(folded);
  kg->fallback_ = make_eager_interpreter(std::move(g), std::move(constants));
  return kg;
}

std::shared_ptr<CompiledGraph> make_buffer_updating_graph(std::shared_ptr<CompiledGraph> inner,
                                                          std::vector<int32_t> updated_inputs, size_t num_outputs) {
  return std::make_shared<BufferUpdatingGraph>(std::move(inner), std::move(updated_inputs), num_outputs);
}

std::shared_ptr<CompiledGraph> make_alias_checked_graph(std::shared_ptr<CompiledGraph> inner,
                                                        std::shared_ptr<CompiledGraph> eager, std::vector<int32_t> updated) {
  return std::make_shared<AliasCheckedGraph>(std::move(inner), std::move(eager), std::move(updated));
}

KilnBackendStats& kiln_backend_stats() {
  static KilnBackendStats s;
  return s;
}

const KilnGraphSummary* kiln_graph_summary(const CompiledGraph& compiled) {
  if (const auto* kg = dynamic_cast<const KilnGraph*>(&compiled)) return &kg->summary;
  if (const CompiledGraph* inner = compiled.wrapped()) return kiln_graph_summary(*inner);
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
