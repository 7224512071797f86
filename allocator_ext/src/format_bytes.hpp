// Byte counts in error messages, readable and exact: "3.2 GiB (3435973837 bytes)". The same format
// as waterwave_hpo/_checks.py's format_bytes.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace ww {

inline std::string format_bytes(std::size_t nbytes) {
  if (nbytes < 1024) return std::to_string(nbytes) + " bytes";
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(nbytes);
  int unit = -1;
  do {
    value /= 1024.0;
    ++unit;
  } while (value >= 1024.0 && unit < 5);
  char head[32];
  std::snprintf(head, sizeof head, "%.1f %s", value, kUnits[unit]);
  return std::string(head) + " (" + std::to_string(nbytes) + " bytes)";
}

}  // namespace ww
