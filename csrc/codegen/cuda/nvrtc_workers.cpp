// The NVRTC worker pool (see nvrtc_workers.h).
#include "codegen/cuda/nvrtc_workers.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "common/log.h"

extern char** environ;

namespace kiln::codegen::cuda {
namespace {

constexpr size_t kMaxWorkers = 8;
constexpr const char* kWorkerName = "kiln-nvrtc-worker";
constexpr long kAnswerTimeoutSeconds = 300;  // NVRTC takes well under a second for kiln's largest programs

struct Worker {
  pid_t pid = -1;
  int socket = -1;
};

struct Pool {
  pid_t owner = getpid();  // a forked child (a DataLoader worker) must not talk to its parent's workers
  std::mutex mutex;
  std::vector<Worker> idle;
  size_t live = 0;
  NvrtcWorkerStats stats;
};

Pool& pool() {
  static Pool* instance = new Pool();  // never destroyed: workers outlive interpreter teardown until exit
  return *instance;
}

// The worker executable: beside the library this code is linked into (kiln/_C*.so, installed or built in place).
std::string worker_path() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&compile_in_worker), &info) || !info.dli_fname) return "";
  return (std::filesystem::path(info.dli_fname).parent_path() / kWorkerName).string();
}

// A new worker, or one with pid -1 and `why` set.
Worker start_worker(const std::string& path, std::string& why) {
  Worker w;
  int ends[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) {
    why = "socketpair failed";
    return w;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, ends[1], 0);  // dup2 clears close-on-exec on the copies
  posix_spawn_file_actions_adddup2(&actions, ends[1], 1);
  char* argv[] = {const_cast<char*>(kWorkerName), nullptr};
  pid_t pid = -1;
  int rc = posix_spawn(&pid, path.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(ends[1]);
  if (rc != 0) {
    close(ends[0]);
    why = "could not start " + path + " (" + std::strerror(rc) + ")";
    return w;
  }
  // A worker that hangs must not hang the compile: after this long without an answer the request fails, the
  // worker is retired and the program compiles in this process.
  timeval timeout{};
  timeout.tv_sec = kAnswerTimeoutSeconds;
  setsockopt(ends[0], SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  w.pid = pid;
  w.socket = ends[0];
  return w;
}

void retire(Worker& w) {
  close(w.socket);
  kill(w.pid, SIGKILL);
  waitpid(w.pid, nullptr, 0);
}

}  // namespace

std::optional<nvrtc_worker::Response> compile_in_worker(const nvrtc_worker::Request& request) {
  Pool& p = pool();
  Worker w;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.owner != getpid()) p.stats.unavailable = "a forked process does not share its parent's workers";
    if (!p.stats.unavailable.empty()) {
      ++p.stats.failed;
      return std::nullopt;
    }
    if (!p.idle.empty()) {
      w = p.idle.back();
      p.idle.pop_back();
    } else if (p.live >= std::min<size_t>(kMaxWorkers, std::max(1u, std::thread::hardware_concurrency()))) {
      ++p.stats.failed;  // every worker busy: this request runs in the caller's process
      return std::nullopt;
    } else {
      if (p.stats.executable.empty()) p.stats.executable = worker_path();
      std::string why;
      if (p.stats.executable.empty() || access(p.stats.executable.c_str(), X_OK) != 0)
        why = "no executable " + (p.stats.executable.empty() ? std::string(kWorkerName) : p.stats.executable);
      else
        w = start_worker(p.stats.executable, why);
      if (w.pid < 0) {
        p.stats.unavailable = why;
        ++p.stats.failed;
        KILN_LOG(perf) << "NVRTC workers not used (programs compile in this process): " << why;
        return std::nullopt;
      }
      ++p.live;
      ++p.stats.started;
    }
  }
  nvrtc_worker::Response response;
  const bool answered = nvrtc_worker::send_request(w.socket, request) && nvrtc_worker::receive_response(w.socket, response);
  std::lock_guard<std::mutex> lock(p.mutex);
  if (!answered) {
    retire(w);
    --p.live;
    ++p.stats.failed;
    KILN_LOG(perf) << "NVRTC worker " << w.pid << " did not answer for '" << request.program_name
                   << "'; compiling it in this process";
    return std::nullopt;
  }
  ++p.stats.answered;
  p.idle.push_back(w);
  return response;
}

NvrtcWorkerStats nvrtc_worker_stats() {
  std::lock_guard<std::mutex> lock(pool().mutex);
  NvrtcWorkerStats stats = pool().stats;
  for (const Worker& w : pool().idle) stats.idle_pids.push_back(w.pid);
  return stats;
}

}  // namespace kiln::codegen::cuda
