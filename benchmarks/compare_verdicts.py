"""Two verdict.json files compared key by key, times left out: what a change that should not change behaviour
(a refactoring, a fresh clone of the same commit) must leave equal.

    python benchmarks/compare_verdicts.py BEFORE/verdict.json AFTER/verdict.json [--rel-tol R] [--abs-tol A]

Numbers are equal when they are within the tolerance (math.isclose: |a - b| <= max(R * max(|a|, |b|), A); by
default R = 1e-9 and A = 0, float noise in the last digits); every numeric key beyond it is listed with both values
and its difference, then every other differing key (strings, lists, missing keys), then a one-line count. Keys that
hold times, peak memory or the run's identity (seconds, *_s, durations, peak_rss_bytes, the params/dvc.lock digests,
git revision, date) are counted apart. A sentence that differs only in a duration it names ("about 2 min") is equal.
Exit 0 when nothing else differs, 1 otherwise, 2 on a missing or unreadable file.

To check a run against the committed example to the precision the report prints (a perplexity change as +2.7 %,
a KL to three decimals): --abs-tol 0.0005.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys

# keys whose values differ from run to run by nature (the key's own name, or any key under `seconds`/`layers`)
RUN_KEYS = re.compile(r"(^|\.)(seconds|duration|generated|git_revision|params_sha256|dvc_lock_sha256|peak_rss_bytes|"
                      r"[a-z_]*_s|mean_s)(\.|\[|$)")
# a sentence that names a duration ("about 2 min at the speed ...") differs only there
DURATION = re.compile(r"about [\d.,]+ (s|min|h)\b")
REL_TOL, ABS_TOL = 1e-9, 0.0  # the defaults the help states


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def differences(before, after, path: str = "", rel_tol: float = REL_TOL,
                abs_tol: float = ABS_TOL) -> list[tuple[str, object, object]]:
    """(key, before, after) for every key whose values differ beyond the tolerance (numbers) or at all (the rest)."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += differences(before.get(key, "<missing>"), after.get(key, "<missing>"), f"{path}.{key}",
                                 rel_tol, abs_tol)
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in differences(b, a, f"{path}[{i}]",
                                                                                      rel_tol, abs_tol)]
    if isinstance(before, str) and isinstance(after, str) and DURATION.sub("", before) == DURATION.sub("", after):
        return []
    if _number(before) and _number(after):
        equal = math.isclose(before, after, rel_tol=rel_tol, abs_tol=abs_tol) or (math.isnan(before)
                                                                                  and math.isnan(after))
        return [] if equal else [(path, before, after)]
    return [] if before == after else [(path, before, after)]


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.strip().splitlines()
    parser = argparse.ArgumentParser(prog="compare_verdicts.py", description=doc[0] + " " + doc[1],
                                     epilog="\n".join(doc[4:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the verdict.json compared against (e.g. reports/example/verdict.json)")
    parser.add_argument("after", help="the verdict.json of the run checked (e.g. reports/verdict.json)")
    parser.add_argument("--rel-tol", type=float, default=REL_TOL, metavar="R",
                        help=f"relative tolerance for numbers (default {REL_TOL:g})")
    parser.add_argument("--abs-tol", type=float, default=ABS_TOL, metavar="A",
                        help=f"absolute tolerance for numbers (default {ABS_TOL:g})")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)  # a bad argument: argparse's usage line and exit 2
    if args.rel_tol < 0 or args.abs_tol < 0:
        print("compare_verdicts.py: --rel-tol and --abs-tol must be 0 or more", file=sys.stderr)
        return 2
    loaded = []
    for path in (args.before, args.after):
        try:
            with open(path, encoding="utf-8") as handle:
                loaded.append(json.load(handle))
        except (OSError, ValueError) as error:
            print(f"{path}: cannot read a verdict ({error}); give two verdict.json files `quantize report` wrote",
                  file=sys.stderr)
            return 2
    found = differences(*loaded, rel_tol=args.rel_tol, abs_tol=args.abs_tol)
    run = [d for d in found if RUN_KEYS.search(d[0])]
    other = [d for d in found if not RUN_KEYS.search(d[0])]
    numeric = [d for d in other if _number(d[1]) and _number(d[2])]
    rest = [d for d in other if d not in numeric]
    for key, b, a in numeric:
        print(f"{key}: {b!r} -> {a!r} ({a - b:+.3g})")
    for key, b, a in rest:
        print(f"{key}: {str(b)[:120]!r} -> {str(a)[:120]!r}")
    print(f"{len(numeric)} numeric keys differ beyond rel-tol {args.rel_tol:g} / abs-tol {args.abs_tol:g} and "
          f"{len(rest)} other keys differ, beyond times and the run's identity ({len(run)} of those differ, as they "
          "must)")
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
