"""Summarize a `py-spy record -f raw --threads --idle` file: per thread, where its samples are.

Usage: python benchmarks/spy_summary.py SPY.txt [--top 25] [--thread k2serve-engine]
Per thread (busiest first): the share of samples by leaf frame (where the time is spent) and
by frame anywhere on the stack (inclusive). With --idle, blocking waits show as leaves too
(`time.sleep`, `select`, a CUDA sync), which is what tells host work from waiting on the GPU.
"""

from __future__ import annotations

import argparse
import collections


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", default="", help="only threads whose name contains this")
    args = ap.parse_args(argv)
    total: collections.Counter = collections.Counter()
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(args.file) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            thread, count = frames[0], int(n)
            if args.thread not in thread:
                continue
            total[thread] += count
            leaf[thread][frames[-1]] += count
            for fr in set(frames[1:]):
                incl[thread][fr] += count
    for thread, n in total.most_common():
        print(f"== {thread}: {n} samples")
        for title, table in (("leaf", leaf[thread]), ("inclusive", incl[thread])):
            print(f"  {title}:")
            for fr, c in table.most_common(args.top):
                print(f"    {c / n * 100:5.1f}% {fr[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
