"""The per-file time table of two pytest runs: tests and seconds per file, before and after, from junit xml.

Usage: python scripts/suite_times.py BEFORE.xml AFTER.xml [AFTER2.xml ...] [--top 25]

Several AFTER files are the phases of one run (scripts/test.sh: the parallel phase, then the serial one): their
tests are added up and so are their wall times, since the phases run one after the other.

A file's seconds are the sum of its tests' times (setup, call and teardown, as pytest's junit xml counts them).
Under pytest-xdist the tests of a file may run on several workers at once, so the "after" column is the CPU-side
work of the file, not the wall time it adds: the wall time of the whole run is the last line (the junit
``testsuite`` time). Doctests are grouped by their module's file.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def per_file(paths: list[str]) -> tuple[dict[str, tuple[int, float]], float, int]:
    """{file: (tests, seconds)}, the run's wall seconds, and its failures + errors, from junit xml files."""
    suites = []
    for path in paths:
        root = ET.parse(path).getroot()
        suites += [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    wall = 0.0
    bad = 0
    for suite in suites:
        wall += float(suite.get("time", 0))
        bad += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        for case in suite.iter("testcase"):
            classname = case.get("classname", "")
            # "tests.evidence.test_crash" or "packcache.format" (a doctest): back to the file it came from.
            if classname.startswith("tests."):
                name = classname.replace(".", "/") + ".py"
            elif classname:
                name = "src/" + classname.replace(".", "/") + ".py"
            else:
                name = case.get("file") or "?"
            counts[name] += 1
            seconds[name] += float(case.get("time", 0))
    return {name: (counts[name], seconds[name]) for name in counts}, wall, bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    before, wall_before, bad_before = per_file([args.before])
    after, wall_after, bad_after = per_file(args.after)
    names = sorted(set(before) | set(after), key=lambda n: -before.get(n, (0, 0.0))[1])
    print("| file | tests | s before | s after (summed over workers) |")
    print("|---|---:|---:|---:|")
    for name in names[: args.top]:
        b, a = before.get(name, (0, 0.0)), after.get(name, (0, 0.0))
        tests = str(b[0]) if b[0] == a[0] else f"{b[0]} -> {a[0]}"
        print(f"| {name} | {tests} | {b[1]:.1f} | {a[1]:.1f} |")
    rest_b = sum(before.get(n, (0, 0.0))[1] for n in names[args.top :])
    rest_a = sum(after.get(n, (0, 0.0))[1] for n in names[args.top :])
    if len(names) > args.top:
        print(f"| ({len(names) - args.top} other files) | | {rest_b:.1f} | {rest_a:.1f} |")
    total_b = sum(t for _, t in before.values())
    total_a = sum(t for _, t in after.values())
    count_b = sum(c for c, _ in before.values())
    count_a = sum(c for c, _ in after.values())
    print(f"| **sum of test times** | {count_b} / {count_a} | {total_b:.1f} | {total_a:.1f} |")
    print(f"| **pytest wall time** (junit) | | {wall_before:.1f} | {wall_after:.1f} |")
    print(f"\nfailures + errors: before {bad_before}, after {bad_after}")


if __name__ == "__main__":
    main()
