"""One line per kernel of an Nsight Compute details page (bench/profile_step.sh's profile_<case>.txt).

    python bench/ncu_table.py out/device/profile_gpt2_b8_bf16.txt [--by launch]

A kernel's launches are grouped by name with their template arguments (the parameter list dropped); a row
holds the launches, the median duration (us) and SM clock (MHz), and the medians of the sections
profile_step.sh collects: compute (SM) and memory throughput, L2 and DRAM throughput (% of peak), issue
slots busy (%), the warps active and eligible a scheduler, and the busiest pipeline the report names.
--by launch: every launch in order instead. Metrics a report lacks show as "-".
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys

# metric name in the details page -> column; the units the page prints with --print-units base
METRICS = {"Duration": "us", "SM Frequency": "MHz", "Compute (SM) Throughput": "sm%", "Memory Throughput": "mem%",
           "L2 Cache Throughput": "l2%", "DRAM Throughput": "dram%", "Issue Slots Busy": "issue%",
           "Active Warps Per Scheduler": "warps", "Eligible Warps Per Scheduler": "elig"}
SCALE = {"us": 1e-3, "MHz": 1e-6}                 # ns -> us, Hz -> MHz
_HEADER = re.compile(r"^  (?:void )?([A-Za-z_][\w:]*(?:<[^()]*>)?)\(.*\) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+)?\s+([-\d.,]+)$")
_PIPE = re.compile(r"^\s+\w+\s+(\w[\w ]*?) is the highest-utilized pipeline \(([\d.]+)%\)")


def parse(text: str) -> list:
    """[{"name", column: value, "pipe"}] of the page's launches, in order (values per METRICS / SCALE)."""
    out, cur = [], None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            cur = {"name": re.sub(r"\s+", "", m.group(1))}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _METRIC.match(line)
        if m and m.group(1).strip() in METRICS and METRICS[m.group(1).strip()] not in cur:
            col = METRICS[m.group(1).strip()]
            cur[col] = float(m.group(3).replace(",", "")) * SCALE.get(col, 1.0)
            continue
        m = _PIPE.match(line)
        if m and "pipe" not in cur:
            cur["pipe"] = f"{m.group(1)} {float(m.group(2)):.0f}%"
    return out


def table(launches: list, by_launch: bool = False) -> str:
    cols = list(METRICS.values())
    if by_launch:
        rows = [(r["name"], 1, r) for r in launches]
    else:
        groups: dict = {}
        for r in launches:
            groups.setdefault(r["name"], []).append(r)
        rows = []
        for name, rs in groups.items():
            med = {c: statistics.median(v) for c in cols if (v := [r[c] for r in rs if c in r])}
            med["pipe"] = rs[0].get("pipe", "")
            rows.append((name, len(rs), med))
        rows.sort(key=lambda x: -x[1] * x[2].get("us", 0.0))
    width = max([len(n) for n, _, _ in rows] + [6])
    head = f"{'kernel':<{width}} {'n':>3} " + " ".join(f"{c:>7}" for c in cols) + "  busiest pipe"
    lines = [head]
    for name, n, r in rows:
        vals = " ".join(f"{r[c]:7.1f}" if c in r else f"{'-':>7}" for c in cols)
        lines.append(f"{name:<{width}} {n:>3} {vals}  {r.get('pipe', '')}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("details")
    ap.add_argument("--by", choices=("kernel", "launch"), default="kernel")
    a = ap.parse_args(argv)
    try:
        text = open(a.details, encoding="utf-8", errors="replace").read()
    except OSError as e:
        sys.exit(f"ncu_table: {e.strerror}: {a.details}")
    launches = parse(text)
    if not launches:
        sys.exit(f"ncu_table: no kernel launches in {a.details} (an `ncu -i REPORT --page details` page?)")
    print(table(launches, a.by == "launch"))


if __name__ == "__main__":
    main()
