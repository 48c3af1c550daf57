"""The SM clock and board power through the phases of a device call: nvidia-smi's samples (a background
`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
--format=csv,noheader,nounits -lms 50 > smi.csv`) cut at the marks a script wrote (`mark NAME` lines: a
timestamp in nvidia-smi's format, then NAME_start or NAME_end), one line a phase: the samples' SM clock
(median, min), power (median, max), the hottest temperature and the clock event reasons seen (the bits
of nvmlClocksEventReasons, decoded). Read only: it tells whether a row's clock fell because the board hit
its power limit (SW power cap) or its temperature (thermal slowdown), and whether PyTorch's step, timed in
the same call, ran at the clock ours did.

    python3 bench/clock_trace.py smi.csv marks.txt
"""
from __future__ import annotations

import statistics
import sys
from datetime import datetime

# nvmlClocksEventReasons bits (nvml.h)
REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}
FMT = "%Y/%m/%d %H:%M:%S.%f"


def reasons(mask: int) -> list:
    """The names of the bits set in an event-reasons mask (unknown bits as hex)."""
    out = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return out + ([hex(rest)] if rest else [])


def read_samples(lines) -> list:
    """(time, clock MHz, power W, temperature C, reasons mask) of each well-formed sample line."""
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) < 5:
            continue
        try:
            mask = int(f[4], 16) if f[4].lower().startswith("0x") else int(f[4])
            out.append((datetime.strptime(f[0], FMT), float(f[1]), float(f[2]), float(f[3]), mask))
        except ValueError:
            continue
    return out


def read_phases(lines) -> list:
    """(name, start, end) of each NAME_start ... NAME_end pair of `mark` lines, in the order they began."""
    starts, phases = {}, []
    for line in lines:
        parts = line.split()
        if len(parts) < 4 or parts[0] != "MARK":
            continue
        t, tag = datetime.strptime(parts[1] + " " + parts[2], FMT), parts[3]
        if tag.endswith("_start"):
            starts[tag[:-6]] = t
        elif tag.endswith("_end") and tag[:-4] in starts:
            phases.append((tag[:-4], starts.pop(tag[:-4]), t))
    return phases


def summary(samples, phases) -> list:
    """One line a phase: its samples' clock, power, temperature and event reasons."""
    out = []
    for name, t0, t1 in phases:
        s = [x for x in samples if t0 <= x[0] <= t1]
        if not s:
            out.append(f"{name:<16} {(t1 - t0).total_seconds():7.1f} s  no samples")
            continue
        mask = 0
        for x in s:
            mask |= x[4]
        clocks, power = [x[1] for x in s], [x[2] for x in s]
        out.append(f"{name:<16} {(t1 - t0).total_seconds():7.1f} s  {len(s):5d} samples  SM clock median "
                   f"{statistics.median(clocks):6.0f} min {min(clocks):6.0f} MHz  power median "
                   f"{statistics.median(power):5.0f} max {max(power):5.0f} W  temp max {max(x[3] for x in s):3.0f} C"
                   f"  reasons: {', '.join(reasons(mask)) or 'none'}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python3 bench/clock_trace.py SMI_CSV MARKS", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        samples = read_samples(f)
    with open(argv[1]) as f:
        phases = read_phases(f)
    for line in summary(samples, phases):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
