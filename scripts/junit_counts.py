"""Counts of a pytest JUnit XML file, for the device check scripts:
``python3 scripts/junit_counts.py FILE`` prints ``tests failures errors skipped`` summed over its
test suites, or ``-1 -1 -1 -1 (why)`` when the file is missing or cut short (pytest stopped by a
time limit): a script reads the first four words and treats -1 as a failed check."""

import sys
import xml.etree.ElementTree as ET

KEYS = ("tests", "failures", "errors", "skipped")


def counts(path):
    """(tests, failures, errors, skipped) of the JUnit file at ``path``; raises on an unreadable one."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return tuple(sum(int(s.get(k, 0)) for s in suites) for k in KEYS)


def main(argv):
    try:
        print(*counts(argv[1]))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is "no counts"
        print(f"-1 -1 -1 -1 ({type(exc).__name__})")


if __name__ == "__main__":
    main(sys.argv)
