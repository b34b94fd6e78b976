// Escaping for XML/XHTML text and attribute values (junit.xml, report.html, inline SVG).
#pragma once

#include <string>
#include <string_view>

namespace meshproof::reports {

// Escapes & < > " ' as entities and replaces characters that XML 1.0 forbids (C0 controls other
// than tab, newline and carriage return) and invalid UTF-8 bytes with U+FFFD, so that any
// message a check produces (tensor names, paths, compiler output) yields well-formed XML.
std::string xml_escape(std::string_view s);

// Replaces invalid UTF-8 and C0 control characters other than tab and newline with U+FFFD (for
// plain-text outputs such as report.md).
std::string sanitize_text(std::string_view s);

// As xml_escape, and also writes tab, newline and carriage return as character references, so
// that attribute values keep them (parsers normalise literal ones to spaces).
std::string xml_escape_attr(std::string_view s);

}  // namespace meshproof::reports
