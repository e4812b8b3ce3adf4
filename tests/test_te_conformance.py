"""benchmarks/te_conformance.py: junit parsing and failure-family grouping (no TE checkout needed)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import te_conformance as tc  # noqa: E402

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test_a" name="test_ok" />
<testcase classname="test_a" name="test_cuda[3]"><failure message="AssertionError: Torch not compiled">
x = 1
E   AssertionError: Torch not compiled with CUDA enabled
</failure></testcase>
<testcase classname="test_a" name="test_cuda[7]">
<error message="failed on setup with &quot;ValueError: shape (16, 32) at /tmp/x/y.py:12&quot;" /></testcase>
<testcase classname="test_a" name="test_skip"><skipped message="needs CUDA" /></testcase>
<testcase classname="" name="test_b"><error message="collection failure">
E   ModuleNotFoundError: No module named 'transformer_engine.pytorch.foo'
</error></testcase>
</testsuite></testsuites>"""


def test_parse_and_group(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(XML)
    res = tc.parse_junit(path)
    assert (res["collected"], res["passed"], res["failed"], res["errors"], res["skipped"]) == (5, 1, 1, 2, 1)
    assert res["needs_cuda"] == 1  # the CUDA assertion: of the 3 not skipped, 2 are the package's
    assert tc.pct_run(res) == "33.3"
    res["file"] = "test_a.py"
    summ = tc.summarise([res])
    fams = {f["family"]: f["count"] for f in summ["families"]}
    assert fams == {"AssertionError: Torch not compiled with CUDA enabled": 1,
                    "ValueError: shape <shape> at <path>\"": 1,
                    "ModuleNotFoundError: No module named 'transformer_engine.pytorch.foo'": 1}
    assert summ["totals"]["collected"] == 5 and tc.pct(summ["totals"]) == "20.0"


def test_family_strips_numbers_and_addresses():
    assert tc.family("RuntimeError: bad size 128 vs 4.5e-3 at 0xdeadbeef") == "RuntimeError: bad size N vs N at <addr>"
    assert tc.family("TypeError: got torch.bfloat16\nmore") == "TypeError: got <dtype>"
    # modules' default names (one family, not one per instance)
    assert tc.family("TypeError: grouped_linear_60: bad") == tc.family("TypeError: grouped_linear_7: bad") \
        == "TypeError: grouped_linear_N: bad"
