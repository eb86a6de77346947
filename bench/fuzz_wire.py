"""Long fuzz run of the wire decoder (the test suite runs a short one): mutated and random
messages until the time is up; any exception other than WireError is a bug and is printed with
the message that caused it.

    python bench/fuzz_wire.py --seconds 600
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from wire_fuzz import hostile_messages

from p2p.wire import Limits, WireError, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reasons: Counter[str] = Counter()
    crashes = 0
    deadline = time.monotonic() + args.seconds
    limits = Limits(max_message_bytes=1 << 20)
    for count, frames in enumerate(hostile_messages(args.seed, "fuzzer"), start=1):
        try:
            decode(frames, limits)
            reasons["decoded"] += 1
        except WireError as exc:
            reasons[exc.reason] += 1
        except Exception:
            crashes += 1
            print(f"CRASH on {frames!r}:\n{traceback.format_exc()}", file=sys.stderr)
        if count % 10_000 == 0 and time.monotonic() > deadline:
            break
    outcomes = dict(reasons.most_common())
    print(f"{count:,} messages in {args.seconds:g} s, {crashes} crashes; outcomes: {outcomes}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
