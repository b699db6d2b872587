"""Which skipped tests a GPU proof run may accept (bench/gpu/run.sh).

On the GPU machine every CUDA test must run: a test that skips because it sees
no device (a driver / runtime mismatch makes cuda_device_available() false, and
every CUDA test would skip "successfully") is a failure, and so is any skip
whose reason is not listed below. Only skips that are right on one GPU pass.

    python bench/gpu/skip_policy.py --mode gpu  REPORT.xml [REPORT.xml ...]
    python bench/gpu/skip_policy.py --mode sim  REPORT.xml     # the dry run's sim tests: no skip allowed
    python bench/gpu/skip_policy.py --self-test                # checks these rules (the dry run runs it)

REPORT.xml: JUnit XML as GoogleTest (--gtest_output=xml:FILE) and pytest
(--junitxml=FILE) write it; a skipped test is a <testcase> with a <skipped>
child whose message (and text) carry the skip reason. Prints one line per
unexpected skip and a summary; exit status 0 when every skip is expected and
at least one test ran, 1 otherwise, 2 on unreadable input.
"""
from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET

# Skip reasons that are right on a machine with exactly one GPU, as regular
# expressions searched in the skip message. Everything else is unexpected.
EXPECTED_ON_ONE_GPU = [
    r"needs two CUDA devices",                      # test_cuda_backend, test_cuda_dequant: multi-GPU
    r"a CUDA device is visible; the no-device path",  # test_cuda_backend: the no-device error path
    r"runs only without a device",                  # test_cuda_dequant: the CPU-only stand-in
]
# Reasons that say the device was not usable: always a failure on the GPU machine,
# named as such in the output (they are the reason this policy exists).
NO_DEVICE = re.compile(r"no CUDA device|CUDA.*not available|no GPU|cuda_device_available", re.I)

POLICIES = {"gpu": EXPECTED_ON_ONE_GPU, "sim": []}


def skipped_tests(xml_text: str):
    """(tests run, [(test id, skip reason), ...]) of one JUnit XML report."""
    root = ET.fromstring(xml_text)
    cases = list(root.iter("testcase"))
    skips = []
    for case in cases:
        node = case.find("skipped")
        if node is None:
            continue
        name = ".".join(x for x in (case.get("classname"), case.get("name")) if x)
        reason = " ".join(filter(None, [node.get("message"), (node.text or "").strip()]))
        skips.append((name, " ".join(reason.split())))
    return len(cases), skips


def classify(skips, mode: str):
    """The unexpected ones of `skips` under policy `mode`, as (test, reason, why)."""
    allowed = [re.compile(p) for p in POLICIES[mode]]
    bad = []
    for name, reason in skips:
        if NO_DEVICE.search(reason) and mode == "gpu":
            bad.append((name, reason, "the GPU was not usable"))
        elif not any(p.search(reason) for p in allowed):
            bad.append((name, reason, "not an expected skip reason" if reason else "skipped without a reason"))
    return bad


def check(reports, mode: str, out=sys.stdout) -> int:
    total, unexpected, n_skips = 0, [], 0
    for path in reports:
        try:
            with open(path) as f:
                ran, skips = skipped_tests(f.read())
        except (OSError, ET.ParseError) as e:
            print(f"skip policy: cannot read {path}: {e}", file=out)
            return 2
        total += ran
        n_skips += len(skips)
        unexpected += [(path, *b) for b in classify(skips, mode)]
    for path, name, reason, why in unexpected:
        print(f"skip policy ({mode}): UNEXPECTED SKIP {name} in {path}: {why}: {reason!r}", file=out)
    if total == 0:
        print(f"skip policy ({mode}): no test ran in {', '.join(reports)}", file=out)
        return 1
    print(f"skip policy ({mode}): {total} tests, {n_skips} skipped, {len(unexpected)} unexpected", file=out)
    return 1 if unexpected else 0


# ---- self-test: the rules above on hand-written reports (GoogleTest and pytest forms)
_GTEST = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="3" failures="0" disabled="0" errors="0" name="AllTests">
  <testsuite name="CudaBackend" tests="3" failures="0" disabled="0" skipped="{n}" errors="0">
    <testcase name="Streams" status="run" result="{r1}" classname="CudaBackend">{s1}</testcase>
    <testcase name="TwoDevices" status="run" result="skipped" classname="CudaBackend">
      <skipped message="test_cuda_backend.cpp:607&#x0A;needs two CUDA devices"><![CDATA[test_cuda_backend.cpp:607
needs two CUDA devices]]></skipped>
    </testcase>
    <testcase name="Copies" status="run" result="completed" classname="CudaBackend" />
  </testsuite>
</testsuites>
"""
_NO_DEVICE = ('<skipped message="test_cuda_backend.cpp:29&#x0A;no CUDA device visible">'
              '<![CDATA[test_cuda_backend.cpp:29\nno CUDA device visible]]></skipped>')
_PYTEST = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2" skipped="{n}">
<testcase classname="tests.python.test_parity_layers" name="test_linear_fp16[2d-bias]">{s}</testcase>
<testcase classname="tests.python.test_parity_layers" name="test_linear_bf16[2d-bias]" />
</testsuite></testsuites>"""
_PY_SKIP = ('<skipped type="pytest.skip" message="fp16 linear not supported on this device">'
            'test_parity_layers.py:180: fp16 linear not supported on this device</skipped>')


def self_test() -> int:
    def unexpected(xml_text, mode):
        return classify(skipped_tests(xml_text)[1], mode)

    cases = [
        # (what, report, mode, number of unexpected skips)
        ("GPU run, only the multi-GPU skip", _GTEST.format(n=1, r1="completed", s1=""), "gpu", 0),
        ("GPU run, a no-device skip", _GTEST.format(n=2, r1="skipped", s1=_NO_DEVICE), "gpu", 1),
        ("sim run, any skip", _GTEST.format(n=1, r1="completed", s1=""), "sim", 1),
        ("pytest on the GPU, no skip", _PYTEST.format(n=0, s=""), "gpu", 0),
        ("pytest on the GPU, an fp16 skip", _PYTEST.format(n=1, s=_PY_SKIP), "gpu", 1),
        ("a skip without a reason", _PYTEST.format(n=1, s="<skipped />"), "gpu", 1),
    ]
    failed = 0
    for what, report, mode, want in cases:
        got = len(unexpected(report, mode))
        ok = got == want
        failed += not ok
        print(f"skip policy self-test: {'ok  ' if ok else 'FAIL'} {what}: {got} unexpected (want {want})")
    # the no-device skip is named as such
    bad = unexpected(_GTEST.format(n=2, r1="skipped", s1=_NO_DEVICE), "gpu")
    if not bad or bad[0][2] != "the GPU was not usable":
        print("skip policy self-test: FAIL a no-device skip is not reported as an unusable GPU")
        failed += 1
    # an empty report (nothing ran) fails
    import io
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "empty.xml")
        with open(p, "w") as f:
            f.write('<testsuites tests="0"></testsuites>')
        if check([p], "gpu", out=io.StringIO()) != 1:
            print("skip policy self-test: FAIL a report with no test passes")
            failed += 1
    print(f"skip policy self-test: {'passed' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(POLICIES), default="gpu")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("reports", nargs="*")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.reports:
        ap.error("no report given")
    return check(args.reports, args.mode)


if __name__ == "__main__":
    sys.exit(main())
