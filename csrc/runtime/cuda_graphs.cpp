// CUDA graph replay of compiled graphs (cuda_graphs.h has the design: warm-up, recording, in-place and copied
// inputs, outputs copied out or kept inside kiln, the pool's liveness rule, and when recording is declined).
#include "runtime/cuda_graphs.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "common/log.h"

namespace kiln::runtime {

namespace {

CudaGraphApi g_api;

// A recording that moved inputs make stale is replaced; past this many recordings a graph runs unrecorded.
constexpr int kMaxRecordings = 4;

// One recorded CUDA graph and the memory it reads and writes.
struct Recording {
  void* graph = nullptr;
  size_t escaping = 0;
  std::vector<at::Tensor> copies;       // per input: the static buffer copied into before a replay (copied slots)
  std::vector<const void*> addresses;   // per input: the address an in-place slot must have for a replay
  std::vector<at::Tensor> outputs;      // as recorded: they live in the pool
  std::vector<int64_t> own_tensor_refs;   // per output: references to it that are ours (several outputs may be one)
  std::vector<int64_t> own_storage_refs;  // per output: references to its storage that are ours
  // Storages of other recordings' internal outputs that were alive while this one was recorded: the recording's
  // memory is clear of them.
  std::unordered_set<const c10::StorageImpl*> kept_clear;
  ~Recording() {
    outputs.clear();
    copies.clear();
    if (graph && g_api.release) g_api.release(graph);
  }
  // True when internal output i is referenced beyond the recording's own references.
  bool alive(size_t i) const {
    const at::Tensor& t = outputs[i];
    return t.defined() && (t.use_count() > own_tensor_refs[i] || t.storage().use_count() > own_storage_refs[i]);
  }
};

}  // namespace

class CudaGraphPool {
 public:
  ~CudaGraphPool() {
    if (handle_ && g_api.release) g_api.release(handle_);
  }

  // The pool handle, made on first use on `device` (it needs CUDA); null with `error` set when it cannot be made or
  // the model's graphs span two devices.
  void* handle(int device, std::string& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (handle_ && device != device_) {
      error = "the model's graphs run on cuda:" + std::to_string(device_) + " and cuda:" + std::to_string(device) +
              " (one pool per model and device)";
      return nullptr;
    }
    if (!handle_ && g_api.new_pool) {
      handle_ = g_api.new_pool(device, &error);
      device_ = device;
    }
    if (!g_api.new_pool) error = "CUDA graphs are not available in this process (no recording API registered)";
    return handle_;
  }

  void add(const std::shared_ptr<Recording>& recording) {
    std::lock_guard<std::mutex> lock(mutex_);
    recordings_.erase(std::remove_if(recordings_.begin(), recordings_.end(),
                                     [](const std::weak_ptr<Recording>& r) { return r.expired(); }),
                      recordings_.end());
    recordings_.push_back(recording);
  }

  // The storages of the pool's internal outputs that are referenced outside kiln's recordings now.
  std::unordered_set<const c10::StorageImpl*> alive_internal_storages() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::unordered_set<const c10::StorageImpl*> alive;
    for (const auto& weak : recordings_)
      if (auto r = weak.lock())
        for (size_t i = r->escaping; i < r->outputs.size(); ++i)
          if (r->alive(i)) alive.insert(r->outputs[i].storage().unsafeGetStorageImpl());
    return alive;
  }

  // Why replaying `recording` could overwrite memory someone still reads, or "": an internal output of its own still
  // referenced, or one of another recording that was not alive when this one was recorded.
  std::string conflict(const Recording& recording) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& weak : recordings_) {
      auto r = weak.lock();
      if (!r) continue;
      for (size_t i = r->escaping; i < r->outputs.size(); ++i) {
        if (!r->alive(i)) continue;
        if (r.get() == &recording) return "a value it saved for a backward on an earlier call is still referenced";
        if (!recording.kept_clear.count(r->outputs[i].storage().unsafeGetStorageImpl()))
          return "a value another graph of this model saved is still referenced";
      }
    }
    return "";
  }

 private:
  std::mutex mutex_;
  void* handle_ = nullptr;
  int device_ = -1;
  std::vector<std::weak_ptr<Recording>> recordings_;
};

namespace {

class CudaGraphRunner final : public CompiledGraph {
 public:
  CudaGraphRunner(std::shared_ptr<CompiledGraph> inner, std::shared_ptr<CudaGraphPool> pool, size_t escaping,
                  std::string name, std::string declined)
      : inner_(std::move(inner)), pool_(std::move(pool)), escaping_(escaping), name_(std::move(name)) {
    if (!declined.empty()) decline(declined);
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!declined_.empty()) {
      lock.unlock();
      return inner_->run(inputs);
    }
    if (std::string why = ineligible(inputs); !why.empty()) {
      decline(why);
      lock.unlock();
      return inner_->run(inputs);
    }
    if (recording_) {
      if (!moved_inputs(*recording_, inputs)) {
        if (std::string busy = pool_->conflict(*recording_); !busy.empty()) {
          cuda_graph_stats().unrecorded_runs++;
          unrecorded_++;
          KILN_LOG(cudagraphs) << name_ << ": runs unrecorded this call: " << busy;
          lock.unlock();
          return inner_->run(inputs);
        }
        return replay(*recording_, inputs);
      }
      recording_.reset();  // an in-place input moved: that slot is copied from now on
      if (recordings_made_ >= kMaxRecordings) {
        decline("its inputs keep changing address (recorded " + std::to_string(recordings_made_) + " times)");
        lock.unlock();
        return inner_->run(inputs);
      }
    }
    if (!warmed_up_) {
      warmed_up_ = true;
      for (const at::Tensor& t : inputs) warm_addresses_.push_back(t.defined() ? t.data_ptr() : nullptr);
      std::vector<at::Tensor> outputs = inner_->run(inputs);
      // An output on the host (the random seed efficient attention returns outside a recording) is computed by the
      // host: a replay would not compute it again.
      for (size_t i = 0; i < outputs.size(); ++i)
        if (outputs[i].defined() && !outputs[i].is_cuda()) {
          decline("output " + std::to_string(i) + " is made on " + outputs[i].device().str() +
                  ", which a replay would not compute again");
          break;
        }
      return outputs;
    }
    return record_and_replay(inputs);
  }

  const CompiledGraph* wrapped() const override { return inner_.get(); }

  std::string cudagraph_status() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!declined_.empty()) return "declined: " + declined_;
    if (!warmed_up_) return "waiting for its warm-up call";
    if (!recording_) return "to be recorded on its next call";
    return "recorded (" + std::to_string(recordings_made_) + (recordings_made_ == 1 ? " recording, " : " recordings, ") +
           std::to_string(replays_) + " replays, " + std::to_string(unrecorded_) + " unrecorded calls)";
  }

 private:
  // Why this call's inputs cannot be recorded at all, or "".
  std::string ineligible(const std::vector<at::Tensor>& inputs) const {
    const bool grad = at::GradMode::is_enabled();
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& t = inputs[i];
      if (!t.defined()) continue;
      if (!t.is_cuda()) return "input " + std::to_string(i) + " is on " + t.device().str() + " (CUDA graphs replay CUDA work only)";
      if (grad && t.requires_grad()) return "input " + std::to_string(i) + " requires grad under grad mode";
    }
    return "";
  }

  // True when an in-place slot's input is not at the recorded address (the slot is then marked to be copied), or a
  // copied slot's input changed layout.
  bool moved_inputs(const Recording& r, const std::vector<at::Tensor>& inputs) {
    bool moved = false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& t = inputs[i];
      if (r.copies[i].defined()) {
        if (!t.defined() || !t.sizes().equals(r.copies[i].sizes()) || !t.strides().equals(r.copies[i].strides()) ||
            t.scalar_type() != r.copies[i].scalar_type()) {
          moved = true;
        }
      } else if ((t.defined() ? t.data_ptr() : nullptr) != r.addresses[i]) {
        copy_slot_[i] = true;
        moved = true;
      }
    }
    if (moved) KILN_LOG(cudagraphs) << name_ << ": an input moved or changed layout: recording again";
    return moved;
  }

  std::vector<at::Tensor> replay(Recording& r, const std::vector<at::Tensor>& inputs) {
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (r.copies[i].defined()) r.copies[i].copy_(inputs[i], /*non_blocking=*/true);
    return launch(r);
  }

  // Replays `r` (its inputs in place) and hands out its outputs.
  std::vector<at::Tensor> launch(const Recording& r) {
    std::string error;
    KILN_CHECK(g_api.replay(r.graph, &error)) << name_ << ": replaying its CUDA graph failed: " << error;
    replays_++;
    cuda_graph_stats().replays++;
    return handed_out(r);
  }

  // The recording's outputs as the caller gets them: its own copy of each escaping one, the others in place.
  static std::vector<at::Tensor> handed_out(const Recording& r) {
    std::vector<at::Tensor> results;
    results.reserve(r.outputs.size());
    for (size_t i = 0; i < r.outputs.size(); ++i) {
      const at::Tensor& t = r.outputs[i];
      results.push_back(i < r.escaping && t.defined() ? t.clone() : t);
    }
    return results;
  }

  std::vector<at::Tensor> record_and_replay(const std::vector<at::Tensor>& inputs) {
    const int device = device_of(inputs);
    auto r = std::make_shared<Recording>();
    r->escaping = escaping_;
    copy_slot_.resize(inputs.size(), false);
    std::vector<at::Tensor> graph_inputs(inputs.size());
    {
      c10::NoGradGuard no_grad;
      // An input made by a recording of this pool, or at the address it had on the warm-up call, is read in place.
      const std::unordered_set<const c10::StorageImpl*> pool_values = pool_->alive_internal_storages();
      r->copies.resize(inputs.size());
      r->addresses.resize(inputs.size(), nullptr);
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& t = inputs[i];
        const bool stable = !t.defined() || pool_values.count(t.storage().unsafeGetStorageImpl()) ||
                            (i < warm_addresses_.size() && warm_addresses_[i] == t.data_ptr());
        if (stable && !copy_slot_[i]) {
          r->addresses[i] = t.defined() ? t.data_ptr() : nullptr;
          graph_inputs[i] = t;
        } else {
          r->copies[i] = at::empty_strided(t.sizes(), t.strides(), t.options());
          r->copies[i].copy_(t);
          graph_inputs[i] = r->copies[i];
        }
      }
      r->kept_clear = pool_values;
    }
    std::string error;
    void* pool = pool_->handle(device, error);
    void* capture = pool ? g_api.begin(pool, &error) : nullptr;
    if (!capture) return decline_and_run("recording could not start: " + error, inputs);
    std::vector<at::Tensor> outputs;
    try {
      outputs = inner_->run(graph_inputs);
    } catch (const std::exception& e) {
      std::string ignored;
      if (void* graph = g_api.end(capture, &ignored)) g_api.release(graph);
      return decline_and_run(std::string("recording failed (an op that cannot be captured, or host synchronisation): ") +
                                 e.what(),
                             inputs);
    }
    r->graph = g_api.end(capture, &error);
    if (!r->graph) return decline_and_run("recording failed: " + error, inputs);
    for (const at::Tensor& out : outputs) {
      if (!out.defined()) continue;
      for (const at::Tensor& in : graph_inputs)
        if (in.defined() && out.storage().is_alias_of(in.storage()))
          return decline_and_run("an output shares memory with an input", inputs);
    }
    r->outputs = std::move(outputs);
    graph_inputs.clear();
    for (const at::Tensor& t : r->outputs) {
      r->own_tensor_refs.push_back(t.defined() ? t.use_count() : 0);
      r->own_storage_refs.push_back(t.defined() ? t.storage().use_count() : 0);
    }
    pool_->add(r);
    recording_ = r;
    recordings_made_++;
    cuda_graph_stats().recordings++;
    KILN_LOG(cudagraphs) << name_ << ": recorded as a CUDA graph (" << r->outputs.size() << " outputs, "
                         << std::count_if(r->copies.begin(), r->copies.end(), [](const at::Tensor& c) { return c.defined(); })
                         << " of " << inputs.size() << " inputs copied in)";
    // Recording ran nothing: the first replay computes this call's outputs.
    return launch(*r);
  }

  static int device_of(const std::vector<at::Tensor>& inputs) {
    for (const at::Tensor& t : inputs)
      if (t.defined()) return t.device().index();
    return 0;
  }

  std::vector<at::Tensor> decline_and_run(const std::string& why, const std::vector<at::Tensor>& inputs) {
    decline(why);
    return inner_->run(inputs);
  }

  void decline(const std::string& why) {
    declined_ = why;
    recording_.reset();
    cuda_graph_stats().declined++;
    cuda_graph_stats().last_decline_reason = name_ + ": " + why;
    KILN_LOG(cudagraphs) << name_ << ": not replayed as a CUDA graph: " << why;
  }

  std::shared_ptr<CompiledGraph> inner_;
  std::shared_ptr<CudaGraphPool> pool_;
  size_t escaping_;
  std::string name_;
  mutable std::mutex mutex_;
  bool warmed_up_ = false;
  std::vector<const void*> warm_addresses_;
  std::vector<bool> copy_slot_;  // per input: copied on every later recording (it moved once)
  std::shared_ptr<Recording> recording_;
  std::string declined_;
  int recordings_made_ = 0;
  int64_t replays_ = 0;
  int64_t unrecorded_ = 0;
};

}  // namespace

void set_cuda_graph_api(CudaGraphApi api) { g_api = api; }

std::shared_ptr<CudaGraphPool> make_cuda_graph_pool() { return std::make_shared<CudaGraphPool>(); }

std::shared_ptr<CompiledGraph> make_cuda_graph_runner(std::shared_ptr<CompiledGraph> inner,
                                                      std::shared_ptr<CudaGraphPool> pool, size_t escaping,
                                                      std::string name, std::string declined) {
  return std::make_shared<CudaGraphRunner>(std::move(inner), std::move(pool), escaping, std::move(name),
                                           std::move(declined));
}

CudaGraphStats& cuda_graph_stats() {
  static CudaGraphStats stats;
  return stats;
}

}  // namespace kiln::runtime
