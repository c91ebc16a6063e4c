// The progress display (progress.h): per-thread state of the open compile, one terminal line shared by all threads.
#include "common/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include "common/log.h"

namespace kiln::progress {

namespace {

using Clock = std::chrono::steady_clock;

struct State {
  bool lines = false;  // plain [kiln:progress] lines (KILN_LOGS=progress) rather than a terminal line
  double after_s = 1;
  Clock::time_point started;
  Clock::time_point last_drawn;
  std::string name;                // "graph 3, Block.forward (model.py:12)"
  std::vector<const char*> parts;  // "forward half"
  std::string stage;
  std::string last_line;  // the last plain line's name and stage
  bool shown = false;  // something was written for this compile
};

// The fast path's flag: a trivially constructed thread_local, so reading it costs no initialisation check.
thread_local bool t_open = false;
thread_local State t_state;

std::mutex g_terminal;                 // guards the terminal line and g_line_owner
const State* g_line_owner = nullptr;   // whose line the terminal shows now (one thread's at a time)
std::atomic<int> g_compiles{0};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string label(const State& s) {
  std::string text = s.name;
  for (const char* part : s.parts) text += std::string(", ") + part;
  return text;
}

std::string one_decimal(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

size_t terminal_width() {
  winsize size{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 20) return size.ws_col;
  return 80;
}

// Shows the line when the threshold has passed: a new plain line per stage, or the terminal line rewritten (at most
// ten times a second when only the seconds changed). A line wider than the terminal would wrap, and \r could no
// longer take it back, so the name is shortened to fit.
void draw(State& s, bool new_stage) {
  const double elapsed = seconds_since(s.started);
  if (elapsed < s.after_s) return;
  if (s.lines) {
    // A stage entered again (the pipeline's passes, then the lowering's) is one line.
    std::string where = label(s) + ": " + s.stage;
    if (!new_stage || where == s.last_line) return;
    s.shown = true;
    log::emit(log::Category::progress, where + ", " + one_decimal(elapsed) + " s");
    s.last_line = std::move(where);
    return;
  }
  const Clock::time_point now = Clock::now();
  if (!new_stage && s.shown && now - s.last_drawn < std::chrono::milliseconds(100)) return;
  std::lock_guard<std::mutex> lock(g_terminal);
  if (g_line_owner && g_line_owner != &s) return;
  const std::string tail = ": " + s.stage + "... " + one_decimal(elapsed) + " s";
  std::string head = "[kiln] compiling " + label(s);
  const size_t width = terminal_width() - 1;
  if (head.size() + tail.size() > width) {  // the middle goes: the graph's number and the part stay in view
    const size_t room = width > tail.size() + 3 ? width - tail.size() - 3 : 0;
    head = head.substr(0, room / 2) + "..." + head.substr(head.size() - (room - room / 2));
  }
  std::fprintf(stderr, "\r%s%s\033[K", head.c_str(), tail.c_str());
  std::fflush(stderr);
  g_line_owner = &s;
  s.shown = true;
  s.last_drawn = now;
}

// Takes the terminal's progress line back: any thread's (`of` null), or only the line of `of`.
void erase_line(const State* of) {
  std::lock_guard<std::mutex> lock(g_terminal);
  if (!g_line_owner || (of && g_line_owner != of)) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  g_line_owner = nullptr;
}

}  // namespace

bool wanted() { return log::enabled(log::Category::progress) || ::isatty(STDERR_FILENO); }

Compile::Compile(std::string name, double after_s) {
  if (t_open || !wanted()) return;
  State& s = t_state;
  s = State{};
  s.lines = log::enabled(log::Category::progress);  // also on a terminal: the user asked for log lines
  s.after_s = after_s;
  s.started = Clock::now();
  s.name = "graph " + std::to_string(++g_compiles) + ", " + std::move(name);
  t_open = owner_ = true;
}

Compile::~Compile() {
  if (!owner_) return;
  t_open = false;
  State& s = t_state;
  if (!s.shown) return;
  if (s.lines) {
    log::emit(log::Category::progress, s.name + ": done in " + one_decimal(seconds_since(s.started)) + " s");
    return;
  }
  erase_line(&s);
}

Part::Part(const char* name) {
  if (!t_open) return;
  t_state.parts.push_back(name);
  active_ = true;
}

Part::~Part() {
  if (active_) t_state.parts.pop_back();
}

void stage(const char* name) {
  if (!t_open) return;
  t_state.stage = name;
  draw(t_state, /*new_stage=*/true);
}

void stage(const std::string& name) { stage(name.c_str()); }

void tick() {
  if (!t_open || t_state.lines) return;
  draw(t_state, /*new_stage=*/false);
}

void clear_line() { erase_line(nullptr); }

}  // namespace kiln::progress
