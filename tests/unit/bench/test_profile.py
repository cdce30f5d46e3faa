"""bench.profile's reading of py-spy's stacks and of process names."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from bench.profile import _name, read_stacks, records_line


def test_own_time_goes_to_the_innermost_frame_and_groups_count_whole_stacks(
        tmp_path: Path) -> None:
    raw = tmp_path / "1.txt"
    raw.write_text(
        "main (cli/main.py:3);send (aiokafka/producer/producer.py:9);"
        "write (asyncio/streams.py:12) 7\n"
        "main (cli/main.py:3);encode (schemas/codec.py:40) 3\n"
        "not a stack line\n")
    own, under, total = read_stacks(raw)
    assert total == 10
    assert own == {"write (asyncio/streams.py)": 7, "encode (schemas/codec.py)": 3}
    assert under["aiokafka produce"] == 7 and "avro" not in under
    assert read_stacks(tmp_path / "missing.txt") == ({}, {}, 0)


def test_processes_are_named_by_what_they_run() -> None:
    assert _name(["/venv/bin/python", "/venv/bin/conveyor", "layer", "--x"]) == "conveyor layer"
    assert _name(["/venv/bin/python", "-m", "cli", "infer", "--pool", "cpu"]) == "conveyor infer"
    assert _name(["java", "-cp", "x", "kafka.Kafka", "server.properties"]) == "kafka broker"
    assert _name(["/usr/bin/redis-server", "127.0.0.1:6379"]) == "redis"
    assert _name(["python", "-m", "bench.upstream", "--port", "1"]) == "upstream fixture"


def test_records_a_request_name_each_written_topic_under_the_prefix() -> None:
    written = Counter({"p1.tokens": 20, "p1.replies": 21, "p1.workers": 0,
                       "p1-accounting-changelog": 1})
    assert records_line(written, "p1", 10) == (
        "records a request: accounting-changelog 0.10, replies 2.10, tokens 2.00")
    assert records_line(Counter(), "p1", 10) == "records a request: none"
