"""``conveyor layer`` stops when told to: SIGTERM ends it within seconds.

It used to wait for every task it runs to end, and the cancel follower never
ends on its own: the process outlived every SIGTERM until it was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

from tests.support.pipeline import ROOT, TEST_MODELS, drop_topics


def test_sigterm_stops_the_layers_within_seconds(services: None, tmp_path: object) -> None:
    env = {**os.environ, "CONVEYOR_TOPIC_PREFIX": f"t{uuid.uuid4().hex[:10]}",
           "CONVEYOR_MODELS_FILE": str(TEST_MODELS)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "layer"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        seen = ""
        assert proc.stdout is not None
        while time.monotonic() < deadline and seen.count(": consuming ") < 6:
            seen += proc.stdout.readline()
        assert seen.count(": consuming ") >= 6, seen
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        drop_topics(os.environ.get("CONVEYOR_KAFKA_BOOTSTRAP", "127.0.0.1:9092"),
                    env["CONVEYOR_TOPIC_PREFIX"])
