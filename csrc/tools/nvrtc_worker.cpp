// kiln-nvrtc-worker: compiles CUDA programs with NVRTC for a kiln process (codegen/cuda/nvrtc_workers.h).
//
// Why a process: on some machines NVRTC compiles one program at a time within a process, whatever the number of
// threads (an H100 host: 16 threads finished 25-30 ms apart), while separate processes overlap. A graph's CUDA
// source split into parts then compiles in parallel only across processes.
//
// Reads requests from fd 0 and answers on fd 1 (both the socket kiln passes), one at a time, until the socket
// closes. Opens the libnvrtc file kiln itself loaded, named in each request. Links nothing of kiln or torch.
#include <dlfcn.h>

#include <string>

#include "codegen/cuda/nvrtc_api.h"

namespace {

struct Opened {
  kiln::nvrtc::Api api;
  std::string path;  // "" until the first request opens it
};

// Opens `path` once (a later request naming another file is refused: one worker, one NVRTC); "" or the reason.
std::string open_nvrtc(Opened& opened, const std::string& path) {
  if (!opened.path.empty()) return opened.path == path ? "" : "this worker already opened " + opened.path;
  kiln::nvrtc::preload_builtins_beside(path);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) return std::string("dlopen failed: ") + dlerror();
  std::string missing = kiln::nvrtc::resolve_api(handle, opened.api);
  if (!missing.empty()) return path + " lacks " + missing;
  opened.path = path;
  return "";
}

}  // namespace

int main() {
  Opened opened;
  kiln::nvrtc_worker::Request request;
  while (kiln::nvrtc_worker::receive_request(0, request)) {
    kiln::nvrtc_worker::Response response;
    response.error = open_nvrtc(opened, request.nvrtc_path);
    if (response.error.empty()) response = kiln::nvrtc::compile_with(opened.api, request);  // else result -1
    if (!kiln::nvrtc_worker::send_response(1, response)) return 1;
  }
  return 0;
}
