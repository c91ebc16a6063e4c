// A node's arguments in the rules' form (graph/propagate_symbolic_sizes' symbolic ones, compile/'s MetaOracle's and the
// recorder's concrete ones), and the rules evaluated at concrete sizes.
//
// Design note: at concrete sizes every Expr is a constant, so a rule either answers with constant metas or refuses;
// an assumption it records is a relation between constants, checked here: a false one (eager would raise) is no
// answer, and torch's meta kernel then raises the user's error.
#include "graph/shape_rules.h"

#include "common/error.h"
#include "graph/symbolic_sizes.h"

namespace kiln::graph::shape {

std::optional<std::vector<RuleArg>> rule_args(const std::vector<ArgValue>& args, const TensorMetaOf& tensor,
                                              const IntArgOf& int_arg) {
  std::vector<RuleArg> out;
  out.reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const ArgValue& a = args[i];
    if (std::holds_alternative<NoneArg>(a)) {
      out.emplace_back(NoneArg{});
    } else if (auto* t = std::get_if<TensorArg>(&a)) {
      out.emplace_back(tensor(t->id));
    } else if (auto* list = std::get_if<TensorListArg>(&a)) {
      SymTensorList items;
      for (const auto& id : list->ids) items.items.push_back(id ? std::optional<SymTensorMeta>(tensor(*id)) : std::nullopt);
      out.emplace_back(std::move(items));
    } else if (auto* b = std::get_if<bool>(&a)) {
      out.emplace_back(*b);
    } else if (auto* value = std::get_if<int64_t>(&a)) {
      out.emplace_back(int_arg(i, -1, *value));
    } else if (auto* d = std::get_if<double>(&a)) {
      out.emplace_back(*d);
    } else if (std::holds_alternative<std::complex<double>>(a)) {
      return std::nullopt;
    } else if (auto* s = std::get_if<std::string>(&a)) {
      out.emplace_back(*s);
    } else if (auto* ints = std::get_if<std::vector<int64_t>>(&a)) {
      std::vector<Expr> exprs;
      for (size_t k = 0; k < ints->size(); ++k) exprs.push_back(int_arg(i, static_cast<int32_t>(k), (*ints)[k]));
      out.emplace_back(std::move(exprs));
    } else if (auto* reals = std::get_if<std::vector<double>>(&a)) {
      out.emplace_back(*reals);
    } else if (auto* bools = std::get_if<std::vector<bool>>(&a)) {
      out.emplace_back(*bools);
    } else if (auto* dtype = std::get_if<ScalarTypeArg>(&a)) {
      out.emplace_back(*dtype);
    } else if (auto* layout = std::get_if<LayoutArg>(&a)) {
      out.emplace_back(*layout);
    } else if (auto* format = std::get_if<MemoryFormatArg>(&a)) {
      out.emplace_back(*format);
    } else {
      out.emplace_back(std::get<Device>(a));
    }
  }
  return out;
}

namespace {

std::optional<std::vector<int64_t>> constants(const std::vector<Expr>& exprs) {
  std::vector<int64_t> out;
  out.reserve(exprs.size());
  for (const Expr& e : exprs) {
    if (!e.is_constant()) return std::nullopt;
    out.push_back(e.constant_value());
  }
  return out;
}

}  // namespace

std::optional<std::vector<std::optional<TensorMeta>>> infer_concrete_metas(
    const std::string& op, const std::vector<ArgValue>& args, const std::function<const TensorMeta&(ValueId)>& meta_of) {
  if (!has_shape_rule(op)) return std::nullopt;
  std::optional<std::vector<RuleArg>> rule_arguments =
      rule_args(args, [&](ValueId id) { return constant_meta(meta_of(id)); },
                [](size_t, int32_t, int64_t value) { return Expr(value); });
  if (!rule_arguments) return std::nullopt;
  sym::SizeFacts facts;
  RuleResult result = infer_shapes(op, *rule_arguments, facts);
  if (!result.has_rule) return std::nullopt;
  for (const Assumption& a : result.assumptions) {
    try {
      if (!a.holds({})) return std::nullopt;
    } catch (const kiln::Error&) {  // a symbol in it: not a concrete answer
      return std::nullopt;
    }
  }
  std::vector<std::optional<TensorMeta>> metas;
  for (const std::optional<SymTensorMeta>& out : result.outputs) {
    if (!out) {
      metas.emplace_back(std::nullopt);
      continue;
    }
    std::optional<std::vector<int64_t>> sizes = constants(out->sizes);
    std::optional<std::vector<int64_t>> strides = constants(out->strides);
    if (!sizes || !strides || !out->storage_offset.is_constant()) return std::nullopt;
    TensorMeta meta;
    meta.sizes = std::move(*sizes);
    meta.strides = std::move(*strides);
    meta.storage_offset = out->storage_offset.constant_value();
    meta.dtype = out->dtype;
    meta.device = out->device;
    metas.emplace_back(std::move(meta));
  }
  return metas;
}

}  // namespace kiln::graph::shape
