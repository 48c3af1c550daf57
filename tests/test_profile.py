"""runtime/profile.py's pure parts: the timeline's summary."""
from types import SimpleNamespace

from gptcuda.runtime.profile import timeline_summary


def _rec(label, name="k"):
    return SimpleNamespace(label=label, fn=SimpleNamespace(name=name))


def test_timeline_summary_totals_and_labels():
    rows = [(_rec("a"), 0.0, 1.0), (_rec("b"), 1.5, 2.0), (_rec("a"), 2.0, 4.0), (_rec(None, "memset"), 3.9, 4.5)]
    text = timeline_summary(rows, top=2).splitlines()
    # span 4.5, busy 1 + 0.5 + 2 + 0.6, gaps 0.5 (a launch that starts before the last one ended adds none)
    assert text[0].startswith("timeline: 4 launches over 4.500 ms, busy 4.100 ms, gaps 0.500 ms")
    assert text[1].split() == ["3.000", "ms", "2x", "a"]
    assert text[2].split() == ["0.600", "ms", "1x", "memset"]
    assert len(text) == 3
    assert timeline_summary([]) == "timeline: no launches"
