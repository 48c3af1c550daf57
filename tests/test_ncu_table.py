"""bench/ncu_table.py on a trimmed Nsight Compute details page (tests/fixtures/ncu_details_sample.txt: three
launches of a GPT-2 B8 bf16 step on the H200, two of one GEMM kernel)."""
import os

import pytest

from bench import ncu_table

SAMPLE = os.path.join(os.path.dirname(__file__), "fixtures", "ncu_details_sample.txt")


def test_parse_reads_each_launch():
    launches = ncu_table.parse(open(SAMPLE).read())
    assert [r["name"] for r in launches] == ["flash_fwd_bf16<64,0,384,128,128,2,82944>"] + \
        ["gemm_wgmma_ws<256,128,4,2,1,640,197632,1,0,0,1,0>"] * 2
    fwd = launches[0]
    assert fwd["us"] == pytest.approx(64.0) and fwd["MHz"] == pytest.approx(1776.6, abs=0.1)
    assert (fwd["sm%"], fwd["mem%"], fwd["l2%"], fwd["dram%"], fwd["issue%"]) == (31.95, 24.22, 34.03, 14.44, 31.95)
    assert (fwd["warps"], fwd["elig"], fwd["pipe"]) == (2.18, 0.50, "ALU 30%")
    assert all(0 < r["us"] < 200 and 1000 < r["MHz"] < 2000 for r in launches)


def test_table_groups_a_kernels_launches():
    rows = ncu_table.table(ncu_table.parse(open(SAMPLE).read())).splitlines()
    assert rows[0].split()[:3] == ["kernel", "n", "us"]
    gemm = next(r for r in rows if r.startswith("gemm_wgmma_ws"))
    assert gemm.split()[1] == "2"
    assert len(ncu_table.table(ncu_table.parse(open(SAMPLE).read()), by_launch=True).splitlines()) == 4


def test_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="No such file"):
        ncu_table.main([str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no kernel launches"):
        ncu_table.main([str(empty)])
