"""conveyor up copies a child's stderr as it comes and keeps its last lines for the
report of its death, a last line without an end included."""

from __future__ import annotations

import sys

import pytest

from cli.supervise import Child

_SCRIPT = (
    "import sys\n"
    "for i in range(20): sys.stderr.write(f'line {i}\\n')\n"
    "sys.stderr.flush()\n"
    "sys.stderr.write('x' * 70000 + '\\n')\n"
    "sys.stderr.write('the end, no newline')\n"
)


def test_stderr_is_forwarded_whole_and_its_last_lines_kept(
        capfdbinary: pytest.CaptureFixture[bytes]) -> None:
    child = Child("demo", [sys.executable, "-c", _SCRIPT])
    child.start()
    assert child.proc is not None
    child.proc.wait(timeout=30)
    assert child.reap() == "exited with code 0"
    forwarded = capfdbinary.readouterr().err
    expected = "".join(f"line {i}\n" for i in range(20)) + "x" * 70000 + "\nthe end, no newline"
    assert forwarded == expected.encode()
    tail = list(child.stderr_tail)
    assert tail[-1] == "the end, no newline"
    assert tail[-2] == "x" * 70000
    assert tail[:-2] == [f"line {i}" for i in range(14, 20)]
