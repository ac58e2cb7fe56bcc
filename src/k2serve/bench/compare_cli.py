"""`k2serve bench compare A.json B.json`: the two runs side by side with B/A ratios."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("result_a", help="baseline result JSON (k2serve bench or vllm bench serve)")
    p.add_argument("result_b", help="result JSON to compare against the baseline")


def run(args: argparse.Namespace) -> int:
    from k2serve.bench.report import compare_table, load_result

    try:
        a, b = load_result(args.result_a), load_result(args.result_b)
    except (ValueError, FileNotFoundError) as e:
        print(f"k2serve bench compare: error: {e}", file=sys.stderr)
        return 2
    print(compare_table(a, b, Path(args.result_a).stem[:24], Path(args.result_b).stem[:24]))
    return 0
