"""Checks that a module built like the extension shares torch's C++ runtime.

Run by cmake/CxxRuntime.cmake with the interpreter the extension is built
for: ``check_cxx_runtime.py PROBE.so``. Exit 0 when the probe needs the
shared libstdc++ and runs in a process that has imported torch; otherwise
one paragraph on stdout says what is wrong, and the exit status is 1.
"""

import ctypes
import subprocess
import sys


def needed_libraries(path: str) -> list[str] | None:
    try:
        out = subprocess.run(
            ["readelf", "-d", path], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None  # no readelf: the load below still checks
    return [
        line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines() if "(NEEDED)" in line
    ]


def loaded_libstdcxx() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libstdc++" in line:
                return line.split()[-1]
    return "none loaded"


def main(probe: str) -> int:
    needed = needed_libraries(probe)
    if needed is not None and not any(lib.startswith("libstdc++.so") for lib in needed):
        print(
            "it links libstdc++ statically (the module needs no libstdc++.so among "
            f"{needed}): the extension would carry a second C++ runtime beside the shared "
            "libstdc++ that torch loads, and crash in the first C++ stream it uses"
        )
        return 1
    import torch  # noqa: F401 - the process the extension is loaded into

    try:
        lib = ctypes.CDLL(probe)
    except OSError as exc:
        print(
            f"a module it builds does not load beside torch ({exc}); this process's libstdc++ "
            f"is {loaded_libstdcxx()}: the compiler's libstdc++ is newer than the one torch loads"
        )
        return 1
    buf = ctypes.create_string_buffer(64)
    n = lib.hsdp_cxx_runtime_probe(buf, ctypes.c_size_t(len(buf)))
    if n <= 0 or buf.value != str(2**64 - 1).encode():
        print(f"a module it builds gives wrong results beside torch (got {buf.value!r})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
