// Autotuning's timing, memory and reports (autotune.h).
//
// Design: a candidate is timed as torch.compile's benchmarker does, on the device between events, after one warm-up
// run: enough back-to-back runs to fill about a millisecond (at least 5, at most 100), so that a 3 us kernel and a
// 2 ms GEMM are both measured above the events' resolution; the mean per run is compared. Candidates run on scratch
// outputs (the caller's), so timing never changes what the graph computes. Choices are remembered by key in a
// process-wide table, and on disk as a one-line text entry holding the candidate's index and label: a label that no
// longer matches (another kiln) is timed again.
#include "runtime/autotune.h"

#include <unistd.h>

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "cache/kernel_cache.h"
#include "common/error.h"
#include "common/log.h"
#include "runtime/torch_info.h"

namespace kiln::runtime {

namespace {

constexpr const char* kTunedKind = "tuned";
constexpr double kFillMs = 1.0;
constexpr int kMinReps = 5;
constexpr int kMaxReps = 100;

std::mutex g_memory_mutex;
std::unordered_map<std::string, size_t>& memory() {
  static std::unordered_map<std::string, size_t> m;
  return m;
}

std::string format_ms(double ms) {
  std::ostringstream out;
  if (ms < 0) return "failed";
  if (ms < 1.0) out << std::fixed << std::setprecision(1) << ms * 1000.0 << " us";
  else out << std::fixed << std::setprecision(3) << ms << " ms";
  return out.str();
}

// The disk entry: "<index> <label>". nullopt when missing, unreadable or naming another candidate list.
std::optional<size_t> read_choice(const std::string& key, const TuneQuestion& q) {
  const std::optional<std::string> text = cache::read_entry(kTunedKind, key, ".txt");
  if (!text) return std::nullopt;
  std::istringstream in(*text);
  size_t index = 0;
  if (!(in >> index) || index >= q.labels.size()) return std::nullopt;
  std::string label;
  in.get();
  std::getline(in, label);
  if (label != q.labels[index]) return std::nullopt;
  return index;
}

// ATen warns once that its preferred-BLAS switch is experimental: a user who asked for max-autotune did not set it.
class SwallowWarnings final : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

void set_blas_backend(at::BlasBackend backend) {
  SwallowWarnings swallow;
  c10::WarningUtils::WarningHandlerGuard guard(&swallow);
  at::globalContext().setBlasPreferredBackend(backend);
}

}  // namespace

double TuneProgress::now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double TuneTimer::time(const std::function<void()>& run) const {
  try {
    const double once = backend_.time_ms(run, index_, stream_, 1);  // the warm-up, and the estimate of one run
    const int reps = std::clamp(static_cast<int>(std::ceil(kFillMs / std::max(once, 1e-4))), kMinReps, kMaxReps);
    return backend_.time_ms(run, index_, stream_, reps);
  } catch (const Error& e) {
    KILN_LOG(autotune) << "a candidate failed to run and is skipped: " << e.what();
    return -1.0;
  }
}

std::string tuning_device_key(const codegen::DeviceBackend& backend, int index) {
  return std::string(backend.name()) + " " + backend.device_name(index) + ", " +
         std::to_string(backend.multiprocessors(index)) + " SMs, torch " + built_torch_version();
}

size_t choose(const TuneQuestion& q, const TuneTimer& timer, const std::function<void(size_t)>& run,
              TuneProgress* progress) {
  if (q.labels.size() <= 1) return 0;
  // Without a key (a kernel's tune_key needs libcrypto's SHA-256) the choice is timed and used, never remembered.
  const bool keyed = !q.key.empty();
  const std::optional<std::string> disk_key =
      keyed ? cache::entry_key(q.key + "\n" + tuning_device_key(timer.backend(), timer.index()) + "\nschema " +
                               std::to_string(cache::kSchemaVersion))
            : std::nullopt;
  const std::string memory_key = disk_key.value_or(q.key + "\n" + tuning_device_key(timer.backend(), timer.index()));
  if (keyed) {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    auto it = memory().find(memory_key);
    if (it != memory().end() && it->second < q.labels.size()) {
      if (progress) progress->remembered();
      return it->second;
    }
  }
  if (disk_key) {
    if (std::optional<size_t> found = read_choice(*disk_key, q)) {
      std::lock_guard<std::mutex> lock(g_memory_mutex);
      memory()[memory_key] = *found;
      if (progress) progress->remembered();
      KILN_LOG(autotune) << q.what << ": " << q.labels[*found] << " (from the disk cache)";
      return *found;
    }
  }
  std::vector<double> ms(q.labels.size(), -1.0);
  for (size_t i = 0; i < q.labels.size(); ++i) ms[i] = timer.time([&] { run(i); });
  size_t winner = 0;
  for (size_t i = 1; i < ms.size(); ++i) {
    if (ms[i] < 0) continue;
    const double best = ms[winner] < 0 ? INFINITY : ms[winner];
    // the default keeps its place unless beaten by the margin; among the others, the fastest
    const double needed = winner == 0 ? best * (1.0 - kMinGain) : best;
    if (ms[i] < needed) winner = i;
  }
  if (ms[winner] < 0) winner = 0;  // nothing ran: the default, as mode="default" would
  if (keyed) {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    memory()[memory_key] = winner;
  }
  if (disk_key) cache::publish_content(kTunedKind, *disk_key, ".txt", std::to_string(winner) + " " + q.labels[winner] + "\n");
  if (progress) progress->measured(q, winner, ms);
  return winner;
}

void TuneProgress::measured(const TuneQuestion& q, size_t winner, const std::vector<double>& ms) {
  ++done_;
  const double elapsed = now_ms() - started_ms_;
  const double left = elapsed / static_cast<double>(done_) * static_cast<double>(total_ > done_ ? total_ - done_ : 0);
  std::ostringstream text;
  text << done_ << "/" << total_ << " " << q.what << ": " << q.labels[winner] << " " << format_ms(ms[winner]);
  if (winner != 0) text << " (default " << q.labels[0] << " " << format_ms(ms[0]) << ")";
  else text << " (the default; " << q.labels.size() - 1 << " others slower or within " << kMinGain * 100 << "%)";
  text << "; " << std::fixed << std::setprecision(1) << elapsed / 1000.0 << " s elapsed, about " << left / 1000.0
       << " s left";
  if (log::enabled(log::Category::autotune)) {
    log::emit(log::Category::autotune, text.str());
  } else if (elapsed > 1000.0 && isatty(2)) {
    std::fprintf(stderr, "\r[kiln:autotune] %s\033[K", text.str().c_str());
    std::fflush(stderr);
    line_open_ = true;
  }
}

TuneProgress::~TuneProgress() {
  if (line_open_) {
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }
}

ExternTuning extern_tuning(const std::string& qualified) {
  const std::string op = qualified.substr(0, qualified.find('.'));
  if (op == "aten::mm" || op == "aten::addmm" || op == "aten::bmm" || op == "aten::baddbmm") return ExternTuning::kBlas;
  if (op == "aten::convolution" || op == "aten::_convolution" || op == "aten::convolution_backward" ||
      op == "aten::cudnn_convolution" || op == "aten::cudnn_convolution_transpose")
    return ExternTuning::kCudnn;
  return ExternTuning::kNone;
}

std::vector<std::string> blas_candidate_labels() {
  // Candidate 1 is the backend the current preference does not resolve to (Default is cuBLAS on NVIDIA GPUs).
  const at::BlasBackend preferred = at::globalContext().blasPreferredBackend();
  const bool lt = preferred == at::BlasBackend::Cublaslt;
  return {std::string("as preferred (") + (lt ? "cuBLASLt" : "cuBLAS") + ")", lt ? "cuBLAS" : "cuBLASLt"};
}

ExternChoiceGuard::ExternChoiceGuard(ExternTuning kind, int blas_choice) : kind_(kind) {
  at::Context& context = at::globalContext();
  if (kind == ExternTuning::kCudnn) {
    previous_ = context.benchmarkCuDNN() ? 1 : 0;
    context.setBenchmarkCuDNN(true);
    active_ = true;
  } else if (kind == ExternTuning::kBlas && blas_choice == 1) {
    const at::BlasBackend preferred = context.blasPreferredBackend();
    previous_ = static_cast<int>(preferred);
    set_blas_backend(preferred == at::BlasBackend::Cublaslt ? at::BlasBackend::Cublas : at::BlasBackend::Cublaslt);
    active_ = true;
  }
}

ExternChoiceGuard::~ExternChoiceGuard() {
  if (!active_) return;
  at::Context& context = at::globalContext();
  if (kind_ == ExternTuning::kCudnn) context.setBenchmarkCuDNN(previous_ == 1);
  else set_blas_backend(static_cast<at::BlasBackend>(previous_));
}

}  // namespace kiln::runtime
