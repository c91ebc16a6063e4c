// Shape rules of pointwise ops (unary, binary, ternary, comparisons, their in-place forms), dropout, and the ops
// that allocate like their input (empty_like and friends, clone, contiguous, _to_copy).
//
// Design note: the dtype logic is concrete: floating operands of one dtype, zero-dim tensors and
// Python numbers never promoting past them. The output layout is TensorIterator's (shape_rules.cpp), decided over
// the facts.
#include "graph/shape_rules_impl.h"

namespace kiln::graph::shape {

namespace {

enum class Result { kSameDtype, kBool, kSameShape };

bool is_complex(ScalarType t) {
  return t == ScalarType::ComplexHalf || t == ScalarType::ComplexFloat || t == ScalarType::ComplexDouble;
}

// Contiguous operands (not channels-last as well) of the result's rank, broadcast or not, give a contiguous result
// in eager and in torch's meta kernels alike (T5's relative positions: an int64 [1, n] row less a [1, 1] offset); any
// other layout refuses, naming `what`.
SymTensorMeta contiguous_result(RuleCall& call, const std::vector<const SymTensorMeta*>& tensors,
                                const std::vector<Expr>& shape, ScalarType dtype, const Device& device,
                                const std::string& what) {
  for (const SymTensorMeta* t : tensors) {
    call.check(t->dim() == static_cast<int64_t>(shape.size()), what + ": an operand of another rank");
    call.check(is_contiguous(call, *t) && !is_channels_last_contiguous(call, *t), what + ": a non-contiguous operand");
  }
  return contiguous_meta(shape, dtype, device);
}

// The output of a pointwise op over every argument: tensors take part in the layout; numbers, None and gelu's
// approximate strings are accepted; anything else refuses. Operands with dims share one floating dtype, or, where
// `integer_ok`, one integer dtype with int numbers and integer zero-dim tensors (which never promote it); those of
// a bool result one real dtype (torch's meta kernels of mixed dtypes lay size-1 dims out otherwise).
//
// The common floating cases take TensorIterator's layout, as eager's kernels do. For the others (`python_meta`: other
// ops, and integer or bool operands) torch's Python meta kernels, which kiln used before these rules, lay size-1
// dims and ties out differently from eager; only contiguous operands are decided there (contiguous_result).
SymTensorMeta pointwise(RuleCall& call, Result result, bool integer_ok = false, bool python_meta = false,
                        bool bitwise = false) {
  std::vector<const SymTensorMeta*> tensors;
  for (size_t i = 0; i < call.num_args(); ++i) {
    const RuleArg& a = call.arg(i);
    if (auto* t = std::get_if<SymTensorMeta>(&a)) {
      tensors.push_back(t);
    } else if (auto* s = std::get_if<std::string>(&a)) {
      call.check(*s == "none" || *s == "tanh", "unknown string argument '" + *s + "'");
    } else {
      call.check(call.is_none(i) || call.is_number_arg(i), "argument " + std::to_string(i) + " is not a number");
    }
  }
  const SymTensorMeta* first = nullptr;
  bool mixed = false;  // one floating dtype beside integer or bool operands (x / torch.arange(n)): promoted to it
  for (const SymTensorMeta* t : tensors) {
    if (t->dim() == 0) {
      call.check(!is_complex(t->dtype), "a complex zero-dim operand");
      continue;
    }
    call.check(!is_complex(t->dtype), "a complex operand");
    if (!first) first = t;
    if (t->dtype == first->dtype) continue;
    call.check(!python_meta && !bitwise && (is_floating(t->dtype) != is_floating(first->dtype) || mixed),
               "operands of different dtypes");
    mixed = true;
    if (is_floating(t->dtype)) first = t;
  }
  call.check(first != nullptr, "no operand with dims");
  if (mixed)
    for (const SymTensorMeta* t : tensors)
      call.check(t->dim() == 0 || t->dtype == first->dtype || (!is_floating(t->dtype) && is_floating(first->dtype)),
                 "operands of different dtypes");
  if (result != Result::kBool && !is_floating(first->dtype)) {
    call.check(integer_ok && (is_integral(first->dtype) || (bitwise && first->dtype == ScalarType::Bool)),
               "operands are not floating");
    for (const SymTensorMeta* t : tensors) call.check(!is_floating(t->dtype), "a floating zero-dim operand");
    for (size_t i = 0; i < call.num_args(); ++i)
      call.check(!std::holds_alternative<double>(call.arg(i)), "a float number with integer operands");
  }
  if (result == Result::kSameShape) {
    for (const SymTensorMeta* t : tensors) {
      call.check(t->dim() == tensors[0]->dim(), "operands of different ranks");
      for (int64_t d = 0; d < t->dim(); ++d) call.require_eq(t->sizes[d], tensors[0]->sizes[d], "operand sizes");
    }
  }
  std::vector<std::vector<Expr>> shapes;
  for (const SymTensorMeta* t : tensors) shapes.push_back(t->sizes);
  std::vector<Expr> shape = broadcast_shape(call, shapes);
  for (const Expr& s : shape) call.check(!call.size_is(s, 0), "an empty result");
  const ScalarType dtype = result == Result::kBool ? ScalarType::Bool : first->dtype;
  // (Comparisons of one real dtype take TensorIterator's layout, as eager gives it.)
  // (So do add/sub/mul/maximum/... of integers: their kernels are TensorIterator's whatever the dtype; transformers'
  // position ids are expanded int64 rows.)
  const bool iterator_layout = is_floating(first->dtype) || (result == Result::kBool && is_integral(first->dtype)) ||
                               bitwise || (integer_ok && !python_meta && is_integral(first->dtype));
  if (mixed) {
    // (torch's meta kernels of mixed dtypes order size-1 dims their own way: only results without one, from
    // contiguous operands, whose layout is contiguous whatever the order)
    for (const Expr& s : shape) call.check(!call.size_is(s, 1), "mixed dtypes with a dim of size 1");
    for (const SymTensorMeta* t : tensors)
      call.check(t->dim() == 0 || (is_contiguous(call, *t) && !is_channels_last_contiguous(call, *t)),
                 "mixed dtypes with a non-contiguous operand");
    return contiguous_meta(shape, dtype, first->device);
  }
  if (python_meta || !iterator_layout)
    return contiguous_result(call, tensors, shape, dtype, first->device, python_meta ? "a Python meta kernel" : "integers");
  return make_meta(shape, pointwise_strides(call, shape, tensors), dtype, first->device);
}

// where(condition, self, other): a bool condition, self and other as a binary op's operands.
void where_rule(RuleCall& call) {
  const SymTensorMeta& condition = call.tensor(0);
  call.check(condition.dtype == ScalarType::Bool, "condition is not bool");
  std::vector<const SymTensorMeta*> tensors = {&condition};
  const SymTensorMeta* value = nullptr;
  for (size_t i = 1; i < 3; ++i) {
    if (auto* t = std::get_if<SymTensorMeta>(&call.arg(i))) {
      tensors.push_back(t);
      if (t->dim() > 0 || !value) value = t;
    } else {
      call.check(call.is_number_arg(i), "where's values are not tensors or numbers");
    }
  }
  call.check(value != nullptr, "no tensor value");
  for (size_t i = 1; i < tensors.size(); ++i) call.check(tensors[i]->dtype == value->dtype, "values of two dtypes");
  std::vector<std::vector<Expr>> shapes;
  for (const SymTensorMeta* t : tensors) shapes.push_back(t->sizes);
  std::vector<Expr> shape = broadcast_shape(call, shapes);
  for (const Expr& s : shape) call.check(!call.size_is(s, 0), "an empty result");
  if (!is_floating(value->dtype)) {  // T5's relative position buckets
    call.add_output(contiguous_result(call, tensors, shape, value->dtype, value->device, "integer or bool values"));
    return;
  }
  call.add_output(make_meta(shape, pointwise_strides(call, shape, tensors), value->dtype, value->device));
}

// In-place ops return their receiver: floating receivers where the out-of-place op gives its shape and dtype,
// integer receivers (BatchNorm's num_batches_tracked.add_(1)) of add/sub/mul by Python ints.
void inplace_rule(RuleCall& call, Result result, bool integer_ok) {
  const SymTensorMeta& x = call.tensor(0);
  for (int64_t d = 0; d < x.dim(); ++d)
    call.check(call.size_is(x.sizes[d], 1) || !call.eq(x.strides[d], 0, "a stride of 0"),
               "the receiver overlaps itself");
  if (is_floating(x.dtype)) {
    SymTensorMeta out = pointwise(call, result);
    call.check(out.dtype == x.dtype && out.dim() == x.dim(), "the result is not the receiver's shape");
    for (int64_t d = 0; d < x.dim(); ++d)
      call.check(call.eq(out.sizes[d], x.sizes[d], "result size"), "the result is not the receiver's shape");
  } else {
    // An integer receiver (BatchNorm's num_batches_tracked.add_(1), positions += offsets): int numbers, or
    // tensors of its dtype that broadcast to its shape.
    call.check(integer_ok && is_integral(x.dtype), "an integer receiver of this op");
    for (size_t i = 1; i < call.num_args(); ++i) {
      if (const auto* t = std::get_if<SymTensorMeta>(&call.arg(i))) {
        call.check(t->dtype == x.dtype && t->dim() <= x.dim(), "a tensor operand of another dtype or rank");
        std::vector<Expr> shape = broadcast_shape(call, {x.sizes, t->sizes});
        for (int64_t d = 0; d < x.dim(); ++d) call.require_eq(shape[d], x.sizes[d], "the receiver's size");
        continue;
      }
      call.check(std::holds_alternative<Expr>(call.arg(i)), "a non-int operand of an integer receiver");
    }
  }
  call.add_output(x);
}

void bernoulli_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  auto p = call.number(1);
  call.check(is_floating(x.dtype) && p && *p >= 0 && *p <= 1 && call.is_none(2), "bernoulli_'s arguments");
  call.add_output(x);
}

void native_dropout_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  auto p = call.number(1);
  call.check(!call.is_none(2) && call.bool_arg(2), "eval-mode dropout returns its input");
  call.check(p && *p > 0 && *p < 1 && is_floating(x.dtype), "dropout's p or dtype");
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  call.check(is_non_overlapping_and_dense(call, x), "a non-dense input");
  std::vector<Expr> iterator_strides = pointwise_strides(call, x.sizes, {&x});
  for (int64_t d = 0; d < x.dim(); ++d)
    call.check(call.eq(iterator_strides[d], x.strides[d], "strides"), "CPU and CUDA lay this input out differently");
  call.add_output(make_meta(x.sizes, x.strides, x.dtype, x.device));
  call.add_output(make_meta(x.sizes, x.strides, ScalarType::Bool, x.device));
}

// empty_like(self, dtype, layout, device, pin_memory, memory_format) and the factories built on it; `first` is the
// index of the dtype argument (full_like has its fill value before it).
void like_rule(RuleCall& call, size_t first) {
  const SymTensorMeta& x = call.tensor(0);
  TensorOptions options = tensor_options(call, first, x.dtype, x.device);
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  std::vector<Expr> strides = empty_like_strides(call, x, call.optional_memory_format(first + 4));
  call.add_output(make_meta(x.sizes, strides, options.dtype, options.device));
}

void clone_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  call.add_output(make_meta(x.sizes, empty_like_strides(call, x, call.optional_memory_format(1)), x.dtype, x.device));
}

// _to_copy(self, dtype, layout, device, pin_memory, non_blocking, memory_format).
void to_copy_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  ScalarType dtype = call.optional_dtype(1).value_or(x.dtype);
  if (!call.is_none(2)) {
    auto* layout = std::get_if<LayoutArg>(&call.arg(2));
    call.check(layout && layout->code == 0, "a layout other than strided");
  }
  Device device = x.device;
  if (!call.is_none(3)) {
    auto* d = std::get_if<Device>(&call.arg(3));
    call.check(d != nullptr, "device");
    device = *d;
  }
  for (const Expr& s : x.sizes) call.check(!call.size_is(s, 0), "an empty input");
  call.add_output(make_meta(x.sizes, empty_like_strides(call, x, call.optional_memory_format(6)), dtype, device));
}

// contiguous(self, memory_format): self when already in that format, else a clone in it.
void contiguous_rule(RuleCall& call) {
  const SymTensorMeta& x = call.tensor(0);
  int8_t format = call.optional_memory_format(1).value_or(kContiguousFormat);
  call.check(format == kContiguousFormat || format == kChannelsLast, "memory format");
  bool already = format == kContiguousFormat ? is_contiguous(call, x) : is_channels_last_contiguous(call, x);
  if (already) {
    call.add_output(x);
    return;
  }
  call.add_output(make_meta(x.sizes, empty_like_strides(call, x, format), x.dtype, x.device));
}

// Ops whose result has their floating operands' dtype (integer operands would become floating, or raise).
const char* const kSameDtypeOps[] = {
    "div.Tensor", "div.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "gelu.default", "silu.default",
    "sigmoid.default", "tanh.default", "exp.default", "log.default", "sqrt.default", "rsqrt.default",
    "reciprocal.default", "erf.default", "sin.default", "cos.default", "hardtanh.default", "leaky_relu.default",
    "elu.default", "softplus.default", "hardswish.default", "hardsigmoid.default", "mish.default", "addcmul.default",
    "addcdiv.default", "lerp.Scalar", "lerp.Tensor"};
// Ops torch's Python meta kernels lay out (see pointwise): contiguous operands of one shape only. Floating operands
// only: integer ones become floating (exp2 of an int32 tensor is float32) or raise, which torch's meta kernel decides.
const char* const kPythonMetaFloatOps[] = {
    "exp2.default", "expm1.default", "log1p.default", "log2.default",
    "log10.default", "erfc.default", "tan.default", "atan.default", "asin.default", "acos.default", "sinh.default",
    "cosh.default", "asinh.default", "acosh.default", "atanh.default", "atan2.default", "hypot.default",
    "logit.default", "frac.default", "round.decimals"};
// The same layout, and integer operands keep their dtype.
const char* const kPythonMetaOps[] = {
    "nan_to_num.default", "round.default", "sign.default",
    "sgn.default", "floor.default", "ceil.default", "trunc.default", "remainder.Tensor", "remainder.Scalar",
    "fmod.Tensor", "fmod.Scalar"};
// Ops whose result has their operands' dtype, floating or integer (with int numbers; laid out as in pointwise).
const char* const kSameDtypeOrIntegerOps[] = {
    "add.Tensor", "sub.Tensor", "mul.Tensor", "add.Scalar", "sub.Scalar", "mul.Scalar", "rsub.Scalar",
    "rsub.Tensor", "maximum.default", "minimum.default", "relu.default", "neg.default", "abs.default",
    "clamp.default", "clamp_min.default", "clamp_max.default"};
const char* const kSameShapeOps[] = {"gelu_backward.default", "threshold_backward.default",
                                     "sigmoid_backward.default", "tanh_backward.default", "silu_backward.default"};
const char* const kBoolOps[] = {"eq.Tensor", "ne.Tensor", "lt.Tensor", "le.Tensor", "gt.Tensor", "ge.Tensor",
                                "eq.Scalar", "ne.Scalar", "lt.Scalar", "le.Scalar", "gt.Scalar", "ge.Scalar"};
const char* const kPythonMetaBoolOps[] = {"isnan.default", "isinf.default", "logical_not.default",
                                          "logical_and.default", "logical_or.default", "logical_xor.default"};
// In-place op -> whether integer receivers are accepted (for Python-int operands).
const std::pair<const char*, bool> kInplaceOps[] = {
    {"relu_.default", false}, {"sigmoid_.default", false}, {"tanh_.default", false}, {"silu_.default", false},
    {"gelu_.default", false}, {"hardtanh_.default", false}, {"hardswish_.default", false},
    {"leaky_relu_.default", false}, {"clamp_.default", false}, {"clamp_min_.default", false},
    {"clamp_max_.default", false}, {"add_.Tensor", true}, {"sub_.Tensor", true}, {"mul_.Tensor", true},
    {"div_.Tensor", false}, {"add_.Scalar", true}, {"sub_.Scalar", true}, {"mul_.Scalar", true},
    {"div_.Scalar", false}};

}  // namespace

void register_pointwise_rules(RuleTable& table) {
  auto add = [&](const std::string& name, Rule rule) { table["aten::" + name] = std::move(rule); };
  for (const char* op : kSameDtypeOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kSameDtype)); });
  for (const char* op : kPythonMetaFloatOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kSameDtype, false, true)); });
  for (const char* op : kPythonMetaOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kSameDtype, true, true)); });
  for (const char* op : kPythonMetaBoolOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kBool, false, true)); });
  // Bitwise ops of bool or integer operands of one dtype (attention masks combined): TensorIterator's layout.
  for (const char* op : {"bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor"})
    add(op, [](RuleCall& call) {
      for (size_t i = 0; i < call.num_args(); ++i) call.check(!call.is_number_arg(i), "a number operand");
      call.add_output(pointwise(call, Result::kSameDtype, true, false, true));
    });
  for (const char* op : kSameDtypeOrIntegerOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kSameDtype, true)); });
  for (const char* op : kSameShapeOps)
    add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kSameShape)); });
  for (const char* op : kBoolOps) add(op, [](RuleCall& call) { call.add_output(pointwise(call, Result::kBool)); });
  for (const auto& [op, integer_ok] : kInplaceOps) {
    bool ok = integer_ok;
    add(op, [ok](RuleCall& call) { inplace_rule(call, Result::kSameDtype, ok); });
  }
  add("where.self", where_rule);
  add("bernoulli_.float", bernoulli_rule);
  add("native_dropout.default", native_dropout_rule);
  add("empty_like.default", [](RuleCall& call) { like_rule(call, 1); });
  add("zeros_like.default", [](RuleCall& call) { like_rule(call, 1); });
  add("ones_like.default", [](RuleCall& call) { like_rule(call, 1); });
  add("full_like.default", [](RuleCall& call) { like_rule(call, 2); });
  add("rand_like.default", [](RuleCall& call) { like_rule(call, 1); });
  add("randn_like.default", [](RuleCall& call) { like_rule(call, 1); });
  add("clone.default", clone_rule);
  add("_to_copy.default", to_copy_rule);
  add("contiguous.default", contiguous_rule);
}

}  // namespace kiln::graph::shape
