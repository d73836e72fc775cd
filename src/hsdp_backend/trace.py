"""Reads the flight records of all ranks and names the first collective where
they diverge.

    python -m hsdp_backend.trace DIR

DIR holds ``hsdp-trace.<group>.rank<R>.json`` files (``HSDP_TRACE_DIR``),
written by every rank of a group on its first failure, on SIGUSR1 and on
``hsdp_backend.dump_trace()``. For each group this prints the first
collective (by c10d sequence number) that the ranks did not all call alike
(a rank that skipped it or called another op), or, if they agree, the first
one that did not complete everywhere.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys
from dataclasses import dataclass

FORMAT = "hsdp-trace-1"


def load(directory: str | pathlib.Path) -> dict[str, dict[int, dict]]:
    """{group: {rank: record}} for every flight record in ``directory``."""
    groups: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for path in sorted(pathlib.Path(directory).glob("hsdp-trace.*.rank*.json")):
        # Error texts may quote bytes a corrupted segment held: never fail on them.
        record = json.loads(path.read_bytes().decode("utf-8", errors="replace"))
        if record.get("format") != FORMAT:
            raise ValueError(f"{path}: not an hsdp flight record of format {FORMAT}")
        record["path"] = str(path)
        groups[record["group"]][int(record["rank"])] = record
    return dict(groups)


@dataclass
class Finding:
    seq: int
    lines: list[str]  # one per rank
    verdict: str


def _describe(entry: dict | None, record: dict) -> str:
    if entry is None:
        entries = record["entries"]
        if not entries:
            return "no collective recorded"
        last = entries[-1]
        return (
            f"did not call it; its last collective is #{last['seq']} {last['op']} ({last['state']})"
        )
    text = f"{entry['op']}, {entry['bytes']} bytes, via {entry['route']}: {entry['state']}"
    if entry["error"]:
        text += f" ({entry['error'].splitlines()[0][:200]})"
    return text


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def first_divergence(records: dict[int, dict]) -> Finding | None:
    """The first collective that the ranks of one group did not call alike
    (a rank without it, another op, another route), or that every rank
    called but not every rank completed, whichever comes first: later
    entries of a broken group say nothing more. None if all agree."""
    by_rank = {r: {e["seq"]: e for e in rec["entries"]} for r, rec in records.items()}
    firsts = [min(seqs) for seqs in by_rank.values() if seqs]
    if not firsts:
        return None
    # Only the window every ring still covers can be compared.
    start = max(firsts)
    end = max(max(seqs) for seqs in by_rank.values() if seqs)
    for seq in range(start, end + 1):
        entries = {r: by_rank[r].get(seq) for r in sorted(records)}
        lines = [f"rank {r}: {_describe(e, records[r])}" for r, e in entries.items()]
        ops = collections.Counter(e["op"] for e in entries.values() if e is not None)
        absent = [r for r, e in entries.items() if e is None]
        if absent or len(ops) > 1:
            (common, n), *rest = ops.most_common()
            majority = common if not rest or rest[0][1] < n else None
            if majority is None:
                verdict = "the ranks called different collectives: " + "; ".join(
                    f"{_names(r for r, e in entries.items() if e and e['op'] == op)} called {op}"
                    for op in ops
                )
            else:
                called = [r for r, e in entries.items() if e and e["op"] == majority]
                parts = []
                if absent:
                    parts.append(f"{_names(absent)} never called it")
                for r, e in entries.items():
                    if e is not None and e["op"] != majority:
                        parts.append(f"rank {r} called {e['op']}")
                verdict = f"{' and '.join(parts)}, where {_names(called)} called {majority} #{seq}"
            return Finding(seq, lines, verdict)
        routes = collections.defaultdict(list)
        for r, e in entries.items():
            routes[e["route"]].append(r)
        if len(routes) > 1:
            return Finding(
                seq,
                lines,
                f"every rank called {next(iter(ops))}, but on different "
                "routes: " + "; ".join(f"{_names(r)} via {route}" for route, r in routes.items()),
            )
        if any(e["state"] != "completed" for e in entries.values()):
            return Finding(
                seq,
                lines,
                "every rank called it, but it did not complete on "
                + _names(r for r, e in entries.items() if e["state"] != "completed"),
            )
    return None


def report(directory: str | pathlib.Path) -> str:
    groups = load(directory)
    if not groups:
        return f"no flight records (hsdp-trace.*.rank*.json) in {directory}"
    out = []
    for group, records in sorted(groups.items()):
        size = max(rec["size"] for rec in records.values())
        out.append(f"group {group!r}: {size} ranks, records of {_names(records)}")
        dumped = [rec["dumped_us"] for rec in records.values()]
        if max(dumped) - min(dumped) > 600e6:
            out.append(
                "  warning: these records were written more than 10 minutes apart; some may "
                "be from an earlier run (a rank's file stays until overwritten)"
            )
        missing = sorted(set(range(size)) - set(records))
        if missing:
            out.append(
                f"  no record from {_names(missing)} (it did not fail, or died; "
                "SIGUSR1 or hsdp_backend.dump_trace() writes one)"
            )
        for r, rec in sorted(records.items()):
            if rec.get("where"):
                out.append(f"  rank {r} saw in shared memory: {rec['where']}")
                break
        finding = first_divergence(records)
        if finding is None:
            out.append("  the ranks agree on every recorded collective, and all completed")
            continue
        out.append(f"  first divergence at collective #{finding.seq}:")
        out.extend(f"    {line}" for line in finding.lines)
        out.append(f"  => {finding.verdict}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 2
    text = report(argv[0])
    print(text)
    return 1 if text.startswith("no flight records") else 0


if __name__ == "__main__":
    sys.exit(main())
