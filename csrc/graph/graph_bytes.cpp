// Graph <-> bytes (see graph_bytes.h).
//
// A graph with symbolic sizes starts with the integer -1 (no graph starts with a negative value count) and ends with
// its symbolic table after the outputs; a graph without writes exactly the bytes it did before symbols existed.
#include "graph/graph_bytes.h"

#include <cstring>

#include "common/error.h"
#include "graph/symbolic_sizes.h"

namespace kiln::graph {

void ByteWriter::integer(int64_t v) {
  uint64_t z = (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);  // zigzag: small magnitudes, few bytes
  while (z >= 0x80) {
    out_.push_back(static_cast<char>((z & 0x7f) | 0x80));
    z >>= 7;
  }
  out_.push_back(static_cast<char>(z));
}

void ByteWriter::real(double v) {
  char bits[sizeof v];
  std::memcpy(bits, &v, sizeof v);
  out_.append(bits, sizeof v);
}

void ByteWriter::text(const std::string& s) {
  integer(static_cast<int64_t>(s.size()));
  out_ += s;
}

void ByteWriter::integers(const std::vector<int64_t>& v) {
  integer(static_cast<int64_t>(v.size()));
  for (int64_t x : v) integer(x);
}

int64_t ByteReader::integer() {
  uint64_t z = 0;
  for (int shift = 0;; shift += 7) {
    KILN_CHECK(pos_ < data_.size() && shift < 64) << "graph bytes truncated at byte " << pos_;
    const auto byte = static_cast<uint8_t>(data_[pos_++]);
    z |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) break;
  }
  return static_cast<int64_t>((z >> 1) ^ (~(z & 1) + 1));
}

double ByteReader::real() {
  double v;
  KILN_CHECK(data_.size() - pos_ >= sizeof v) << "graph bytes truncated at byte " << pos_;
  std::memcpy(&v, data_.data() + pos_, sizeof v);
  pos_ += sizeof v;
  return v;
}

int64_t ByteReader::count(int64_t limit) {
  const int64_t n = integer();
  KILN_CHECK(n >= 0 && n <= limit) << "graph bytes: " << n << " is out of range at byte " << pos_;
  return n;
}

std::string ByteReader::text() {
  const auto n = static_cast<size_t>(count(static_cast<int64_t>(data_.size() - pos_)));
  std::string s = data_.substr(pos_, n);
  pos_ += n;
  return s;
}

std::vector<int64_t> ByteReader::integers() {
  std::vector<int64_t> v(count(static_cast<int64_t>(data_.size() - pos_)));
  for (int64_t& x : v) x = integer();
  return v;
}

namespace {

// One tag per ArgValue alternative, in the variant's order (the tag is the variant index).
struct WriteArg {
  ByteWriter& w;
  void operator()(const NoneArg&) const {}
  void operator()(const TensorArg& t) const { w.integer(t.id); }
  void operator()(const TensorListArg& list) const {
    w.integer(static_cast<int64_t>(list.ids.size()));
    for (const auto& id : list.ids) w.integer(id ? *id : -1);
  }
  void operator()(bool b) const { w.integer(b); }
  void operator()(int64_t i) const { w.integer(i); }
  void operator()(double d) const { w.real(d); }
  void operator()(const std::complex<double>& c) const {
    w.real(c.real());
    w.real(c.imag());
  }
  void operator()(const std::string& s) const { w.text(s); }
  void operator()(const std::vector<int64_t>& v) const { w.integers(v); }
  void operator()(const std::vector<double>& v) const {
    w.integer(static_cast<int64_t>(v.size()));
    for (double d : v) w.real(d);
  }
  void operator()(const std::vector<bool>& v) const {
    w.integer(static_cast<int64_t>(v.size()));
    for (bool b : v) w.integer(b);
  }
  void operator()(const ScalarTypeArg& t) const { w.integer(static_cast<int64_t>(t.type)); }
  void operator()(const LayoutArg& l) const { w.integer(l.code); }
  void operator()(const MemoryFormatArg& m) const { w.integer(m.code); }
  void operator()(const Device& d) const {
    w.integer(static_cast<int64_t>(d.type));
    w.integer(d.index);
  }
};

Device read_device(ByteReader& r) {
  Device d;
  d.type = static_cast<DeviceType>(r.integer());
  d.index = static_cast<int8_t>(r.integer());
  return d;
}

ArgValue read_arg(ByteReader& r, int64_t num_values) {
  auto value_id = [&] { return static_cast<ValueId>(r.count(num_values - 1)); };
  const int64_t limit = 1 << 30;
  switch (r.count(std::variant_size_v<ArgValue> - 1)) {
    case 0: return NoneArg{};
    case 1: return TensorArg{value_id()};
    case 2: {
      TensorListArg list;
      list.ids.resize(r.count(limit));
      for (auto& id : list.ids) {
        const int64_t raw = r.integer();
        KILN_CHECK(raw >= -1 && raw < num_values) << "graph bytes: tensor list names value " << raw;
        if (raw >= 0) id = static_cast<ValueId>(raw);
      }
      return list;
    }
    case 3: return r.integer() != 0;
    case 4: return r.integer();
    case 5: return r.real();
    case 6: {
      const double re = r.real();
      return std::complex<double>(re, r.real());
    }
    case 7: return r.text();
    case 8: return r.integers();
    case 9: {
      std::vector<double> v(r.count(limit));
      for (double& d : v) d = r.real();
      return v;
    }
    case 10: {
      std::vector<bool> v(r.count(limit));
      for (size_t i = 0; i < v.size(); ++i) v[i] = r.integer() != 0;
      return v;
    }
    case 11: return ScalarTypeArg{static_cast<ScalarType>(r.integer())};
    case 12: return LayoutArg{static_cast<int8_t>(r.integer())};
    case 13: return MemoryFormatArg{static_cast<int8_t>(r.integer())};
    default: return read_device(r);
  }
}

std::vector<ValueId> read_ids(ByteReader& r, int64_t num_values) {
  std::vector<ValueId> ids(r.count(num_values * 16 + 16));
  for (ValueId& id : ids) id = static_cast<ValueId>(r.count(num_values - 1));
  return ids;
}

void write_ids(ByteWriter& w, const std::vector<ValueId>& ids) {
  w.integer(static_cast<int64_t>(ids.size()));
  for (ValueId id : ids) w.integer(id);
}

// ---- symbolic sizes -------------------------------------------------------------------------------------------
using sym::Expr;
using sym::ExprKind;

// An expression by its canonical structure: kind, then a symbol's id and name, a constant's value, a sum's terms
// (coefficient, factors as (atom, exponent)) and constant, or the arguments of floordiv, mod, min and max.
void write_expr(ByteWriter& w, const Expr& e) {
  w.integer(static_cast<int64_t>(e.kind()));
  switch (e.kind()) {
    case ExprKind::kSymbol:
      w.integer(e.symbol_id());
      w.text(e.symbol_name());
      return;
    case ExprKind::kConstant: w.integer(e.constant_value()); return;
    case ExprKind::kSum:
      w.integer(static_cast<int64_t>(e.terms().size()));
      for (const Expr::Term& t : e.terms()) {
        w.integer(t.coefficient);
        w.integer(static_cast<int64_t>(t.factors.size()));
        for (const Expr::Factor& f : t.factors) {
          write_expr(w, f.atom);
          w.integer(f.exponent);
        }
      }
      w.integer(e.sum_constant());
      return;
    default:
      w.integer(static_cast<int64_t>(e.args().size()));
      for (const Expr& a : e.args()) write_expr(w, a);
  }
}

// Rebuilt through the constructors, so what is read is canonical (and equal to what was written).
Expr read_expr(ByteReader& r, int depth = 0) {
  KILN_CHECK(depth < 64) << "graph bytes: a size expression nests too deeply";
  const int64_t limit = 1 << 20;
  const auto kind = static_cast<ExprKind>(r.count(static_cast<int64_t>(ExprKind::kConstant)));
  switch (kind) {
    case ExprKind::kSymbol: {
      const auto id = static_cast<sym::SymbolId>(r.count(1 << 30));
      return Expr::symbol(id, r.text());
    }
    case ExprKind::kConstant: return r.integer();
    case ExprKind::kSum: {
      Expr sum = 0;
      for (int64_t t = r.count(limit); t > 0; --t) {
        Expr term = r.integer();
        for (int64_t f = r.count(limit); f > 0; --f) {
          Expr atom = read_expr(r, depth + 1);
          for (int64_t k = r.count(64); k > 0; --k) term = term * atom;
        }
        sum = sum + term;
      }
      return sum + r.integer();
    }
    default: break;
  }
  std::vector<Expr> args(r.count(limit));
  for (Expr& a : args) a = read_expr(r, depth + 1);
  if (kind == ExprKind::kMin || kind == ExprKind::kMax) {
    KILN_CHECK(!args.empty()) << "graph bytes: min/max of nothing";
    return kind == ExprKind::kMin ? sym::min(args) : sym::max(args);
  }
  KILN_CHECK(args.size() == 2) << "graph bytes: floordiv/mod of " << args.size() << " arguments";
  return kind == ExprKind::kFloorDiv ? sym::floordiv(args[0], args[1]) : sym::mod(args[0], args[1]);
}

std::vector<Expr> read_exprs(ByteReader& r) {
  std::vector<Expr> v(r.count(1 << 20));
  for (Expr& e : v) e = read_expr(r);
  return v;
}

void write_exprs(ByteWriter& w, const std::vector<Expr>& v) {
  w.integer(static_cast<int64_t>(v.size()));
  for (const Expr& e : v) write_expr(w, e);
}

void write_symbolic(ByteWriter& w, const SymbolicSizes& s) {
  w.integer(static_cast<int64_t>(s.symbols.size()));
  for (const SymbolOrigin& o : s.symbols) {
    write_expr(w, o.symbol);
    w.integer(o.input_index);
    w.integer(o.dim);
    w.integer(o.hint);
    const sym::Range range = s.facts.range(o.symbol.symbol_id());
    w.integer(range.lo);
    w.integer(range.hi);
    w.integer(s.facts.divisor(o.symbol.symbol_id()));
  }
  w.integer(static_cast<int64_t>(s.metas.size()));
  for (const auto& m : s.metas) {
    w.integer(m.has_value());
    if (!m) continue;
    write_exprs(w, m->sizes);
    write_exprs(w, m->strides);
    write_expr(w, m->storage_offset);
    w.integer(static_cast<int64_t>(m->dtype));
    WriteArg{w}(m->device);
  }
  w.integer(static_cast<int64_t>(s.int_args.size()));
  for (const SymbolicIntArg& a : s.int_args) {
    w.integer(a.node);
    w.integer(a.arg);
    w.integer(a.element);
    write_expr(w, a.value);
  }
  w.integer(static_cast<int64_t>(s.assumptions.size()));
  for (const shape::Assumption& a : s.assumptions) {
    w.integer(static_cast<int64_t>(a.kind));
    write_expr(w, a.lhs);
    write_expr(w, a.rhs);
    w.text(a.reason);
  }
  w.integer(static_cast<int64_t>(s.specialisations.size()));
  for (const Specialisation& sp : s.specialisations) {
    write_expr(w, sp.symbol);
    w.integer(sp.value);
    w.text(sp.reason);
  }
}

std::shared_ptr<SymbolicSizes> read_symbolic(ByteReader& r, int64_t num_values) {
  auto s = std::make_shared<SymbolicSizes>();
  const int64_t limit = 1 << 30;
  auto symbol = [&] {
    Expr e = read_expr(r);
    KILN_CHECK(e.is_symbol()) << "graph bytes: " << e.to_string() << " where a size symbol belongs";
    return e;
  };
  s->symbols.resize(r.count(limit));
  for (SymbolOrigin& o : s->symbols) {
    o.symbol = symbol();
    o.input_index = static_cast<int32_t>(r.integer());
    o.dim = static_cast<int32_t>(r.integer());
    o.hint = r.integer();
    sym::Range range;
    range.lo = r.integer();
    range.hi = r.integer();
    s->facts.set_range(o.symbol, range);
    s->facts.add_divisor(o.symbol, r.count(limit));
  }
  s->metas.resize(r.count(num_values));
  for (auto& m : s->metas) {
    if (r.integer() == 0) continue;
    m.emplace();
    m->sizes = read_exprs(r);
    m->strides = read_exprs(r);
    KILN_CHECK(m->sizes.size() == m->strides.size()) << "graph bytes: a symbolic meta's sizes and strides differ";
    m->storage_offset = read_expr(r);
    m->dtype = static_cast<ScalarType>(r.integer());
    m->device = read_device(r);
  }
  s->int_args.resize(r.count(limit));
  for (SymbolicIntArg& a : s->int_args) {
    a.node = static_cast<NodeIndex>(r.integer());
    a.arg = static_cast<int32_t>(r.integer());
    a.element = static_cast<int32_t>(r.integer());
    a.value = read_expr(r);
  }
  s->assumptions.resize(r.count(limit));
  for (shape::Assumption& a : s->assumptions) {
    a.kind = static_cast<shape::Assumption::Kind>(r.count(static_cast<int64_t>(shape::Assumption::Kind::kDivisible)));
    a.lhs = read_expr(r);
    a.rhs = read_expr(r);
    a.reason = r.text();
  }
  s->specialisations.resize(r.count(limit));
  for (Specialisation& sp : s->specialisations) {
    sp.symbol = symbol();
    sp.value = r.integer();
    sp.reason = r.text();
  }
  return s;
}

}  // namespace

void write_graph(ByteWriter& w, const Graph& g) {
  if (g.symbolic) w.integer(-1);
  w.integer(static_cast<int64_t>(g.values.size()));
  for (const Value& v : g.values) {
    w.integer(v.is_tensor);
    w.integers(v.meta.sizes);
    w.integers(v.meta.strides);
    w.integer(v.meta.storage_offset);
    w.integer(static_cast<int64_t>(v.meta.dtype));
    w.integer(static_cast<int64_t>(v.meta.device.type));
    w.integer(v.meta.device.index);
    w.integer(v.meta.requires_grad);
    w.integer(v.producer);
    w.integer(v.is_input);
    w.integer(v.input_index);
    w.integer(v.is_constant);
  }
  write_ids(w, g.inputs);
  w.integer(static_cast<int64_t>(g.nodes.size()));
  for (const Node& n : g.nodes) {
    w.text(n.op);
    w.text(n.overload);
    w.integer(static_cast<int64_t>(n.args.size()));
    for (size_t i = 0; i < n.args.size(); ++i) {
      w.text(n.arg_names.at(i));
      w.integer(static_cast<int64_t>(n.args[i].index()));
      std::visit(WriteArg{w}, n.args[i]);
    }
    w.integer(n.num_positional);
    write_ids(w, n.outputs);
    w.integer(n.returns_list);
    w.integer(n.mutates_args);
    w.integer(n.is_view);
  }
  write_ids(w, g.outputs);
  if (g.symbolic) write_symbolic(w, *g.symbolic);
}

Graph read_graph(ByteReader& r) {
  Graph g;
  const int64_t limit = 1 << 30;
  int64_t first = r.integer();
  const bool symbolic = first == -1;
  const int64_t num_values = symbolic ? r.count(limit) : first;
  KILN_CHECK(num_values >= 0 && num_values <= limit) << "graph bytes: " << num_values << " values";
  g.values.resize(num_values);
  for (int64_t i = 0; i < num_values; ++i) {
    Value& v = g.values[i];
    v.id = static_cast<ValueId>(i);
    v.is_tensor = r.integer() != 0;
    v.meta.sizes = r.integers();
    v.meta.strides = r.integers();
    v.meta.storage_offset = r.integer();
    v.meta.dtype = static_cast<ScalarType>(r.integer());
    v.meta.device = read_device(r);
    v.meta.requires_grad = r.integer() != 0;
    v.producer = static_cast<NodeIndex>(r.integer());
    v.is_input = r.integer() != 0;
    v.input_index = static_cast<int32_t>(r.integer());
    v.is_constant = r.integer() != 0;
  }
  g.inputs = read_ids(r, num_values);
  g.nodes.resize(r.count(limit));
  for (Node& n : g.nodes) {
    n.op = r.text();
    n.overload = r.text();
    const int64_t num_args = r.count(limit);
    n.args.reserve(num_args);
    n.arg_names.reserve(num_args);
    for (int64_t i = 0; i < num_args; ++i) {
      n.arg_names.push_back(r.text());
      n.args.push_back(read_arg(r, num_values));
    }
    n.num_positional = static_cast<int32_t>(r.count(num_args));
    n.outputs = read_ids(r, num_values);
    n.returns_list = r.integer() != 0;
    n.mutates_args = r.integer() != 0;
    n.is_view = r.integer() != 0;
  }
  g.outputs = read_ids(r, num_values);
  if (symbolic) g.symbolic = read_symbolic(r, num_values);
  for (const Value& v : g.values)
    KILN_CHECK(v.producer >= -1 && v.producer < static_cast<int64_t>(g.nodes.size()))
        << "graph bytes: value %" << v.id << " names producer " << v.producer;
  return g;
}

}  // namespace kiln::graph
