// Shape rules of the factories: arange, full, zeros, ones, empty, rand, randn, scalar_tensor and the new_* methods.
//
// Design note: a factory's sizes are its int arguments, which a tracer passes as expressions over size symbols
// (`torch.zeros(x.shape[0], 4)`); its output is contiguous (or in empty's memory format), its dtype the argument's,
// else the fill value's or torch's default (kDefaultDtype), else the receiver's for new_*. arange's length is
// ceil((end - start) / step): exact as a floordiv over int bounds, while a float bound or step pins every symbol
// it is computed from (the length is then a double's ceiling, which an expression cannot follow).
#include "graph/shape_rules_impl.h"

#include <cmath>

namespace kiln::graph::shape {

namespace {

// zeros / ones / rand / randn (size, dtype, layout, device, pin_memory) and full (size, fill_value, dtype, ...).
void filled_rule(RuleCall& call, bool has_fill) {
  std::vector<Expr> sizes = allocated_sizes(call, call.int_list(0));
  ScalarType dtype = kDefaultDtype;
  if (has_fill) {
    call.check(call.is_number_arg(1), "a fill value that is not a number");
    if (std::holds_alternative<bool>(call.arg(1))) dtype = ScalarType::Bool;
    if (std::holds_alternative<Expr>(call.arg(1))) dtype = ScalarType::Long;
  }
  TensorOptions options = tensor_options(call, has_fill ? 2 : 1, dtype, Device{});
  call.add_output(contiguous_meta(sizes, options.dtype, options.device));
}

// empty.memory_format(size, dtype, layout, device, pin_memory, memory_format).
void empty_rule(RuleCall& call) {
  std::vector<Expr> sizes = allocated_sizes(call, call.int_list(0));
  TensorOptions options = tensor_options(call, 1, kDefaultDtype, Device{});
  int8_t format = call.optional_memory_format(5).value_or(kContiguousFormat);
  std::vector<Expr> strides;
  if (format == kContiguousFormat) {
    strides = contiguous_strides(sizes);
  } else {
    call.check((format == kChannelsLast && sizes.size() == 4) || (format == kChannelsLast3d && sizes.size() == 5),
               "a memory format empty does not take for this rank");
    strides = channels_last_strides(sizes);
  }
  call.add_output(make_meta(sizes, strides, options.dtype, options.device));
}

// new_zeros / new_ones / new_empty (self, size, dtype, layout, device, pin_memory) and new_full (self, size,
// fill_value, dtype, ...): the receiver's dtype and device unless given, contiguous.
void new_filled_rule(RuleCall& call, bool has_fill) {
  const SymTensorMeta& self = call.tensor(0);
  std::vector<Expr> sizes = allocated_sizes(call, call.int_list(1));
  if (has_fill) call.check(call.is_number_arg(2), "a fill value that is not a number");
  TensorOptions options = tensor_options(call, has_fill ? 3 : 2, self.dtype, self.device);
  call.add_output(contiguous_meta(sizes, options.dtype, options.device));
}

// scalar_tensor(s, dtype, layout, device, pin_memory): 0-d, of the default dtype whatever the number.
void scalar_tensor_rule(RuleCall& call) {
  call.check(call.is_number_arg(0), "a value that is not a number");
  TensorOptions options = tensor_options(call, 1, kDefaultDtype, Device{});
  call.add_output(contiguous_meta({}, options.dtype, options.device));
}

// ceil(distance / step) for an int step, as a floordiv; ATen raises where the bounds run against the step, and an
// empty range is assumed away where the bounds are symbolic (a size that may be 0 cannot be symbolic).
Expr int_range_length(RuleCall& call, const Expr& start, const Expr& end, int64_t step) {
  call.check(step != 0, "a step of 0");
  Expr distance = call.simplify(step > 0 ? end - start : start - end);
  if (distance.is_constant()) {
    call.check(distance.constant_value() >= 0, "bounds against the step's sign");
    return sym::floordiv(distance + (std::abs(step) - 1), std::abs(step));
  }
  if (step > 0) {
    call.require_lt(start, end, "arange's bounds");
    return sym::floordiv(end - start + (step - 1), step);
  }
  call.require_lt(end, start, "arange's bounds");
  return sym::floordiv(start - end + (-step - 1), -step);
}

// arange(end, ...), arange.start(start, end, ...), arange.start_step(start, end, step, ...): the bounds and step
// are the first `count` arguments, the tensor options follow. Int arguments give int64, a float one the default
// dtype.
void arange_rule(RuleCall& call, size_t count) {
  bool any_float = false;
  for (size_t i = 0; i < count; ++i) {
    call.check(call.is_number_arg(i) && !std::holds_alternative<bool>(call.arg(i)), "a bound that is not a number");
    any_float = any_float || std::holds_alternative<double>(call.arg(i));
  }
  TensorOptions options = tensor_options(call, count, any_float ? kDefaultDtype : ScalarType::Long, Device{});
  call.check(options.dtype != ScalarType::Bool, "a bool arange");
  Expr length;
  if (!any_float) {
    Expr start = count >= 2 ? call.int_arg(0) : Expr(0), end = call.int_arg(count >= 2 ? 1 : 0);
    // (A step that varies would make the length a quotient of symbols: it is pinned.)
    Expr step = count == 3 ? call.pinned(call.int_arg(2), "arange's step") : Expr(1);
    length = int_range_length(call, start, end, step.constant_value());
  } else {
    std::vector<double> values;
    for (size_t i = 0; i < count; ++i) {
      if (auto* d = std::get_if<double>(&call.arg(i))) {
        values.push_back(*d);
      } else {
        values.push_back(static_cast<double>(call.pinned(call.int_arg(i), "a bound of a float arange").constant_value()));
      }
    }
    double start = count >= 2 ? values[0] : 0, end = values[count >= 2 ? 1 : 0], step = count == 3 ? values[2] : 1;
    call.check(std::isfinite(start) && std::isfinite(end) && std::isfinite(step) && step != 0, "bounds or step");
    call.check(step > 0 ? start <= end : end <= start, "bounds against the step's sign");
    if (is_integral(options.dtype)) {  // (ATen truncates the bounds to the dtype first: left to torch)
      for (double v : {start, end, step}) call.check(v == std::trunc(v), "a fractional bound of an int arange");
      length = int_range_length(call, static_cast<int64_t>(start), static_cast<int64_t>(end), static_cast<int64_t>(step));
    } else {
      length = static_cast<int64_t>(std::ceil((end - start) / step));
    }
  }
  length = call.simplify(length);
  call.check(!length.is_constant() || length.constant_value() >= 0, "a negative length");  // (else start < end holds)
  call.add_output(contiguous_meta({length}, options.dtype, options.device));
}

}  // namespace

void register_factory_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  for (const char* op : {"zeros.default", "ones.default", "rand.default", "randn.default"})
    add(op, [](RuleCall& call) { filled_rule(call, false); });
  add("full.default", [](RuleCall& call) { filled_rule(call, true); });
  add("empty.memory_format", empty_rule);
  for (const char* op : {"new_zeros.default", "new_ones.default", "new_empty.default"})
    add(op, [](RuleCall& call) { new_filled_rule(call, false); });
  add("new_full.default", [](RuleCall& call) { new_filled_rule(call, true); });
  add("scalar_tensor.default", scalar_tensor_rule);
  add("arange.default", [](RuleCall& call) { arange_rule(call, 1); });
  add("arange.start", [](RuleCall& call) { arange_rule(call, 2); });
  add("arange.start_step", [](RuleCall& call) { arange_rule(call, 3); });
}

}  // namespace kiln::graph::shape
