"""Two verdict.json files compared key by key, times left out: what a change that should not change behaviour
(a refactoring) must leave equal.

    python benchmarks/compare_verdicts.py BEFORE/verdict.json AFTER/verdict.json

Prints every differing key with both values, then a one-line count; keys that hold times, peak memory or the
run's identity (seconds, *_s, durations, peak_rss_bytes, the params/dvc.lock digests, git revision, date)
are counted apart. Exit 0 when nothing else differs, 1 otherwise.
"""

from __future__ import annotations

import json
import re
import sys

# keys whose values differ from run to run by nature (the key's own name, or any key under `seconds`/`layers`)
RUN_KEYS = re.compile(r"(^|\.)(seconds|duration|generated|git_revision|params_sha256|dvc_lock_sha256|peak_rss_bytes|"
                      r"[a-z_]*_s|mean_s)(\.|\[|$)")
# a sentence that names a duration ("about 2 min at the speed ...") differs only there
DURATION = re.compile(r"about [\d.,]+ (s|min|h)\b")


def differences(before, after, path: str = "") -> list[tuple[str, object, object]]:
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += differences(before.get(key, "<missing>"), after.get(key, "<missing>"), f"{path}.{key}")
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in differences(b, a, f"{path}[{i}]")]
    if isinstance(before, str) and isinstance(after, str) and DURATION.sub("", before) == DURATION.sub("", after):
        return []
    return [] if before == after else [(path, before, after)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    before, after = (json.load(open(path, encoding="utf-8")) for path in argv)
    found = differences(before, after)
    run = [d for d in found if RUN_KEYS.search(d[0])]
    other = [d for d in found if not RUN_KEYS.search(d[0])]
    for key, b, a in other:
        print(f"{key}: {str(b)[:120]!r} -> {str(a)[:120]!r}")
    print(f"{len(other)} keys differ beyond times and the run's identity ({len(run)} of those differ, as they must)")
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
