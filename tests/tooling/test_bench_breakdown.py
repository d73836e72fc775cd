"""The per-call breakdown (benchmarks/breakdown.py): perf samples sorted into a call's parts, and a
short real run.

The rules: samples of each library and function go to their part (27 cases), and a perf report is
summed per part. A short 2-rank run of `python -m benchmarks.breakdown` whose parts add up to the
samples perf took; where perf cannot sample (not installed, no permission, or made unusable
here), the run still times each call and says why there is no breakdown."""

import json
import os
import pathlib
import sys

import pytest
from harness import run_module

from benchmarks.breakdown import PART_NAMES, parse_perf_report, part_of

ROOT = pathlib.Path(__file__).resolve().parents[2]
HSDP = "_C.cpython-311-x86_64-linux-gnu.so"


@pytest.mark.parametrize(
    "library, function, part",
    [
        ("libpython3.11.so.1.0", "_PyEval_EvalFrameDefault", "python"),
        ("libtorch_python.so", "pybind11::cpp_function::dispatcher", "torch"),
        ("libtorch_cpu.so", "c10d::ProcessGroup::allreduce", "torch"),
        (HSDP, "hsdp::ProcessGroupHSDP::allreduceImpl", "hsdp entry"),
        (HSDP, "hsdp::planInPlace", "hsdp entry"),
        (HSDP, "hsdp::ProcessGroupHSDP::record", "hsdp records"),
        (HSDP, "hsdp::FlightRecorder::started", "hsdp records"),
        ("[vdso]", "__vdso_clock_gettime", "hsdp records"),
        (HSDP, "hsdp::WorkHSDP::completed", "hsdp work"),
        (HSDP, "c10::ivalue::Future::markCompleted", "hsdp work"),
        (HSDP, "hsdp::shm::Engine::waitAll", "engine handshake"),
        (HSDP, "hsdp::shm::Engine::reduceScatter", "engine handshake"),
        (HSDP, "hsdp::shm::reduce", "engine reduction"),
        (
            HSDP,
            "void hsdp::shm::(anonymous namespace)::reduceFused<float>(float*)",
            "engine reduction",
        ),
        (HSDP, "hsdp::shm::detail::copyBytes", "engine copies"),
        ("libc.so.6", "__memmove_avx512_unaligned_erms", "engine copies"),
        ("libc.so.6", "malloc", "allocator"),
        ("libc.so.6", "sched_yield", "engine handshake"),
        ("libc.so.6", "pthread_mutex_lock@@GLIBC_2.2.5", "torch"),
        ("[kernel.kallsyms]", "copy_user_enhanced_fast_string", "engine copies"),
        ("[kernel.kallsyms]", "_copy_to_iter", "engine copies"),
        ("[kernel.kallsyms]", "__get_user_pages", "direct-read setup"),
        ("[kernel.kallsyms]", "process_vm_rw_core.constprop.0", "direct-read setup"),
        ("[kernel.kallsyms]", "futex_wait", "engine handshake"),
        ("[kernel.kallsyms]", "clear_page_erms", "kernel"),
        ("libfoo.so", "bar", "other"),
        (HSDP, "0x000000000014efbe", "other"),
    ],
)
def test_a_sample_goes_to_its_part(library, function, part):
    assert part_of(library, function) == part


def test_a_report_is_summed_per_part():
    text = "\n".join(
        [
            "# comment",
            " 40.00%\tlibpython3.11.so.1.0\t[.] _PyEval_EvalFrameDefault",
            " 25.50%\tlibtorch_cpu.so\t[.] c10d::ProcessGroup::allreduce",
            " 20.00%\t" + HSDP + "\t[.] hsdp::shm::Engine::waitAll",
            " 10.00%\t" + HSDP + "\t[.] hsdp::shm::Engine::post",
            "  4.50%\t[kernel.kallsyms]\t[k] futex_wait",
            "",
        ]
    )
    shares = parse_perf_report(text)
    assert set(shares) == set(PART_NAMES)
    assert shares["python"] == 40.0 and shares["torch"] == 25.5
    assert shares["engine handshake"] == pytest.approx(34.5)
    assert sum(shares.values()) == pytest.approx(100.0)


def _short_run(tmp_path, env):
    out_json = tmp_path / "breakdown.json"
    points = "all_reduce:8,all_gather_inplace:64K"
    proc = run_module("benchmarks.breakdown", "--quick", "--ranks", "2", "--points", points, "--json",
                      str(out_json), env=env)  # fmt: skip
    doc = json.loads(out_json.read_text())
    assert doc["suite"] == "breakdown" and doc["world"] == 2
    rows = doc["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 8),
        ("all_gather_inplace", 65536),
    ]
    for r in rows:
        assert r["us"] > 0 and r["sampled_us"] > 0 and r["iters"] > 0, r
    return proc.stdout, doc


def test_a_short_run_breaks_a_call_down(tmp_path):
    stdout, doc = _short_run(tmp_path, dict(os.environ))
    rows = doc["rows"]
    for r in rows:
        if doc["perf_problem"]:
            assert "percent" not in r, r
            assert f"no breakdown ({doc['perf_problem']})" in stdout, stdout
            continue
        # Every sample perf took is in some part (each of perf's rows rounded
        # to 0.01%: under load, hundreds of rows); an all-gather moves data.
        rounding = max(1.0, 0.005 * r["perf_rows"])
        assert sum(r["percent"].values()) == pytest.approx(100.0, abs=rounding), r
        assert r["percent"]["python"] > 0 and r["percent"]["torch"] > 0, r
    if not doc["perf_problem"]:
        assert rows[1]["percent"]["engine copies"] > 0, rows[1]


def test_without_perf_it_times_and_says_why(tmp_path):
    """No perf on the PATH: the times, and why there are no parts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # any tool the run may need but perf
    env = {**os.environ, "PATH": str(bin_dir)}
    stdout, doc = _short_run(tmp_path, env)
    assert doc["perf_problem"] == "perf is not installed", doc["perf_problem"]
    assert "no breakdown (perf is not installed)" in stdout, stdout
    assert all("percent" not in r for r in doc["rows"])
