#pragma once
// Logging by category, switched on by KILN_LOGS=graph,guards,recompiles,... (see options.h).
// `KILN_LOG(graph) << text;` costs one branch on a cached bit when the category is off.
#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>

namespace kiln::log {

// One bit per category; the names are the ones users write in KILN_LOGS.
#define KILN_LOG_CATEGORIES(_) \
  _(graph_breaks)              \
  _(recompiles)                \
  _(guards)                    \
  _(graph)                     \
  _(output_code)               \
  _(passes)                    \
  _(perf)                      \
  _(bytecode)                  \
  _(trace)                     \
  _(fallbacks)                 \
  _(progress)                  \
  _(cudagraphs)                \
  _(dynamic)                   \
  _(autotune)

enum class Category : unsigned {
#define KILN_LOG_ENUM(name) name,
  KILN_LOG_CATEGORIES(KILN_LOG_ENUM)
#undef KILN_LOG_ENUM
      count
};

/// The categories named in KILN_LOGS (read once; `set_enabled` overrides for tests and kiln.config).
bool enabled(Category c);
void set_enabled(Category c, bool on);
/// Parses a KILN_LOGS-style list ("graph,guards", "all", "+graph"); unknown names raise a user error.
void configure(const std::string& spec);
const char* name(Category c);
/// Writes one record to stderr, prefixed with "[kiln:<category>] ".
void emit(Category c, const std::string& text);
/// Writes "[kiln] warning: <text>" to stderr the first time this process is given `text`, whatever KILN_LOGS says:
/// for what users must hear about without asking for logs (a cache directory kiln will not trust). Thread-safe, so
/// it needs no GIL (a Python warning would: these come from compiler threads too).
void warn_once(const std::string& text);

/// Milliseconds since construction, for `perf` records.
class Stopwatch {
 public:
  double ms() const { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

/// `ms` rounded to whole milliseconds, as `perf` records print them.
inline int64_t whole_ms(double ms) { return static_cast<int64_t>(ms + 0.5); }

class Line {
 public:
  explicit Line(Category c) : category_(c) {}
  ~Line() { emit(category_, stream_.str()); }
  template <typename T>
  Line& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  Category category_;
  std::ostringstream stream_;
};

}  // namespace kiln::log

// A for-statement rather than if/else, so `if (c) KILN_LOG(x) << ...;` has no dangling else.
#define KILN_LOG(category)                                                                       \
  for (bool kiln_log_on_ = ::kiln::log::enabled(::kiln::log::Category::category); kiln_log_on_; \
       kiln_log_on_ = false)                                                                     \
  ::kiln::log::Line(::kiln::log::Category::category)
