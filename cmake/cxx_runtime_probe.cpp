// Built by cmake/CxxRuntime.cmake with the compiler and link flags the
// extension gets, then loaded into the torch process by check_cxx_runtime.py:
// it uses what crashed under a second libstdc++ (a stream inserting a size_t).
#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>

extern "C" int hsdp_cxx_runtime_probe(char* out, std::size_t capacity) {
  std::ostringstream stream;
  stream << static_cast<std::size_t>(-1);
  const std::string text = stream.str();
  if (text.size() + 1 > capacity) {
    return -1;
  }
  std::memcpy(out, text.c_str(), text.size() + 1);
  return static_cast<int>(text.size());
}
