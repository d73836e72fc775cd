"""``python -m benchmarks <suite> [options]``, from the repository root (see
benchmarks/__init__.py for the method; ``<suite> --help`` for its flags)."""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks import load
from benchmarks.suite import Suite, run

SUITE_MODULES = (
    "collectives",
    "coalesced",
    "numerics",
    "training",
    "hosts",
    "peers",
    "device_calls",
    "breakdown",
)


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not ranks or any(r < 2 for r in ranks):
        raise argparse.ArgumentTypeError("world sizes must be integers >= 2, e.g. 2,4")
    return ranks


def _parse_load(text: str) -> int:
    try:
        return load.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a count >= 0 or 'cores', got {text!r}"
        ) from None


def _parse_env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_shared_arguments(parser: argparse.ArgumentParser, suite: Suite) -> None:
    if suite.takes_ranks:
        parser.add_argument(
            "--ranks",
            type=_parse_ranks,
            default=None,
            metavar="W[,W...]",
            help=f"world sizes, one launch each (default: {','.join(map(str, suite.default_ranks))})",
        )
    parser.add_argument("--quick", action="store_true", help=suite.quick_help)
    full, quick = suite.default_timeout_s
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="wall-clock limit of the whole run in seconds; ranks still running are "
        f"killed (default: {quick:.0f} with --quick, else {full:.0f})",
    )
    parser.add_argument(
        "--env",
        type=_parse_env,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the rank processes (repeatable)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help=f"raw results and machine info; '' to skip (default: bench_results/{suite.output_stem}.json)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help=f"PNG plot (needs matplotlib); '' to skip (default: bench_results/{suite.output_stem}.png)",
    )
    parser.add_argument(
        "--load",
        type=_parse_load,
        default=0,
        metavar="N|cores",
        help="loaded mode: N CPU-bound processes (cores: one per core) run beside the ranks "
        "for the whole run (default: 0)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print each point as it is measured"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Benchmarks hsdp against gloo on this host, both backends in the same run,\n"
            "interleaved. Run from the repository root (the installed hsdp_backend is used).\n"
            "Method: see benchmarks/__init__.py and benchmarks/timing.py."
        ),
        epilog=(
            "examples:\n"
            "  python -m benchmarks collectives --quick\n"
            "  python -m benchmarks collectives --ranks 2 --sizes 4K,64K,1M,16M\n"
            "  python -m benchmarks collectives --ops all_reduce --dtype bfloat16 -v\n"
            "  python -m benchmarks coalesced --dim 256\n"
            "  python -m benchmarks numerics --ranks 2,4,8\n"
            "  python -m benchmarks training --quick --ranks 2\n"
            "  python -m benchmarks hosts --quick"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for module in SUITE_MODULES:
        suite = importlib.import_module(f"benchmarks.{module}").SUITE
        doc = sys.modules[f"benchmarks.{module}"].__doc__ or ""
        sub = subparsers.add_parser(
            suite.name,
            help=suite.help,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_shared_arguments(sub, suite)
        suite.add_arguments(sub)
        sub.set_defaults(suite_object=suite, subparser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    suite: Suite = args.suite_object
    if getattr(args, "ranks", None) is None:
        args.ranks = list(suite.default_ranks)
    try:
        config = suite.configure(args)
    except ValueError as exc:
        args.subparser.error(str(exc))
    return run(suite, args, config, argv)


if __name__ == "__main__":
    sys.exit(main())
