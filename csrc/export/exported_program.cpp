// kiln::ExportedProgram (include/kiln/export.h): the C++ reader of ExportedProgram.save's files
// (python/kiln/export.py holds the format). load() reads the zip (common/stored_zip.h), checks every entry against
// the manifest's SHA-256, rebuilds the graph from graph.json (graph::graph_from_json), the state and constants from
// weights.safetensors, and the calling convention from program.json; then picks how to run:
//
//   compiled  the file's graph record (kernels/graphs/) decoded as the graph cache decodes it, its device code (the C++
//             library, kernels/cpp/, or the CUDA images, kernels/cuda/) published into kiln's disk cache, and
//             runtime::make_kiln_graph loading it from there through the device backend the record names, on the
//             graph's device, as kiln.compile's warm start does. The record was made from the saved graph after the
//             pipeline's first steps (in-place ops made functional, constants folded, attention masks that mask
//             nothing dropped: the folded values are not in the file), so those steps run here too, through the same
//             functions, to get the graph and constants it was keyed by;
//   eager     runtime::make_eager_interpreter over the saved graph (ATen op by op), for everything else.
//
// A dynamic program (graph.json with a symbolic table) runs as a runtime::DynamicGraph, as kiln.compile runs a graph
// with size symbols: each call's symbols are read from the inputs and checked (ranges, the relations the graph needs);
// the binding the file was compiled at runs the file's compiled code (chosen as above, on the graph specialised to the
// export's sizes), and every other binding runs its specialised graph on the eager interpreter (logged under
// KILN_LOGS=dynamic): lowering a new binding needs the pipeline.
//
// Why not run the pipeline here: compile/ asks Python for meta rules (compile/meta_oracle.cpp), and this loader
// links no Python.
#include "kiln/export.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cache/graph_cache.h"
#include "cache/kernel_cache.h"
#include "codegen/device_backend.h"
#include "common/error.h"
#include "common/log.h"
#include "common/sha256.h"
#include "common/stored_zip.h"
#include "export/dtype_names.h"
#include "export/safetensors.h"
#include "graph/graph.h"
#include "graph/graph_device.h"
#include "graph/specialise_sizes.h"
#include "graph/symbolic_sizes.h"
#include "passes/fold_constants.h"
#include "passes/functionalize.h"
#include "runtime/compiled_graph.h"
#include "runtime/drop_attention_masks.h"
#include "runtime/dynamic_graph.h"
#include "runtime/eager_interpreter.h"
#include "runtime/evaluate_folding.h"
#include "runtime/kernel_graph.h"
#include "runtime/torch_info.h"

namespace kiln {

namespace {

using json = nlohmann::json;

constexpr const char* kFormatName = "kiln.export";
constexpr int kFormatVersion = 2;  // 2: input tensors carry "dynamic" dims, graph.json a symbolic table
constexpr int kOldestFormatVersion = 1;
const char* const kEntries[] = {"graph.json", "program.json", "weights.safetensors"};

c10::ScalarType dtype_named(const std::string& name) {
  const exporting::DtypeNames* found = exporting::dtype_named(&exporting::DtypeNames::torch, name);
  KILN_CHECK(found) << "program.json names the dtype " << name << ", which this loader does not know";
  return found->type;
}

std::string dtype_name(c10::ScalarType type) {
  const exporting::DtypeNames* found = exporting::dtype_names_of(type);
  return found ? std::string(found->torch) : std::string(c10::toString(type));
}

std::string shape_text(c10::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

std::string range_text(const DynamicDim& d) {
  return "[" + std::to_string(d.min) + ", " + (d.max < 0 ? std::string("inf") : std::to_string(d.max)) + "]";
}

// Why `sizes` do not fit `spec` ("" when they do): a static size that differs, a dynamic dim outside its range, a dim
// whose Dim `named` saw at another size in this call (name -> (where, size)). python/kiln/export_shapes.py's
// check_sizes says the same for Python calls.
std::string size_problem(const std::string& where, c10::IntArrayRef sizes, const TensorSpec& spec,
                         std::map<std::string, std::pair<std::string, int64_t>>& named) {
  if (spec.dynamic.empty()) {
    if (sizes == c10::IntArrayRef(spec.sizes)) return "";
    return where + ": expected shape " + shape_text(spec.sizes) + ", got " + shape_text(sizes) +
           ": kiln.export specialises sizes unless dynamic_shapes declares the dim dynamic";
  }
  if (sizes.size() != spec.sizes.size())
    return where + ": expected a " + std::to_string(spec.sizes.size()) + "-d tensor, got shape " + shape_text(sizes);
  for (size_t d = 0; d < sizes.size(); ++d) {
    auto dynamic = std::find_if(spec.dynamic.begin(), spec.dynamic.end(),
                                [&](const DynamicDim& x) { return x.dim == static_cast<int64_t>(d); });
    if (dynamic == spec.dynamic.end()) {
      if (sizes[d] == spec.sizes[d]) continue;
      return where + ": expected size " + std::to_string(spec.sizes[d]) + " in dim " + std::to_string(d) + ", got "
             + shape_text(sizes) + ": dim " + std::to_string(d) +
             " was exported static: declare it in dynamic_shapes to vary it";
    }
    const std::string label =
        where + " dim " + std::to_string(d) + (dynamic->name.empty() ? "" : " (Dim '" + dynamic->name + "')");
    if (sizes[d] < dynamic->min || (dynamic->max >= 0 && sizes[d] > dynamic->max))
      return label + " is " + std::to_string(sizes[d]) + ", outside its range " + range_text(*dynamic) +
             (sizes[d] < 2 ? " (sizes 0 and 1 are specialised)" : "");
    if (dynamic->name.empty()) continue;
    const auto& [first_label, first_size] = named.try_emplace(dynamic->name, label, sizes[d]).first->second;
    if (first_size != sizes[d])
      return first_label + " is " + std::to_string(first_size) + " and " + label + " is " + std::to_string(sizes[d]) +
             ": dims that share Dim '" + dynamic->name + "' must be equal";
  }
  return "";
}

// The strides the graph takes for an input of `sizes`: the example's, or at other sizes of dynamic dims the
// example's dim order laid out densely (python/kiln/export_shapes.py's dense_strides).
std::vector<int64_t> expected_strides(c10::IntArrayRef sizes, const TensorSpec& spec) {
  if (sizes == c10::IntArrayRef(spec.sizes)) return spec.strides;
  std::vector<size_t> order(sizes.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spec.strides[a] > spec.strides[b]; });
  std::vector<int64_t> strides(sizes.size());
  int64_t step = 1;
  for (auto d = order.rbegin(); d != order.rend(); ++d) {
    strides[*d] = step;
    step *= std::max<int64_t>(sizes[*d], 1);
  }
  return strides;
}

// A graph input: argument leaf `index`, or the state tensor `state`.
struct GraphInput {
  int64_t index = -1;
  at::Tensor state;
};

// A result leaf: graph output `index`, or argument leaf `index` returned as it is.
struct OutputLeaf {
  bool from_graph = true;
  int64_t index = 0;
};

// Walks an argument tree of program.json: the path of each tensor leaf by its index ("inputs[0][1]['mask']").
void argument_paths(const json& spec, const std::string& path, std::vector<std::string>& paths) {
  const std::string& kind = spec.at("kind").get_ref<const std::string&>();
  if (kind == "tensor") {
    const auto index = spec.at("index").get<size_t>();
    if (paths.size() <= index) paths.resize(index + 1);
    paths[index] = path;
  } else if (kind == "tuple" || kind == "list") {
    const json& items = spec.at("items");
    for (size_t i = 0; i < items.size(); ++i) argument_paths(items[i], path + "[" + std::to_string(i) + "]", paths);
  } else if (kind == "dict") {
    const json& items = spec.at("items");
    const json& keys = spec.at("keys");
    for (size_t i = 0; i < items.size(); ++i)
      argument_paths(items[i], path + "[" + (keys.at(i).is_string() ? "'" + keys[i].get<std::string>() + "'"
                                                                     : keys[i].dump()) + "]", paths);
  }
}

// The result tree's tensor leaves, depth first.
void output_leaves(const json& spec, std::vector<OutputLeaf>& leaves) {
  const std::string& kind = spec.at("kind").get_ref<const std::string&>();
  if (kind == "graph_output" || kind == "input") {
    leaves.push_back({kind == "graph_output", spec.at("index").get<int64_t>()});
  } else if (kind == "tuple" || kind == "list" || kind == "dict") {
    for (const json& item : spec.at("items")) output_leaves(item, leaves);
  }
}

// A bundled disk-cache entry: kernels/<kind>/<key><suffix> (python/kiln/export.py's _KERNEL_ENTRY).
const std::regex& kernel_entry_pattern() {
  static const std::regex pattern("kernels/(graphs|cpp|cuda)/([0-9a-f]{64})(\\.[a-z]{1,8})");
  return pattern;
}

json parse_entry(std::string_view text, const std::string& what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    KILN_CHECK(false) << what << " does not parse as JSON (" << e.what() << "): the file is corrupted";
  }
  return {};
}

}  // namespace

struct ExportedProgram::State {
  std::string path;
  std::vector<TensorSpec> specs;
  std::vector<std::string> paths;  // per argument leaf, for messages
  std::vector<GraphInput> graph_inputs;
  std::vector<OutputLeaf> outputs;
  std::shared_ptr<runtime::CompiledGraph> compiled;
  std::string backend = "eager";
  std::string fallback_reason;
  std::map<std::string, std::string> manifest;
};

namespace {

// Entries by name, each checked against the manifest's size and SHA-256 (and the zip's CRC-32 as it is read).
std::map<std::string, std::string_view> checked_entries(const StoredZip& zip, const json& manifest,
                                                        const std::string& path) {
  std::vector<std::string> names(std::begin(kEntries), std::end(kEntries));
  const json& kernels = manifest.value("kernels", json::array());
  KILN_CHECK(kernels.is_array()) << path << " lists malformed kernel entries in its manifest";
  for (const json& k : kernels) {
    KILN_CHECK(k.is_string() && std::regex_match(k.get<std::string>(), kernel_entry_pattern()))
        << path << " lists malformed kernel entries in its manifest";
    names.push_back(k.get<std::string>());
  }
  const json& listed = manifest.value("entries", json::object());
  const bool hashes = sha256_unavailable().empty();
  if (!hashes) KILN_LOG(fallbacks) << "kiln export: " << path << ": no SHA-256 (" << sha256_unavailable()
                                   << "); entries are checked by their CRC-32 only";
  std::map<std::string, std::string_view> entries;
  for (const std::string& name : names) {
    KILN_CHECK(zip.contains(name) && listed.contains(name) && listed[name].is_object())
        << path << " lacks the entry " << name << ": the file is incomplete";
    const std::string_view data = zip.read(name);
    const json& expected = listed[name];
    const bool size_ok = expected.value("bytes", int64_t{-1}) == static_cast<int64_t>(data.size());
    const bool hash_ok = !hashes || sha256_hex(data).value_or("") == expected.value("sha256", "");
    KILN_CHECK(size_ok && hash_ok) << "entry " << name << " of " << path
                                   << " does not match its SHA-256 in the manifest: the file is corrupted";
    entries.emplace(name, data);
  }
  return entries;
}

// "" when the file's compiled code can run here as it is; else why not (the graph then runs on the interpreter).
std::string compiled_code_unusable(const json& manifest, const graph::Graph& g, const std::vector<std::string>& graphs) {
  const std::string saved_torch = manifest.value("torch_version", "");
  const std::string here = runtime::built_torch_version();
  if (saved_torch.substr(0, saved_torch.find('+')) != here)
    return "the file was saved with torch " + saved_torch + ", this loader is built against torch " + here;
  if (graphs.empty()) return "the file holds no compiled code (kiln.export ran the graph on the eager interpreter, "
                             "or kiln's disk cache was off when it was saved)";
  if (graphs.size() != 1) return "the file holds " + std::to_string(graphs.size()) + " compiled graph records, not one";
  std::string why;
  if (!graph::single_device(g, why)) return "the graph has " + why;
  return "";
}

// The graph kiln's pipeline keyed the file's compiled record by, with its constants' tensors: the saved graph with
// in-place ops made functional, constants folded and attention masks that mask nothing dropped, exactly as
// compile::compile_kiln_graph does before it looks for or lowers an artefact (compile/pipeline.cpp, steps 1 and 2).
// Throws when the pipeline took another route (buffer updates).
struct KeyedGraph {
  std::shared_ptr<const graph::Graph> graph;
  std::vector<at::Tensor> constants;  // indexed by ValueId
};

// Step 1: in-place ops on the graph's own intermediates made functional (passes/functionalize.h).
std::shared_ptr<const graph::Graph> functional_graph(std::shared_ptr<const graph::Graph> g) {
  bool mutates = false;
  for (const graph::Node& node : g->nodes) mutates = mutates || node.mutates_args;
  if (!mutates) return g;
  auto functional = std::make_shared<graph::Graph>(*g);
  if (passes::functionalize_inplace_ops(*functional)) g = std::move(functional);
  for (const graph::Node& node : g->nodes)
    KILN_CHECK(!node.mutates_args) << "the graph updates tensors in place (" << node.qualified_name()
                                   << "), which kiln's pipeline compiles as buffer updates";
  return g;
}

// Step 2: what reads no input folded into constants, as compile/fold_graph_constants.cpp folds (the same plan and
// evaluation); the constants stay apart from the graph, renumbered with it.
KeyedGraph folded_graph(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants) {
  const passes::ConstantFolding plan = passes::plan_constant_folding(*g, passes::kMaxFoldedBytes);
  if (plan.empty()) return {g, std::move(constants)};
  std::vector<at::Tensor> results;
  try {
    results = runtime::evaluate_folded_values(*g, plan, constants);
  } catch (const std::exception&) {
    return {g, std::move(constants)};  // the pipeline did not fold either (fold_graph_constants logs why)
  }
  auto folded = std::make_shared<graph::Graph>(*g);
  const std::vector<graph::ValueId> new_id =
      passes::fold_constants(*folded, plan, std::vector<graph::PyObjectRef>(plan.values.size()));
  std::vector<at::Tensor> folded_constants(folded->values.size());
  for (const graph::Value& v : g->values)
    if (v.is_constant) folded_constants.at(new_id.at(v.id)) = constants.at(v.id);
  for (size_t i = 0; i < plan.values.size(); ++i) folded_constants.at(new_id.at(plan.values[i])) = results[i];
  return {folded, std::move(folded_constants)};
}

KeyedGraph pipeline_input(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants) {
  KeyedGraph keyed = folded_graph(functional_graph(std::move(g)), std::move(constants));
  // Step 2, its second half: the mask drop reads the folded constants (value ids are unchanged by it).
  keyed.graph = runtime::drop_attention_masks_that_mask_nothing(
      std::move(keyed.graph), [&keyed](const graph::Graph&) { return keyed.constants; });
  return keyed;
}

// The graph record's artefact loaded through the device backend it names, on the graph's device: its device code
// found in kiln's disk cache, where the file's copy was published, or compiled again from the record's source (another
// CPU or compiler; another GPU architecture or NVRTC version).
std::shared_ptr<runtime::CompiledGraph> load_compiled(const std::map<std::string, std::string_view>& entries,
                                                      const std::string& graph_entry,
                                                      std::shared_ptr<const graph::Graph> g,
                                                      const std::vector<at::Tensor>& constants) {
  for (const auto& [name, data] : entries) {
    std::smatch m;
    if (std::regex_match(name, m, kernel_entry_pattern()) && m[1] != "graphs")  // best effort: the cache may be off
      cache::publish_content(m[1], m[2], m[3], std::string(data));
  }
  std::string why;
  const graph::Device device = *graph::single_device(*g, why);  // checked by compiled_code_unusable
  const KeyedGraph keyed = pipeline_input(std::move(g), constants);
  std::optional<cache::CompiledArtifact> artifact =
      cache::artifact_from_bytes(std::string(entries.at(graph_entry)), *keyed.graph);
  KILN_CHECK(artifact) << "the compiled graph record does not match the saved graph's constants";
  // The backend registered for the graph's device must be the one that emitted the record's code (throws for a
  // device kiln generates no code for).
  const std::string expected = codegen::device_backend(device.type).name();
  KILN_CHECK(artifact->code.empty() || artifact->code.backend == expected)
      << "the compiled graph record holds " << artifact->code.backend << " code, and the graph runs on "
      << graph::device_type_name(device.type) << " (" << expected << " code)";
  const std::vector<graph::ValueId> sources = artifact->constant_sources;
  const runtime::ConstantsOf constants_of = [keyed_constants = keyed.constants, sources](const graph::Graph& optimised) {
    std::vector<at::Tensor> tensors(optimised.values.size());
    for (const graph::Value& v : optimised.values)
      if (v.is_constant) tensors[v.id] = keyed_constants.at(sources.at(v.id));
    return tensors;
  };
  const char* dump_dir = std::getenv("KILN_DEBUG_DIR");
  return runtime::make_kiln_graph(std::move(*artifact), device, constants_of,
                                  "torch " + runtime::built_torch_version(), dump_dir ? dump_dir : "", {});
}

// How a loaded program runs: "kiln" (the file's compiled code) or "eager", and why not "kiln".
struct Choice {
  std::string path;
  std::string backend = "eager";
  std::string fallback_reason;
};

// The file's compiled code for `g` (a graph without size symbols) if it can run here, else the eager interpreter;
// records which in `state`.
std::shared_ptr<runtime::CompiledGraph> compiled_or_eager(Choice& state, const json& manifest,
                                                          const std::map<std::string, std::string_view>& entries,
                                                          std::shared_ptr<const graph::Graph> g,
                                                          std::vector<at::Tensor> constants) {
  std::vector<std::string> graphs;
  for (const auto& [name, data] : entries)
    if (name.rfind("kernels/graphs/", 0) == 0) graphs.push_back(name);
  state.fallback_reason = compiled_code_unusable(manifest, *g, graphs);
  if (state.fallback_reason.empty()) {
    try {
      std::shared_ptr<runtime::CompiledGraph> compiled = load_compiled(entries, graphs.front(), g, constants);
      state.backend = "kiln";
      return compiled;
    } catch (const std::exception& e) {
      state.fallback_reason = std::string("the compiled code does not load: ") + e.what();
    }
  }
  KILN_LOG(fallbacks) << "kiln export: " << state.path << " runs on the eager interpreter: " << state.fallback_reason;
  return runtime::make_eager_interpreter(std::move(g), std::move(constants));
}

// A graph with size symbols as a runtime::DynamicGraph: the binding of the export's sizes runs what compiled_or_eager
// gives for the graph specialised there (the file's record was compiled from that graph); every other binding runs
// its specialised graph on the eager interpreter.
std::shared_ptr<runtime::CompiledGraph> dynamic_program(Choice& state, const json& manifest,
                                                        const std::map<std::string, std::string_view>& entries,
                                                        std::shared_ptr<const graph::Graph> g,
                                                        std::vector<at::Tensor> constants) {
  std::shared_ptr<const graph::Graph> at_hints = graph::specialise_sizes(*g, g->symbolic->hints());
  std::vector<std::vector<int64_t>> hint_sizes;
  for (graph::ValueId id : at_hints->inputs) hint_sizes.push_back(at_hints->value(id).meta.sizes);
  std::shared_ptr<runtime::CompiledGraph> compiled = compiled_or_eager(state, manifest, entries, at_hints, constants);
  auto factory = [compiled, hint_sizes, constants = std::move(constants), path = state.path](
                     std::shared_ptr<const graph::Graph> concrete,
                     const std::vector<at::Tensor>&) -> std::shared_ptr<runtime::CompiledGraph> {
    std::vector<std::vector<int64_t>> sizes;
    for (graph::ValueId id : concrete->inputs) sizes.push_back(concrete->value(id).meta.sizes);
    if (sizes == hint_sizes) return compiled;
    KILN_LOG(dynamic) << "kiln export: " << path << ": the file holds compiled code for the export's sizes only; "
                      << "these sizes run on the eager interpreter";
    return runtime::make_eager_interpreter(std::move(concrete), constants);
  };
  auto dynamic = std::make_shared<runtime::DynamicGraph>(std::move(g), std::move(factory), false);
  dynamic->compile_at_hints({});
  return dynamic;
}

}  // namespace

std::unique_ptr<ExportedProgram::State> ExportedProgram::read(const std::string& path) {
  auto state = std::make_unique<ExportedProgram::State>();
  state->path = path;
  const StoredZip zip = StoredZip::open(path);
  KILN_CHECK(zip.contains("manifest.json")) << path << " has no manifest.json: not a file ExportedProgram.save wrote";
  const json manifest = parse_entry(zip.read("manifest.json"), path + ": manifest.json");
  KILN_CHECK(manifest.is_object() && manifest.value("format", "") == kFormatName)
      << path << " is not a kiln export (its manifest names no format " << kFormatName << ")";
  const json version = manifest.value("format_version", json());
  KILN_CHECK(version.is_number_integer() && version.get<int>() >= kOldestFormatVersion &&
             version.get<int>() <= kFormatVersion)
      << path << " has format version " << version.dump() << "; this loader reads versions " << kOldestFormatVersion
      << " to " << kFormatVersion << ": export the model again with this kiln";
  for (const char* key : {"kiln_version", "torch_version", "cuda_version", "gpu_arch"})
    state->manifest[key] = manifest.contains(key) && manifest[key].is_string() ? manifest[key].get<std::string>() : "";
  const std::map<std::string, std::string_view> entries = checked_entries(zip, manifest, path);

  const json program = parse_entry(entries.at("program.json"), path + ": program.json");
  std::map<std::string, at::Tensor> weights =
      exporting::tensors_from_safetensors(entries.at("weights.safetensors"), path + ": weights.safetensors");
  const auto tensor_named = [&](const std::string& name, const std::string& device) {
    auto it = weights.find(name);
    KILN_CHECK(it != weights.end()) << path << ": weights.safetensors has no tensor " << name;
    return it->second.to(c10::Device(device));
  };
  bool cuda = false;
  try {
    for (const json& spec : program.at("input_tensors")) {
      TensorSpec s;
      s.dtype = dtype_named(spec.at("dtype").get<std::string>());
      s.device = c10::Device(spec.at("device").get<std::string>());
      s.sizes = spec.at("sizes").get<std::vector<int64_t>>();
      s.strides = spec.at("strides").get<std::vector<int64_t>>();
      for (const json& d : spec.value("dynamic", json::array())) {
        DynamicDim dim;
        dim.dim = d.at("dim").get<int64_t>();
        dim.name = d.at("name").is_string() ? d["name"].get<std::string>() : "";
        dim.min = std::max<int64_t>(2, d.at("min").is_number_integer() ? d["min"].get<int64_t>() : 2);
        dim.max = d.at("max").is_number_integer() ? d["max"].get<int64_t>() : -1;
        KILN_CHECK(dim.dim >= 0 && dim.dim < static_cast<int64_t>(s.sizes.size()))
            << path << ": program.json declares dim " << dim.dim << " dynamic for a " << s.sizes.size() << "-d input";
        s.dynamic.push_back(std::move(dim));
      }
      cuda = cuda || s.device.is_cuda();
      state->specs.push_back(std::move(s));
    }
    argument_paths(program.at("inputs"), "inputs", state->paths);
    state->paths.resize(state->specs.size(), "inputs");
    output_leaves(program.at("outputs"), state->outputs);
    for (const json& d : manifest.value("devices", json::array())) cuda = cuda || d.get<std::string>().rfind("cuda", 0) == 0;
    KILN_CHECK(!cuda || at::hasCUDA()) << path << " holds a CUDA program and this process has no CUDA device";
    std::map<std::string, at::Tensor> state_tensors;
    for (const json& s : program.at("state")) {
      const std::string name = s.at("name").get<std::string>();
      state_tensors[name] = tensor_named("state." + name, s.at("device").get<std::string>());
    }
    for (const json& b : program.at("graph_inputs")) {
      GraphInput input;
      if (b.at("kind").get<std::string>() == "input") {
        input.index = b.at("index").get<int64_t>();
        KILN_CHECK(input.index >= 0 && input.index < static_cast<int64_t>(state->specs.size()))
            << path << ": a graph input names argument " << input.index << ", which does not exist";
      } else {
        auto it = state_tensors.find(b.at("name").get<std::string>());
        KILN_CHECK(it != state_tensors.end()) << path << ": a graph input names unknown state " << b.at("name");
        input.state = it->second;
      }
      state->graph_inputs.push_back(std::move(input));
    }
    auto g = std::make_shared<graph::Graph>(graph::graph_from_json(std::string(entries.at("graph.json"))));
    try {
      g->verify(/*constants_hold_tensors=*/false);
    } catch (const Error& e) {
      KILN_CHECK(false) << path << ": graph.json does not describe a valid graph (" << e.what() << ")";
    }
    KILN_CHECK(g->inputs.size() == state->graph_inputs.size())
        << path << ": the graph has " << g->inputs.size() << " inputs, program.json feeds "
        << state->graph_inputs.size();
    for (const OutputLeaf& leaf : state->outputs)
      KILN_CHECK(leaf.index >= 0 && leaf.index < static_cast<int64_t>(leaf.from_graph ? g->outputs.size()
                                                                                        : state->specs.size()))
          << path << ": the result names " << (leaf.from_graph ? "graph output " : "argument ") << leaf.index
          << ", which does not exist";
    std::vector<at::Tensor> constants(g->values.size());
    for (const json& c : program.at("constants")) {
      const auto id = c.at("value").get<graph::ValueId>();
      KILN_CHECK(id >= 0 && id < static_cast<graph::ValueId>(g->values.size()) && g->values[id].is_constant)
          << path << ": program.json names constant " << id << ", which is not a constant of the graph";
      constants[id] = tensor_named("constant." + std::to_string(id), c.at("device").get<std::string>());
    }
    for (const graph::Value& v : g->values)
      KILN_CHECK(!v.is_constant || (constants[v.id].defined() && constants[v.id].sizes().vec() == v.meta.sizes))
          << path << ": constant %" << v.id << " of the graph has no tensor of its shape in weights.safetensors";

    Choice choice{path};
    state->compiled = graph::has_symbolic_sizes(*g)
                          ? dynamic_program(choice, manifest, entries, g, std::move(constants))
                          : compiled_or_eager(choice, manifest, entries, g, std::move(constants));
    state->backend = choice.backend;
    state->fallback_reason = choice.fallback_reason;
  } catch (const json::exception& e) {
    KILN_CHECK(false) << path << " holds a malformed program.json (" << e.what() << ")";
  }
  return state;
}

ExportedProgram::ExportedProgram(std::unique_ptr<State> state) : state_(std::move(state)) {}
ExportedProgram::ExportedProgram(ExportedProgram&&) noexcept = default;
ExportedProgram& ExportedProgram::operator=(ExportedProgram&&) noexcept = default;
ExportedProgram::~ExportedProgram() = default;

ExportedProgram ExportedProgram::load(const std::string& path) {
  try {
    return ExportedProgram(read(path));
  } catch (const ExportError&) {
    throw;
  } catch (const std::exception& e) {
    throw ExportError(std::string("kiln::ExportedProgram::load: ") + e.what());
  }
}

std::vector<at::Tensor> ExportedProgram::run(const std::vector<at::Tensor>& inputs) const {
  const State& s = *state_;
  if (inputs.size() != s.specs.size())
    throw ExportError("kiln::ExportedProgram::run: " + s.path + " takes " + std::to_string(s.specs.size()) +
                      " input tensors, got " + std::to_string(inputs.size()));
  std::vector<at::Tensor> arguments(inputs.size());
  std::map<std::string, std::pair<std::string, int64_t>> named;  // each Dim's size in this call
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const TensorSpec& spec = s.specs[i];
    const std::string& where = s.paths[i];
    if (!t.defined()) throw ExportError(where + ": expected a tensor, got an undefined one");
    if (t.scalar_type() != spec.dtype)
      throw ExportError(where + ": expected dtype " + dtype_name(spec.dtype) + ", got " + dtype_name(t.scalar_type()));
    if (t.device() != spec.device)
      throw ExportError(where + ": expected device " + spec.device.str() + ", got " + t.device().str());
    const std::string problem = size_problem(where, t.sizes(), spec, named);
    if (!problem.empty()) throw ExportError(problem);
    const std::vector<int64_t> strides = expected_strides(t.sizes(), spec);
    arguments[i] = t.strides() == c10::IntArrayRef(strides) || t.numel() == 0
                       ? t
                       : at::empty_strided(t.sizes(), strides, t.options()).copy_(t);
  }
  std::vector<at::Tensor> graph_inputs;
  graph_inputs.reserve(s.graph_inputs.size());
  for (const GraphInput& input : s.graph_inputs)
    graph_inputs.push_back(input.index >= 0 ? arguments[input.index] : input.state);
  at::NoGradGuard no_grad;  // exported programs are for inference (kiln.export traces under torch.no_grad)
  std::vector<at::Tensor> graph_outputs;
  try {
    graph_outputs = s.compiled->run(graph_inputs);
  } catch (const Error& e) {
    throw ExportError(std::string("kiln::ExportedProgram::run: ") + e.what());
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(s.outputs.size());
  for (const OutputLeaf& leaf : s.outputs) outputs.push_back(leaf.from_graph ? graph_outputs[leaf.index] : inputs[leaf.index]);
  return outputs;
}

const std::vector<TensorSpec>& ExportedProgram::input_specs() const { return state_->specs; }
size_t ExportedProgram::num_outputs() const { return state_->outputs.size(); }
const std::string& ExportedProgram::backend() const { return state_->backend; }
const std::string& ExportedProgram::fallback_reason() const { return state_->fallback_reason; }
const std::map<std::string, std::string>& ExportedProgram::manifest() const { return state_->manifest; }

std::map<std::string, at::Tensor> load_safetensors(const std::string& path) {
  try {
    std::ifstream in(path, std::ios::binary);
    KILN_CHECK(static_cast<bool>(in)) << "cannot open " << path << " for reading";
    std::ostringstream bytes;
    bytes << in.rdbuf();
    return exporting::tensors_from_safetensors(bytes.str(), path);
  } catch (const std::exception& e) {
    throw ExportError(std::string("kiln::load_safetensors: ") + e.what());
  }
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  try {
    const std::string bytes = exporting::safetensors_bytes(tensors);
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    KILN_CHECK(static_cast<bool>(out)) << "cannot write " << path;
  } catch (const std::exception& e) {
    throw ExportError(std::string("kiln::save_safetensors: ") + e.what());
  }
}

}  // namespace kiln
