#!/usr/bin/env python3
"""Prints where a test run's time went, from nextest's JUnit report: the
slowest tests, and the test binaries by the sum of their tests' times.
  usage: scripts/test-times.py JUNIT.xml [N]"""
import collections
import sys
import xml.etree.ElementTree as ET

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
cases = []
for suite in ET.parse(path).getroot().iter("testsuite"):
    for case in suite.iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        cases.append((float(case.get("time", 0)), suite.get("name"), case.get("name"), failed))
if not cases:
    sys.exit(0)
print(f"\n== slowest tests (of {len(cases)})")
for t, binary, name, failed in sorted(cases, reverse=True)[:n]:
    print(f"{t:6.0f}s  {binary} {name}{'  FAILED' if failed else ''}")
per_binary = collections.Counter()
for t, binary, _, _ in cases:
    per_binary[binary] += t
print("\n== slowest test binaries (sum of their tests)")
for binary, t in per_binary.most_common(n):
    print(f"{t:6.0f}s  {binary}")
