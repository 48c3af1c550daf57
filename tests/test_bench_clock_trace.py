"""bench/clock_trace.py: nvidia-smi samples cut at a script's marks (no GPU: the lines are made here)."""
from bench import clock_trace as ct

SMI = """2026/12/04 21:00:00.000, 1980, 350.10, 40, 0x0000000000000000
2026/12/04 21:00:00.050, 1980, 690.00, 45, 0x0000000000000000
2026/12/04 21:00:00.100, 1590, 699.90, 52, 0x0000000000000004
2026/12/04 21:00:00.150, 1620, 700.20, 55, 0x0000000000000004
[N/A], garbage line
2026/12/04 21:00:00.200, 1980, 500.00, 50, 0x0000000000000001
2026/12/04 21:00:00.250, 1755, 680.00, 61, 0x0000000000000024
"""
MARKS = """MARK 2026/12/04 21:00:00.040 ours_start
MARK 2026/12/04 21:00:00.160 ours_end
something else printed by the script
MARK 2026/12/04 21:00:00.240 torch_start
MARK 2026/12/04 21:00:00.260 torch_end
MARK 2026/12/04 21:00:00.300 empty_start
MARK 2026/12/04 21:00:00.310 empty_end
MARK 2026/12/04 21:00:00.400 unended_start
"""


def test_phases_cut_samples_at_marks():
    samples = ct.read_samples(SMI.splitlines())
    assert len(samples) == 6                                   # the malformed line is skipped
    phases = ct.read_phases(MARKS.splitlines())
    assert [p[0] for p in phases] == ["ours", "torch", "empty"]   # an unended phase is not reported
    ours, torch, empty = ct.summary(samples, phases)
    assert "3 samples" in ours and "median   1620 min   1590 MHz" in ours and "max   700 W" in ours
    assert ours.endswith("reasons: SW power cap")
    assert "1 samples" in torch and "temp max  61 C" in torch and "SW power cap, SW thermal" in torch
    assert "no samples" in empty


def test_reason_bits_decoded():
    assert ct.reasons(0) == []
    assert ct.reasons(0x4 | 0x40) == ["SW power cap", "HW thermal"]
    assert ct.reasons(0x1000) == ["0x1000"]


def test_usage_line(capsys):
    assert ct.main([]) == 2
    assert "usage" in capsys.readouterr().err
