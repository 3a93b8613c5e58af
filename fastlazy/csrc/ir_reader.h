// A reader of the TorchScript IR that fastlazy's TorchScript backend emits
// (fastlazy/backends/torchscript.py), into a torch::jit::Graph, for the
// step executor.
//
// torch::jit::parseIR reads any IR through TorchScript's lexer and type
// parser at about 2 us a line whatever the line holds (a constant costs as
// much as a call), which made it half of a new graph's compile on the fast
// tier: 0.5-1.1 ms of GPT-2's 192-line graph.  The backend emits a small,
// regular subset -- one statement a line, every value typed, constants
// with one `value` attribute -- which this reads in one pass over the
// text, building the graph parseIR would build (tests compare the two
// graphs' printed forms for every graph the suite compiles).  Anything
// outside the subset throws NotEmitted before the graph is used, and the
// caller reads the text with parseIR instead.
#pragma once

#include <ATen/core/jit_type.h>
#include <torch/csrc/jit/ir/ir.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fastlazy {

// The text is not in the subset the backend emits.
struct NotEmitted {};

class IRReader {
 public:
  IRReader(std::string_view text, torch::jit::Graph* graph) : s_(text), g_(graph) {}

  void read() {
    expect("graph(");
    if (!next_is(")")) {
      while (true) {
        std::string_view name = var();
        expect(" : ");
        c10::TypePtr type = type_of(until_any(",)"));
        if (values_.count(name)) throw NotEmitted();
        // as parseIR names an input (Value::isValidName: all digits is no name)
        bool digits = name.find_first_not_of("0123456789") == std::string_view::npos;
        torch::jit::Value* v = g_->addInput(digits ? "" : std::string(name));
        v->setType(std::move(type));
        values_.emplace(name, v);
        if (!next_is(", ")) break;
        p_ += 2;
      }
    }
    expect("):\n");
    while (true) {
      expect("  ");
      if (next_is("return (")) {
        p_ += 8;
        g_->registerOutput(value(var()));
        expect(")");
        if (p_ < s_.size() && s_[p_] == '\n') p_++;
        if (p_ != s_.size()) throw NotEmitted();
        return;
      }
      statement();
    }
  }

 private:
  std::string_view s_;
  size_t p_ = 0;
  torch::jit::Graph* g_;
  std::unordered_map<std::string_view, torch::jit::Value*> values_;

  bool next_is(std::string_view word) const { return s_.substr(p_, word.size()) == word; }

  void expect(std::string_view word) {
    if (!next_is(word)) throw NotEmitted();
    p_ += word.size();
  }

  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_';
  }

  std::string_view name() {
    size_t start = p_;
    while (p_ < s_.size() && name_char(s_[p_])) p_++;
    if (p_ == start) throw NotEmitted();
    return s_.substr(start, p_ - start);
  }

  std::string_view var() {
    expect("%");
    return name();
  }

  // The text up to (not including) the first of `stops`.
  std::string_view until_any(std::string_view stops) {
    size_t end = s_.find_first_of(stops, p_);
    if (end == std::string_view::npos) throw NotEmitted();
    std::string_view found = s_.substr(p_, end - p_);
    p_ = end;
    return found;
  }

  torch::jit::Value* value(std::string_view name) const {
    auto found = values_.find(name);
    if (found == values_.end()) throw NotEmitted();
    return found->second;
  }

  // `%a : T = ns::op[value=LITERAL](%x, %y)`, or several `%a : T` outputs.
  void statement() {
    std::vector<std::pair<std::string_view, c10::TypePtr>> outs;
    while (true) {
      std::string_view out = var();
      expect(" : ");
      std::string_view type_text;
      if (next_is("(")) {
        size_t end = s_.find(')', p_);
        if (end == std::string_view::npos) throw NotEmitted();
        type_text = s_.substr(p_, end + 1 - p_);
        p_ = end + 1;
      } else {
        type_text = until_any(", ");
      }
      outs.emplace_back(out, type_of(type_text));
      if (next_is(" = ")) break;
      expect(", ");
    }
    p_ += 3;
    std::string_view ns = name();
    expect("::");
    std::string_view op = name();
    torch::jit::Node* node = g_->create(
        c10::Symbol::fromQualString(std::string(ns) + "::" + std::string(op)), {},
        outs.size());
    if (next_is("[value=")) {
      p_ += 7;
      literal(node);
      expect("]");
    }
    expect("(");
    if (!next_is(")")) {
      while (true) {
        node->addInput(value(var()));
        if (!next_is(", ")) break;
        p_ += 2;
      }
    }
    expect(")\n");
    for (size_t i = 0; i < outs.size(); i++) {
      if (values_.count(outs[i].first)) throw NotEmitted();
      node->outputs()[i]->setType(outs[i].second);
      values_.emplace(outs[i].first, node->outputs()[i]);
    }
    g_->appendNode(node);
  }

  // A constant's value attribute, as parseIR sets it: a string, or a
  // number (a float where it has a '.' or an 'e', else an int).
  void literal(torch::jit::Node* node) {
    if (next_is("\"")) {
      size_t end = s_.find('"', p_ + 1);
      if (end == std::string_view::npos) throw NotEmitted();
      std::string_view text = s_.substr(p_ + 1, end - p_ - 1);
      if (text.find('\\') != std::string_view::npos) throw NotEmitted();
      node->s_(c10::attr::value, std::string(text));
      p_ = end + 1;
      return;
    }
    std::string text(until_any("]"));
    if (text.empty() || text.find_first_not_of("0123456789.e+-") != std::string::npos) {
      throw NotEmitted();
    }
    char* end = nullptr;
    errno = 0;
    if (text.find_first_of(".e") != std::string::npos) {
      double f = std::strtod(text.c_str(), &end);
      if (errno != 0 || *end != '\0') throw NotEmitted();
      node->f_(c10::attr::value, f);
    } else {
      long long i = std::strtoll(text.c_str(), &end, 10);
      if (errno != 0 || *end != '\0') throw NotEmitted();
      node->i_(c10::attr::value, static_cast<int64_t>(i));
    }
  }

  // The types the backend writes; NotEmitted for any other.
  static c10::TypePtr type_of(std::string_view text) {
    if (text == "Tensor") return c10::TensorType::get();
    if (text == "int") return c10::IntType::get();
    if (text == "float") return c10::FloatType::get();
    if (text == "bool") return c10::BoolType::get();
    if (text == "complex") return c10::ComplexType::get();
    if (text == "str") return c10::StringType::get();
    if (text == "NoneType") return c10::NoneType::get();
    if (text == "Device") return c10::DeviceObjType::get();
    if (text == "int[]") return c10::ListType::ofInts();
    if (text == "float[]") return c10::ListType::ofFloats();
    if (text == "bool[]") return c10::ListType::ofBools();
    if (text == "Tensor[]") return c10::ListType::ofTensors();
    if (text == "Tensor?[]") return c10::ListType::ofOptionalTensors();
    if (text.size() >= 2 && text.front() == '(' && text.back() == ')') {
      // a tuple of tensors: "(Tensor, Tensor, ...)"
      std::vector<c10::TypePtr> items;
      std::string_view rest = text.substr(1, text.size() - 2);
      while (true) {
        size_t comma = rest.find(", ");
        std::string_view item = rest.substr(0, comma);
        if (item != "Tensor") throw NotEmitted();
        items.push_back(c10::TensorType::get());
        if (comma == std::string_view::npos) break;
        rest = rest.substr(comma + 2);
      }
      return c10::TupleType::create(std::move(items));
    }
    throw NotEmitted();
  }
};

// The graph of `ir`: read by IRReader where the text is in the emitted
// subset, else by torch::jit::parseIR.  *fast: which read it.
inline std::shared_ptr<torch::jit::Graph> read_ir(const std::string& ir, bool* fast) {
  auto graph = std::make_shared<torch::jit::Graph>();
  try {
    IRReader(ir, graph.get()).read();
    *fast = true;
    return graph;
  } catch (const NotEmitted&) {
  }
  graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  *fast = false;
  return graph;
}

// The graph of `ir` as IRReader reads it and as parseIR does, printed
// (for tests: the two must be equal); the first is empty where IRReader
// refused the text.
inline std::pair<std::string, std::string> read_both(const std::string& ir) {
  std::string mine;
  auto graph = std::make_shared<torch::jit::Graph>();
  try {
    IRReader(ir, graph.get()).read();
    mine = graph->toString();
  } catch (const NotEmitted&) {
  }
  auto theirs = std::make_shared<torch::jit::Graph>();
  try {
    torch::jit::parseIR(ir, theirs.get());
  } catch (const std::exception& e) {
    return {mine, std::string("parseIR refused it: ") + e.what()};
  }
  return {mine, theirs->toString()};
}

}  // namespace fastlazy
