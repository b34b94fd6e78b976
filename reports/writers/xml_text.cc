#include "reports/writers/xml_text.h"

namespace meshproof::reports {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid (overlong forms,
// surrogates, U+FFFE/U+FFFF and code points above U+10FFFF are invalid in XML text).
size_t utf8_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if (c == 0xE0 && b(1) < 0xA0) return 0;                                     // overlong
    if (c == 0xED && b(1) >= 0xA0) return 0;                                    // surrogates
    if (c == 0xEF && b(1) == 0xBF && (b(2) == 0xBE || b(2) == 0xBF)) return 0;  // U+FFFE/FFFF
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char u = static_cast<unsigned char>(s[i]);
    const size_t len = utf8_length(s, i);
    if (len == 0 || (u < 0x20 && u != '\t' && u != '\n')) {
      out += kReplacement;
      ++i;
      continue;
    }
    out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

std::string escape(std::string_view s, bool attr) {
  std::string out;
  out.reserve(s.size() + 16);
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    const char* entity = nullptr;
    switch (c) {
      case '&':
        entity = "&amp;";
        break;
      case '<':
        entity = "&lt;";
        break;
      case '>':
        entity = "&gt;";
        break;
      case '"':
        entity = "&quot;";
        break;
      case '\'':
        entity = "&#39;";
        break;
      case '\t':
        if (attr) entity = "&#9;";
        break;
      case '\n':
        if (attr) entity = "&#10;";
        break;
      case '\r':
        entity = "&#13;";  // a literal CR would be normalised away in text too
        break;
      default:
        break;
    }
    if (entity != nullptr) {
      out += entity;
      ++i;
      continue;
    }
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 && c != '\t' && c != '\n') {
      out += kReplacement;  // XML 1.0 forbids other C0 controls even as references
      ++i;
      continue;
    }
    const size_t len = utf8_length(s, i);
    if (len == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

}  // namespace

std::string xml_escape(std::string_view s) { return escape(s, false); }

std::string xml_escape_attr(std::string_view s) { return escape(s, true); }

std::string sanitize_text(std::string_view s) { return sanitize(s); }

}  // namespace meshproof::reports
