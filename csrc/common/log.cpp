#include "common/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>

#include "common/error.h"
#include "common/progress.h"

namespace kiln::log {
namespace {

constexpr const char* kNames[] = {
#define KILN_LOG_NAME(name) #name,
    KILN_LOG_CATEGORIES(KILN_LOG_NAME)
#undef KILN_LOG_NAME
};
constexpr unsigned kCount = static_cast<unsigned>(Category::count);

std::atomic<unsigned> g_bits{0};
std::once_flag g_once;

void init_from_env() {
  std::call_once(g_once, [] {
    if (const char* spec = std::getenv("KILN_LOGS")) {
      try {
        configure(spec);
      } catch (const Error& e) {
        std::fprintf(stderr, "[kiln] ignoring KILN_LOGS: %s\n", e.what());
      }
    }
  });
}

}  // namespace

bool enabled(Category c) {
  init_from_env();
  return (g_bits.load(std::memory_order_relaxed) >> static_cast<unsigned>(c)) & 1u;
}

void set_enabled(Category c, bool on) {
  init_from_env();
  unsigned bit = 1u << static_cast<unsigned>(c);
  if (on)
    g_bits.fetch_or(bit);
  else
    g_bits.fetch_and(~bit);
}

const char* name(Category c) { return kNames[static_cast<unsigned>(c)]; }

void configure(const std::string& spec) {
  unsigned bits = 0;
  size_t start = 0;
  while (start <= spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(start, end - start);
    while (!item.empty() && (item.front() == ' ' || item.front() == '+')) item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item == "all") {
      bits = (1u << kCount) - 1;
    } else if (!item.empty()) {
      unsigned i = 0;
      while (i < kCount && item != kNames[i]) ++i;
      std::string known;
      for (unsigned k = 0; k < kCount; ++k) known += std::string(k ? ", " : "") + kNames[k];
      KILN_CHECK(i < kCount) << "unknown log category '" << item << "' in KILN_LOGS; known: all, " << known;
      bits |= 1u << i;
    }
    start = end + 1;
  }
  g_bits.store(bits);
}

void emit(Category c, const std::string& text) {
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  progress::clear_line();  // a record written over a terminal's progress line would be garbled
  std::fprintf(stderr, "[kiln:%s] %s\n", name(c), text.c_str());
  std::fflush(stderr);
}

void warn_once(const std::string& text) {
  static std::mutex m;
  static std::set<std::string> given;
  std::lock_guard<std::mutex> lock(m);
  if (!given.insert(text).second) return;
  progress::clear_line();
  std::fprintf(stderr, "[kiln] warning: %s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace kiln::log
