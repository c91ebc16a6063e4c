#pragma once
// A one-line progress display for slow compiles: which graph, which stage, how long so far.
//
// Design: the frame compiler opens a `progress::Compile` per compiled frame (only when `progress::wanted()`), and
// the stages below it call `progress::stage("fusion")` at their boundaries. Nothing is written until the compile has
// run `after_s` seconds (kiln.config.progress_after_s), so fast compiles never flicker. On a terminal the line is
// rewritten in place with \r and cleared when the compile ends; with KILN_LOGS=progress each stage after the
// threshold is a plain `[kiln:progress]` line instead. No thread: a stage that runs long (the system C++ compiler)
// shows the line written at its start. State is per thread (the compiler is thread-local); stage() on a thread
// with no open Compile, or while the display is off, returns after one thread-local read.
#include <string>

namespace kiln::progress {

/// Whether a compile opened now would display anything: stderr is a terminal, or KILN_LOGS has `progress`.
bool wanted();

/// One compile, shown as "[kiln] compiling graph <n>, <name>: <stage> <seconds> s" once `after_s` seconds have passed.
/// A Compile opened while another is open on this thread is inert (the outer one keeps the line).
class Compile {
 public:
  Compile(std::string name, double after_s);
  ~Compile();
  Compile(const Compile&) = delete;
  Compile& operator=(const Compile&) = delete;

 private:
  bool owner_ = false;
};

/// A named part of the open compile ("forward half"), shown after its name while the part lasts. Inert with no
/// open compile.
class Part {
 public:
  explicit Part(const char* name);
  ~Part();
  Part(const Part&) = delete;
  Part& operator=(const Part&) = delete;

 private:
  bool active_ = false;
};

/// The open compile enters `stage` ("trace", "passes", "autodiff", "fusion", "codegen", "compiling C++ (g++)",
/// "load"); the line is shown or updated if the threshold has passed.
void stage(const char* stage);
void stage(const std::string& stage);

/// The same stage, a moment later: refreshes the elapsed seconds on a terminal (at most ten times a second).
void tick();

/// Clears a terminal's progress line before other text goes to stderr (log records, warnings); the next stage or
/// tick writes it again.
void clear_line();

}  // namespace kiln::progress
