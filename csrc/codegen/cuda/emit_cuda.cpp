// CUDA C code generation from the loop IR.
//
// Design: each kernel's domain is turned into loops (fusion/loop_nest.h); a scheduler per kernel kind decides how
// they map onto threads (pointwise, thread_per_row, column, warp_per_row, block_per_row: kernel_schedule.h and the
// schedule_*.cpp files, whose comments say why), and KernelEmitter renders that schedule. Pointwise kernels run a
// grid-stride loop over the flat outer index, split back into loop indices with constant divisors.
// In the reduction kinds the body mirrors the C++ generator: per row, each walk of reductions in its own pass over
// the reduced loops (recomputing the pointwise prologue it needs), then the per-row values and stores (lane 0),
// then one more pass for stores that run along the reduced loops (softmax's output, layer norm's y). Rows are
// re-read from L1/L2 in each pass unless the schedule caches them in registers.
// This file joins the kernels into NVRTC programs: twins emitted once, parts compiled side by side, the launch
// group of pointwise kernels that read only graph inputs, and for max-autotune each kernel's tuning variants beside it.
#include "codegen/cuda/emit_cuda.h"

#include <algorithm>
#include <sstream>
#include <unordered_map>

#include "codegen/cuda/kernel_emitter.h"
#include "codegen/prim_text.h"
#include "common/error.h"
#include "common/sha256.h"

namespace kiln::codegen::cuda {

namespace {

// The launch group's kernel: block ranges, one per member in order, each running its member's code with the
// block index and count it would have had alone. All members are pointwise (kPointwiseBlock threads).
void emit_group(const fusion::Schedule& schedule, const std::vector<int32_t>& group, CudaSource& result,
                std::ostringstream& out) {
  CudaKernelLaunch& launch = result.group;
  launch.name = "kernel_group_inputs";
  launch.strategy = "group";
  launch.block_x = kPointwiseBlock;
  std::string params, body;
  size_t first = 0;
  int64_t blocks = 0;
  for (int32_t i : group) {
    const Kernel& k = schedule.kernels[i];
    params += (params.empty() ? "" : ", ") + parameters(k, "a", first);
    const unsigned grid = result.kernels[i].grid;
    if (grid > 0) {
      body += "  if (block < " + std::to_string(grid) + "u) {\n    " + result.kernels[i].name + "(";
      for (size_t b = 0; b < k.buffers.size(); ++b) body += "a" + std::to_string(first + b) + ", ";
      body += "block, " + std::to_string(grid) + "u);\n    return;\n  }\n  block -= " + std::to_string(grid) + "u;\n";
    }
    blocks += grid;
    first += k.buffers.size();
  }
  launch.grid = static_cast<unsigned>(blocks);
  result.group_members = group;
  out << "\n// launch group: " << group.size() << " pointwise kernels that read only graph inputs, run first\n"
      << "extern \"C\" __global__ void __launch_bounds__(" << kPointwiseBlock << ") " << launch.name << "(" << params
      << ") {\n  unsigned block = blockIdx.x;\n" << body << "}\n";
}

// A kernel's code from its signature on (not its comments, which name graph nodes), with its own name `name` as
// `kernel`: equal for kernels that differ only in their names (twins), and what tuning keys hash.
std::string code_from_signature(const std::string& text, const std::string& name, bool device_function) {
  const size_t signature = text.find(device_function ? "\n__device__" : "\nextern \"C\"");
  return substitute(text.substr(signature), name + "(", "kernel(");
}

// max-autotune: the kernel's tuning candidates after its chosen schedule (kernel_schedule.h tuning_candidates),
// each emitted as its own kernel `<name>_t<i>`, appended to `text` (their code goes where the default's goes) and to
// launch.variants; launch.tune_key hashes `body` (the default's code_from_signature), the variants' code and every
// launch. Returns the variants' code_from_signature, which a twin must share.
std::string emit_variants(const KernelAnalysis& analysis, const CudaKernelSchedule& chosen, const graph::Graph& g,
                          bool size_arguments, const std::string& body, CudaKernelLaunch& launch, std::string& text) {
  const std::vector<CudaKernelSchedule> candidates = tuning_candidates(analysis, chosen);
  if (candidates.size() < 2) return "";
  auto launch_text = [](const CudaKernelLaunch& l) {
    std::string t = "\n// launch " + std::to_string(l.grid) + " " + std::to_string(l.block_x) + " " + std::to_string(l.block_y);
    for (int64_t v : l.sizes) t += " " + std::to_string(v);
    return t + "\n";
  };
  std::string bodies, hashed = body + launch_text(launch);
  for (size_t c = 1; c < candidates.size(); ++c) {
    // A copy of the kernel under the variant's name: the emitter names the function and its covers comment after it.
    fusion::Kernel renamed = analysis.kernel;
    renamed.name = analysis.kernel.name + "_t" + std::to_string(c);
    const KernelAnalysis variant_analysis(renamed);
    CudaKernelLaunch& variant = launch.variants.emplace_back();
    const std::string variant_text = KernelEmitter(variant_analysis, candidates[c], g, false, size_arguments).emit(variant);
    text += "\n" + variant_text;
    const std::string variant_body = code_from_signature(variant_text, renamed.name, false);
    bodies += variant_body;
    hashed += variant_body + launch_text(variant);
  }
  // Without libcrypto (common/sha256.h) no key: the variants are still timed, the result is not remembered.
  launch.tune_key = sha256_hex(hashed).value_or("");
  return bodies;
}

}  // namespace

CudaSource emit_cuda_source(const fusion::Schedule& schedule, const graph::Graph& g, const std::vector<int32_t>& group,
                            bool size_arguments, bool tune) {
  KILN_ASSERT(group.empty() || !size_arguments) << "a launch group with size arguments";
  CudaSource result;
  result.kernels.resize(schedule.kernels.size());
  std::vector<bool> grouped(schedule.kernels.size(), false);
  for (int32_t i : group) grouped[i] = true;
  // Kernels whose code is the same but for their name (each block of a layer stack makes the same ones) are
  // emitted once and launched under that one name: NVRTC's time grows with the source, and a 6-block
  // transformer has 55 kernels but 9 distinct ones. With tuning variants, the same means the same variants too.
  std::unordered_map<std::string, size_t> first_of_body;
  std::vector<std::string> texts(schedule.kernels.size());
  std::vector<int> twin_of(schedule.kernels.size(), -1);
  int distinct_launchable = 0;
  for (size_t i = 0; i < schedule.kernels.size(); ++i) {
    CudaKernelLaunch& launch = result.kernels[i];
    const KernelAnalysis analysis(schedule.kernels[i]);
    const CudaKernelSchedule chosen = schedule_cuda_kernel(analysis);
    texts[i] = KernelEmitter(analysis, chosen, g, grouped[i], size_arguments).emit(launch);
    std::string body = code_from_signature(texts[i], launch.name, grouped[i]);
    if (tune && !grouped[i]) body += emit_variants(analysis, chosen, g, size_arguments, body, launch, texts[i]);
    auto [it, fresh] = first_of_body.emplace(body, i);
    if (!fresh) {
      twin_of[i] = static_cast<int>(it->second);
      const CudaKernelLaunch& original = result.kernels[it->second];
      launch.name = original.name;
      for (size_t v = 0; v < launch.variants.size(); ++v) launch.variants[v].name = original.variants[v].name;
    } else if (!grouped[i]) {
      ++distinct_launchable;
    }
  }
  // Parts: one NVRTC program each, compiled side by side (runtime/kernel_graph.cpp). A distinct kernel a part up to
  // kMaxParts, round robin past that: the assignment follows the kernels' order only, so a binding of a dynamic
  // graph (codegen/size_arguments.h) that decides one kernel differently changes one part, and the others are found
  // in the program cache (balancing by source length moved kernels between parts at every such change). The launch
  // group (its members' device functions and its kernel) stays in part 0; a twin is launched from its original's part.
  const int parts = std::clamp(distinct_launchable, 1, kMaxParts);
  std::vector<std::ostringstream> part_text(parts);
  for (int p = 0; p < parts; ++p) {
    part_text[p] << "// generated by kiln: " << schedule.summary() << (parts > 1 ? ", part " + std::to_string(p + 1) + " of " + std::to_string(parts) : "") << "\n";
    part_text[p] << "#include \"kiln_scalar.cuh\"\n#include \"kiln_reduce.cuh\"\n";
    // Size arguments (codegen/size_arguments.h): a kernel's slots, passed by value after its buffers.
    if (size_arguments) part_text[p] << "template <int N> struct kiln_sizes { long long v[N]; };\n";
  }
  int next = 0;
  for (size_t i = 0; i < schedule.kernels.size(); ++i) {
    CudaKernelLaunch& launch = result.kernels[i];
    if (twin_of[i] >= 0) {
      launch.part = result.kernels[twin_of[i]].part;
      part_text[launch.part] << "\n" << covers_comment(schedule.kernels[i], g) << "// launched as " << launch.name
                             << " (the same code)\n";
      continue;
    }
    launch.part = grouped[i] ? 0 : next++ % parts;
    part_text[launch.part] << "\n" << texts[i];
  }
  for (CudaKernelLaunch& launch : result.kernels)  // a twin's variants are its original's functions, in its part
    for (CudaKernelLaunch& variant : launch.variants) variant.part = launch.part;
  if (!group.empty()) emit_group(schedule, group, result, part_text[0]);
  for (auto& text : part_text) result.parts.push_back(text.str());
  for (const std::string& text : result.parts) result.source += text;
  return result;
}

}  // namespace kiln::codegen::cuda
