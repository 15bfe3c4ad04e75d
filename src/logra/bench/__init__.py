"""Benchmarks behind `logra bench <name>`: each module has `main(argv)` and prints tables."""

from __future__ import annotations

import os
import subprocess
import sys


def relay(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` in a fresh interpreter, relaying its output line by line to our stderr.

    The table a benchmark prints on stdout stays clean while progress stays visible.
    Returns the exit code and the last non-empty line (the error, if it failed).
    """
    last = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stderr.write(line)
            sys.stderr.flush()
            last = line.strip() or last
    return proc.returncode, last
