"""bench.wake's loopback probe and its report."""

from __future__ import annotations

from bench.wake import echo_server, report, tcp_probes


def test_the_echo_process_answers_each_round_trip_on_fresh_connections() -> None:
    with echo_server() as port:
        first = tcp_probes(port, 5, 0.0)
        second = tcp_probes(port, 3, 0.001)  # a second connection: the echo serves again
    assert len(first) == 5 and len(second) == 3
    assert all(0 < ms < 1000 for ms in first + second)


def test_the_report_has_a_row_a_pause_and_the_hop_against_back_to_back() -> None:
    samples = {("tcp", 0.0): [0.05, 0.05], ("ack", 0.0): [0.6, 0.6], ("hop", 0.0): [0.8, 0.8],
               ("tcp", 20.0): [0.1, 0.1], ("ack", 20.0): [1.4, 1.4], ("hop", 20.0): [1.6, 1.6]}
    table = report(samples, [0.0, 20.0]).splitlines()
    assert len(table) == 4  # header, rule, two pauses
    assert table[2].startswith("| 0 ms") and "0.80 / 0.80" in table[2] and "1.00x" in table[2]
    assert table[3].startswith("| 20 ms") and "1.40 / 1.40" in table[3] and "2.00x" in table[3]
