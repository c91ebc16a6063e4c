#pragma once
// The messages between kiln and its NVRTC worker processes (nvrtc_workers.h, csrc/tools/nvrtc_worker.cpp), over
// one AF_UNIX stream socket per worker. Header-only and dependency-free: the worker is a small executable that
// links nothing of kiln. Both ends run on one machine from one build, so integers travel in native byte order.
//
//   request:  string nvrtc_path, string program_name, string source, u32 n_flags {string flag},
//             u32 n_headers {string name, string content}, u8 cubin
//   response: i32 nvrtc_result (0 success, -1 the worker could not run NVRTC), string error, string log,
//             string image, f64 compile_ms
// A string is a u64 byte count, then the bytes.
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kiln::nvrtc_worker {

struct Request {
  std::string nvrtc_path;
  std::string program_name;
  std::string source;
  std::vector<std::string> flags;
  std::vector<std::pair<std::string, std::string>> headers;  // (name, content)
  bool cubin = false;
};

struct Response {
  int32_t nvrtc_result = -1;
  std::string error;
  std::string log;
  std::string image;
  double compile_ms = 0;
};

class Writer {
 public:
  void bytes(const void* data, size_t n) { buffer_.append(static_cast<const char*>(data), n); }
  template <typename T>
  void scalar(T value) { bytes(&value, sizeof(T)); }
  void string(const std::string& s) {
    scalar<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  // The whole message, or false when the other end is gone (MSG_NOSIGNAL: no SIGPIPE).
  bool send_to(int fd) const {
    size_t sent = 0;
    while (sent < buffer_.size()) {
      ssize_t n = ::send(fd, buffer_.data() + sent, buffer_.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

 private:
  std::string buffer_;
};

class Reader {
 public:
  explicit Reader(int fd) : fd_(fd) {}
  bool bytes(void* data, size_t n) {
    char* out = static_cast<char*>(data);
    while (n > 0) {
      ssize_t got = ::recv(fd_, out, n, 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;
      out += got;
      n -= static_cast<size_t>(got);
    }
    return true;
  }
  template <typename T>
  bool scalar(T& value) { return bytes(&value, sizeof(T)); }
  bool string(std::string& s) {
    uint64_t size = 0;
    if (!scalar(size) || size > (uint64_t{1} << 32)) return false;
    s.resize(size);
    return size == 0 || bytes(s.data(), size);
  }

 private:
  int fd_;
};

inline bool send_request(int fd, const Request& r) {
  Writer w;
  w.string(r.nvrtc_path);
  w.string(r.program_name);
  w.string(r.source);
  w.scalar<uint32_t>(static_cast<uint32_t>(r.flags.size()));
  for (const auto& flag : r.flags) w.string(flag);
  w.scalar<uint32_t>(static_cast<uint32_t>(r.headers.size()));
  for (const auto& [name, content] : r.headers) {
    w.string(name);
    w.string(content);
  }
  w.scalar<uint8_t>(r.cubin ? 1 : 0);
  return w.send_to(fd);
}

inline bool receive_request(int fd, Request& r) {
  Reader in(fd);
  uint32_t count = 0;
  uint8_t cubin = 0;
  if (!in.string(r.nvrtc_path) || !in.string(r.program_name) || !in.string(r.source) || !in.scalar(count))
    return false;
  r.flags.resize(count);
  for (auto& flag : r.flags)
    if (!in.string(flag)) return false;
  if (!in.scalar(count)) return false;
  r.headers.resize(count);
  for (auto& [name, content] : r.headers)
    if (!in.string(name) || !in.string(content)) return false;
  if (!in.scalar(cubin)) return false;
  r.cubin = cubin != 0;
  return true;
}

inline bool send_response(int fd, const Response& r) {
  Writer w;
  w.scalar<int32_t>(r.nvrtc_result);
  w.string(r.error);
  w.string(r.log);
  w.string(r.image);
  w.scalar<double>(r.compile_ms);
  return w.send_to(fd);
}

inline bool receive_response(int fd, Response& r) {
  Reader in(fd);
  return in.scalar(r.nvrtc_result) && in.string(r.error) && in.string(r.log) && in.string(r.image) &&
         in.scalar(r.compile_ms);
}

}  // namespace kiln::nvrtc_worker
