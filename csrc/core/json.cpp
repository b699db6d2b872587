#include "json.h"

#include <cstdio>
#include <cstdlib>
#include <unordered_set>

#include "error.h"

namespace layerstream::json {

const char* to_string(Type t) {
  switch (t) {
    case Type::Null: return "null";
    case Type::Bool: return "a boolean";
    case Type::Number: return "a number";
    case Type::String: return "a string";
    case Type::Array: return "an array";
    case Type::Object: return "an object";
  }
  return "?";
}

const Value* Value::find(std::string_view key) const {
  if (type != Type::Object) return nullptr;
  for (const auto& kv : object)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

bool Value::to_uint64(uint64_t& out) const {
  if (type != Type::Number || text.empty()) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
  }
  out = v;
  return true;
}

size_t utf8_sequence(std::string_view s, size_t at) {
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[at + i]); };
  const size_t left = s.size() - at;
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  // The first byte gives the length and the range of the second byte
  // (which excludes overlong forms, surrogates and code points past U+10FFFF).
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c == 0xE0) n = 3, lo = 0xA0;
  else if (c == 0xED) n = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) n = 3;
  else if (c == 0xF0) n = 4, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) n = 4;
  else if (c == 0xF4) n = 4, hi = 0x8F;
  if (n == 0 || left < n || b(1) < lo || b(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i)
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  return n;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string quote(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c >= 0x7f) {
          // Non-ASCII bytes are escaped one by one (as \u00XX of the byte) so
          // the output is printable ASCII even for invalid UTF-8.
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
  }
  out.push_back('"');
  return out;
}

namespace {

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Value parse_document() {
    skip_ws();
    Value v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected trailing characters after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;

  [[noreturn]] void fail(const std::string& why) const {
    LS_FAIL(what_, ": bad JSON at byte ", pos_, ": ", why);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return s_[pos_]; }

  void skip_ws() {
    while (!at_end()) {
      char c = peek();
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r')
        ++pos_;
      else
        break;
    }
  }

  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) fail("invalid literal (expected '" + std::string(lit) + "')");
    pos_ += lit.size();
  }

  Value parse_value(int depth) {
    if (at_end()) fail("unexpected end of input (expected a value)");
    if (depth >= kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    Value v;
    char c = peek();
    switch (c) {
      case '{': parse_object(v, depth); break;
      case '[': parse_array(v, depth); break;
      case '"':
        v.type = Type::String;
        v.text = parse_string();
        break;
      case 't':
        expect_literal("true");
        v.type = Type::Bool;
        v.boolean = true;
        break;
      case 'f':
        expect_literal("false");
        v.type = Type::Bool;
        break;
      case 'n': expect_literal("null"); break;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) {
          parse_number(v);
        } else {
          fail(std::string("unexpected character ") + quote(std::string_view(&s_[pos_], 1)));
        }
    }
    return v;
  }

  void parse_object(Value& v, int depth) {
    v.type = Type::Object;
    ++pos_;  // '{'
    skip_ws();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return;
    }
    std::unordered_set<std::string> seen;
    for (;;) {
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an object");
      if (peek() != '"') fail("expected a string key in an object");
      std::string key = parse_string();
      if (!seen.insert(key).second) fail("duplicate key " + quote(key));
      skip_ws();
      if (at_end() || peek() != ':') fail("expected ':' after object key " + quote(key));
      ++pos_;
      skip_ws();
      Value member = parse_value(depth + 1);
      v.object.emplace_back(std::move(key), std::move(member));
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return;
      }
      fail("expected ',' or '}' in an object");
    }
  }

  void parse_array(Value& v, int depth) {
    v.type = Type::Array;
    ++pos_;  // '['
    skip_ws();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      skip_ws();
      v.array.push_back(parse_value(depth + 1));
      skip_ws();
      if (at_end()) fail("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return;
      }
      fail("expected ',' or ']' in an array");
    }
  }

  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  unsigned read_hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      int d = hex_digit(s_[pos_ + i]);
      if (d < 0) fail("invalid hex digit in \\u escape");
      v = v * 16 + static_cast<unsigned>(d);
    }
    pos_ += 4;
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail("control character inside a string (must be escaped)");
      if (c >= 0x80) {  // JSON text is UTF-8 (RFC 8259 8.1): a name that is not cannot be given back
        const size_t n = utf8_sequence(s_, pos_);
        if (n == 0) fail("invalid UTF-8 inside a string (the file is damaged)");
        out.append(s_.data() + pos_, n);
        pos_ += n;
        continue;
      }
      if (c != '\\') {
        out.push_back(static_cast<char>(c));
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) fail("unterminated escape in a string");
      char e = s_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          unsigned cp = read_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              fail("unpaired UTF-16 surrogate in \\u escape");
            pos_ += 2;
            unsigned lo = read_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("invalid UTF-16 low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired UTF-16 surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: --pos_; fail("invalid escape sequence in a string");
      }
    }
  }

  void parse_number(Value& v) {
    size_t start = pos_;
    auto digits = [&]() {
      size_t n = 0;
      while (!at_end() && peek() >= '0' && peek() <= '9') {
        ++pos_;
        ++n;
      }
      return n;
    };
    if (peek() == '-') ++pos_;
    if (at_end()) fail("truncated number");
    if (peek() == '0') {
      ++pos_;
    } else if (digits() == 0) {
      fail("invalid number");
    }
    if (!at_end() && peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("invalid number (digits expected after '.')");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) fail("invalid number (digits expected in the exponent)");
    }
    v.type = Type::Number;
    v.text = std::string(s_.substr(start, pos_ - start));
    v.number = std::strtod(v.text.c_str(), nullptr);
  }
};

}  // namespace

Value parse(std::string_view text, const std::string& what) { return Parser(text, what).parse_document(); }

}  // namespace layerstream::json
