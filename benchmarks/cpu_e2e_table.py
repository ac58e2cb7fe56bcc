"""Before/after table of `cpu_e2e.py --full-k2` outputs: one column per output file, one row
per part (ms/token and % of that run's limit, the max of its bandwidth probes), the shared
expert's three ways (ms/layer, %), the routed + shared experts in one kernel call and in two
(ms/layer, %), and the decode figure at each context (and with the experts' other way).
Missing files or rows print as '-'.

    python benchmarks/cpu_e2e_table.py NAME=FILE [NAME=FILE ...]
"""

from __future__ import annotations

import re
import sys

SHARED = re.compile(r"^# shared expert as (.+?)\s*: ([\d.]+) ms/layer.* = (\d+)% of BW")
TOTAL = re.compile(r"^EXTRAPOLATED full K2 decode, batch 1, context (\d+): (\d+) ms/token.* = "
                   r"(\d+)% of the read bandwidth")  # fmt: skip
EXPERTS = re.compile(r"^# routed \+ shared experts as (one call|two calls)\s*: ([\d.]+) "
                     r"ms/layer.* = (\d+)% of BW")  # fmt: skip
OTHER = re.compile(r"^# the same decode \(context (\d+)\) with the routed \+ shared experts as "
                   r"(.+?): (\d+) ms/token = (\d+)%")  # fmt: skip
LIMIT = re.compile(
    r"^# read bandwidth over \d+ probes: min ([\d.]+), median ([\d.]+), max ([\d.]+)"
)


def parse(path: str) -> dict[str, str]:
    got: dict[str, str] = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return got
    in_table = False  # after the parts table's header
    for line in lines:
        if line.startswith("# shared expert as the engine runs it here: "):
            got["shared expert timed as"] = line.split(": ", 1)[1].strip()
        elif line.startswith("# routed + shared experts as the engine runs them here: "):
            got["experts run as"] = line.split(": ", 1)[1].strip()
        elif m := EXPERTS.match(line):
            got[f"routed+shared as {m[1]} (ms/layer)"] = f"{m[2]} {m[3]}%"
        elif m := OTHER.match(line):
            got[f"DECODE {m[1]}, experts as {m[2]}"] = f"{m[3]} {m[4]}%"
        elif m := LIMIT.match(line):
            got["limit GB/s (min/med/max)"] = f"{m[1]}/{m[2]}/{m[3]}"
        elif m := SHARED.match(line):
            got[f"shared as {m[1]} (ms/layer)"] = f"{m[2]} {m[3]}%"
        elif m := TOTAL.match(line):
            got[f"DECODE at context {m[1]}"] = f"{m[2]} {m[3]}%"
        elif in_table and len(f := line[34:].split()) in (6, 8) and f[0].isdigit():
            ms, of_bw = (f[3], f[6]) if len(f) == 8 else (f[2], f[4])  # 6: no 'of' columns
            got[line[:34].strip()] = f"{ms} {of_bw}"
        in_table = in_table or line.startswith("part (decode")
    return got


def main(argv: list[str]) -> int:
    cols = [a.split("=", 1) for a in argv]
    data = [parse(p) for _, p in cols]
    keys: list[str] = []
    for d in data:
        keys += [k for k in d if k not in keys]
    w = max([len(k) for k in keys] + [20])
    print(f"{'part (ms/token, % of the max probe)':<{w}} " + " ".join(f"{n:>16}" for n, _ in cols))
    for k in keys:
        print(f"{k:<{w}} " + " ".join(f"{d.get(k, '-'):>16}" for d in data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
