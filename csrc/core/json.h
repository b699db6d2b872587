// layerstream — a small, strict JSON reader/writer helper (RFC 8259).
//
// Used for safetensors headers and *.safetensors.index.json files, i.e. for
// untrusted input: the parser never recurses deeper than kMaxDepth, never
// reads past the given text, and reports every problem as a one-line
// layerstream::Error ("<what>: bad JSON at byte N: <reason>").
//
// Numbers keep their source text so integers up to 2^64-1 are exact
// (Value::to_uint64); Value::number is the double approximation.
// Objects keep member order; duplicate keys are a parse error.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace layerstream::json {

enum class Type : uint8_t { Null, Bool, Number, String, Array, Object };
const char* to_string(Type t);

struct Value {
  Type type = Type::Null;
  bool boolean = false;
  double number = 0.0;
  std::string text;  // String: the decoded string; Number: the source token
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;

  bool is_null() const { return type == Type::Null; }
  bool is_bool() const { return type == Type::Bool; }
  bool is_number() const { return type == Type::Number; }
  bool is_string() const { return type == Type::String; }
  bool is_array() const { return type == Type::Array; }
  bool is_object() const { return type == Type::Object; }

  // Object member lookup; nullptr when absent (or when this is not an object).
  const Value* find(std::string_view key) const;
  // True (and sets out) when this is a Number written as a plain non-negative
  // integer (no sign, fraction or exponent) that fits in 64 bits.
  bool to_uint64(uint64_t& out) const;
};

constexpr int kMaxDepth = 64;

// Parses one JSON value (surrounding whitespace allowed, nothing else).
// `what` names the input in error messages (e.g. a file path).
Value parse(std::string_view text, const std::string& what);

// The length of the well-formed UTF-8 sequence (RFC 3629: no overlong forms,
// no surrogates, at most U+10FFFF) starting at s[at], 0 when there is none.
size_t utf8_sequence(std::string_view s, size_t at);
// Whether all of `s` is well-formed UTF-8.
bool valid_utf8(std::string_view s);

// `s` as a JSON string literal, quotes included (control characters and
// non-ASCII bytes escaped, so the result is always one printable line).
std::string quote(std::string_view s);

}  // namespace layerstream::json
