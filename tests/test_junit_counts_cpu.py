"""scripts/junit_counts.py, which every device check script reads its pytest counts from."""

import importlib.util
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "junit_counts.py"


def _run(path):
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, check=True).stdout


def test_counts_summed_over_suites(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/>'
                   '<testsuite tests="3" failures="0" errors="1" skipped="0"/></testsuites>')
    assert _run(xml).split() == ["8", "1", "1", "2"]
    single = tmp_path / "one.xml"
    single.write_text('<testsuite tests="4" failures="0" errors="0" skipped="0"/>')
    assert _run(single).split() == ["4", "0", "0", "0"]


def test_missing_or_cut_short_file_reads_as_no_counts(tmp_path):
    cut = tmp_path / "cut.xml"
    cut.write_text('<testsuites><testsuite tests="5"')  # pytest stopped while writing it
    for path in (tmp_path / "absent.xml", cut):
        assert _run(path).split()[:4] == ["-1"] * 4
    spec = importlib.util.spec_from_file_location("junit_counts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.KEYS == ("tests", "failures", "errors", "skipped")
