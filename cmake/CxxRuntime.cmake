# One C++ runtime per process. torch loads the shared libstdc++; an
# extension built by a compiler that links libstdc++ statically (some
# clusters' compiler modules, some images' CXX) carries a second copy, and
# the two crash in the first stream either uses; one built against a newer
# libstdc++ than the process has fails to load. A probe built with the
# extension's compiler and link flags, then loaded into a torch process,
# tells before anything else is compiled; the build stops naming the
# compiler and what to set.
set(_probe_dir "${CMAKE_BINARY_DIR}/cxx_runtime_probe")
file(MAKE_DIRECTORY "${_probe_dir}")
separate_arguments(_probe_link_flags UNIX_COMMAND "${CMAKE_SHARED_LINKER_FLAGS}")
execute_process(
  COMMAND "${CMAKE_CXX_COMPILER}" -std=c++20 -fPIC -shared ${_probe_link_flags}
          "${CMAKE_CURRENT_LIST_DIR}/cxx_runtime_probe.cpp" -o "${_probe_dir}/probe.so"
  RESULT_VARIABLE _probe_rc OUTPUT_VARIABLE _probe_out ERROR_VARIABLE _probe_out)
if(NOT _probe_rc EQUAL 0)
  message(FATAL_ERROR "hsdp_backend: the C++ compiler ${CMAKE_CXX_COMPILER} cannot build a shared "
                      "library:\n${_probe_out}")
endif()
execute_process(
  COMMAND "${Python3_EXECUTABLE}" "${CMAKE_CURRENT_LIST_DIR}/check_cxx_runtime.py" "${_probe_dir}/probe.so"
  RESULT_VARIABLE _probe_rc OUTPUT_VARIABLE _probe_out ERROR_VARIABLE _probe_out)
if(NOT _probe_rc EQUAL 0)
  message(FATAL_ERROR "hsdp_backend: the C++ compiler ${CMAKE_CXX_COMPILER} builds modules that "
                      "cannot share torch's C++ runtime: ${_probe_out}. Build with a compiler that "
                      "links the shared libstdc++ torch uses (for example CXX=/usr/bin/g++ pip "
                      "install --no-build-isolation .).")
endif()
message(STATUS "hsdp_backend: ${CMAKE_CXX_COMPILER} builds modules that share torch's libstdc++")
