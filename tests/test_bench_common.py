"""bench/common.py's clock label (no GPU: the NVML reading is replaced)."""
from bench import common


def test_clock_label_marks_any_move(monkeypatch):
    reads = iter([1980, 1920, 1980, 1980, None, 1980])
    monkeypatch.setattr(common, "sm_clock_mhz", lambda ordinal=0: next(reads))
    assert common.ClockWatch().stop() == "SM clock 1980 -> 1920 MHz  THROTTLED"   # 3%: still a move
    assert common.ClockWatch().stop() == "SM clock 1980 -> 1980 MHz"
    w = common.ClockWatch()
    assert w.stop() == "clock: unknown (no NVML)" and not w.moved
