// Attention masks that mask nothing, dropped (drop_attention_masks.h).
#include "runtime/drop_attention_masks.h"

#include <ATen/ops/all.h>
#include <ATen/ops/eq.h>

#include <variant>
#include <vector>

#include "common/log.h"
#include "passes/fold_constants.h"
#include "passes/pipeline.h"
#include "runtime/evaluate_folding.h"

namespace kiln::runtime {

namespace {

// True when attention with `mask` computes what it computes without one: a bool mask that keeps every position, or
// an additive float mask of zeros.
bool masks_nothing(const at::Tensor& mask) {
  if (mask.scalar_type() == at::kBool) return mask.all().item<bool>();
  return mask.is_floating_point() && mask.eq(0).all().item<bool>();
}

}  // namespace

std::shared_ptr<const graph::Graph> drop_attention_masks_that_mask_nothing(std::shared_ptr<const graph::Graph> g,
                                                                            const ConstantsOf& constants_of) {
  std::vector<at::Tensor> constants;
  std::vector<size_t> unmasked;
  try {
    for (size_t n = 0; n < g->nodes.size(); ++n) {
      const graph::Node& node = g->nodes[n];
      if (node.qualified_name() != "aten::scaled_dot_product_attention.default" || node.args.size() < 4) continue;
      const auto* mask = std::get_if<graph::TensorArg>(&node.args[3]);
      if (!mask) continue;
      if (constants.empty()) {
        constants = constants_of(*g);
        constants.resize(g->values.size());
      }
      // The mask's value when it reads no graph input: a constant, or made from constants (torch.ones).
      at::Tensor m = g->values[mask->id].is_constant ? constants[mask->id] : at::Tensor();
      if (!m.defined()) {
        const passes::ConstantFolding plan = passes::plan_value_folding(*g, mask->id);
        if (plan.empty()) continue;
        m = evaluate_folded_values(*g, plan, constants).at(0);
      }
      if (masks_nothing(m)) unmasked.push_back(n);
    }
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln backend: not reading attention masks: " << e.what();
    return g;
  }
  if (unmasked.empty()) return g;
  auto rewritten = std::make_shared<graph::Graph>(*g);
  for (size_t n : unmasked) rewritten->nodes[n].args[3] = graph::NoneArg{};
  // Only arguments changed: the constants are checked as they came (the C++ loader keeps their tensors apart).
  if (passes::verify_enabled()) rewritten->verify(/*constants_hold_tensors=*/false);
  KILN_LOG(perf) << "kiln backend: " << unmasked.size() << " attention masks that mask nothing dropped";
  return rewritten;
}

}  // namespace kiln::runtime
