# googletest from its sources, at the version the C++ tests are written and
# checked against: Debian bookworm's googletest 1.12.1 (scripts/setup.sh
# installs it). Another version is refused by name, not built: its macros and
# flags may differ. Built with the including project's flags (the sanitizers
# see it; the prebuilt libgtest.a would be invisible to them).
set(HSDP_GOOGLETEST_DIR /usr/src/googletest)
set(HSDP_GOOGLETEST_VERSION 1.12.1)
file(STRINGS "${HSDP_GOOGLETEST_DIR}/CMakeLists.txt" _hsdp_gtest REGEX "^set\\(GOOGLETEST_VERSION ")
if(NOT _hsdp_gtest STREQUAL "set(GOOGLETEST_VERSION ${HSDP_GOOGLETEST_VERSION})")
  message(FATAL_ERROR "googletest ${HSDP_GOOGLETEST_VERSION} expected in ${HSDP_GOOGLETEST_DIR} "
    "(Debian's googletest package, scripts/setup.sh); found '${_hsdp_gtest}'")
endif()
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
add_subdirectory("${HSDP_GOOGLETEST_DIR}" "${CMAKE_BINARY_DIR}/googletest" EXCLUDE_FROM_ALL)
