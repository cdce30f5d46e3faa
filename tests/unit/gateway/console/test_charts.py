"""The console's figures: the overview's charts (a bar a minute, scaled to the
chart's highest value, the p99 drawn behind its p50, each chart told in
words) and the fleet's routing lately."""

from __future__ import annotations

from gateway.console.charts import (
    HEIGHT,
    WIDTH,
    minute_starts,
    model_charts,
    prefix_hits_by_pool,
    routing_by_model,
)
from workers.usage.ledger import ModelMinute
from workers.usage.requests import RequestRow
from workers.usage.rows import MINUTE_MS

T0 = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE_MS


def minute(at: int, requests: int, *, errors: int = 0, tokens: int = 0,
           p50: float | None = None, p99: float | None = None) -> ModelMinute:
    return ModelMinute(bucket_start_ms=at, requests=requests, errors=errors, prompt_tokens=0,
                       completion_tokens=tokens, ttft_p50_ms=p50, ttft_p99_ms=p99)


def test_the_minutes_end_with_the_current_one() -> None:
    starts = minute_starts(T0 + 59_999, 3)
    assert starts == [T0 - 2 * MINUTE_MS, T0 - MINUTE_MS, T0]


def test_bars_are_scaled_to_the_highest_and_placed_by_their_minute() -> None:
    starts = minute_starts(T0, 4)
    [shown] = model_charts({"m": [minute(starts[1], 60), minute(starts[3], 30)]}, starts,
                           lambda ms: str(ms))
    requests = shown.charts[0]
    assert requests.title == "Requests/s"
    assert [(b.x, b.height) for b in requests.bars] == [(WIDTH / 4, HEIGHT),
                                                        (3 * WIDTH / 4, HEIGHT / 2)]
    assert requests.bars[0].title == f"{starts[1]}: 1 /s"
    assert requests.summary == "Requests/s: last minute 0.5 /s; highest 1 /s"
    assert shown.requests == 90 and shown.errors == 0


def test_the_p99_is_drawn_behind_its_p50_and_a_minute_without_one_has_no_bar() -> None:
    starts = minute_starts(T0, 2)
    [shown] = model_charts({"m": [minute(starts[0], 5, p50=100.0, p99=400.0),
                                  minute(starts[1], 1)]}, starts, str)
    ttft = shown.charts[1]
    assert [b.series for b in ttft.bars] == [1, 0]  # the p99 first, under the p50
    assert [b.height for b in ttft.bars] == [HEIGHT, HEIGHT / 4]
    assert ttft.summary.startswith("Time to first token, p50 and p99: last minute none / none")


def test_the_busiest_model_comes_first_and_errors_are_counted() -> None:
    starts = minute_starts(T0, 1)
    shown = model_charts({"quiet": [minute(T0, 1, errors=1)],
                          "busy": [minute(T0, 9, tokens=120)]}, starts, str)
    assert [m.model for m in shown] == ["busy", "quiet"]
    assert shown[0].charts[2].summary == "Tokens/s: last minute 2 /s; highest 2 /s"
    assert shown[1].errors == 1 and shown[1].charts[3].bars[0].height == HEIGHT


def test_no_model_no_chart() -> None:
    assert model_charts({}, minute_starts(T0, 60), str) == []


def test_routing_lately_counts_each_model_s_outcomes_by_error_code() -> None:
    def row(model: str, status: str = "completed", code: str | None = None,
            first: int | None = 1_100, asked: str = "") -> RequestRow:
        return RequestRow("r", "t", "k", model, "chat", status, 1, 1, 1_000, 2_000, first, code,
                          asked)

    shown = routing_by_model([
        row("a"), row("a", first=1_300, asked="phantom"),
        row("a", "error", "server_overloaded", None),
        row("", "error", "context_length_exceeded", None), row("b")])
    assert [(m.model, m.requests, m.completed) for m in shown] == [("a", 3, 2), ("", 1, 0),
                                                                   ("b", 1, 1)]
    assert shown[0].errors == {"server_overloaded": 1} and shown[0].ttft_p50_ms == 200
    assert shown[0].answered_for == {"phantom": 1} and not shown[2].answered_for
    assert shown[1].ttft_p50_ms is None


def test_prefix_hits_are_summed_over_a_pool_s_live_workers() -> None:
    def worker(pool: str, live: bool, kv: dict[str, int] | None) -> dict[str, object]:
        return {"pool": pool, "live": live, "kv": kv}

    pools = prefix_hits_by_pool([
        worker("gpu", True, {"prefix_queries": 10, "prefix_hits": 4}),
        worker("gpu", True, {"prefix_queries": 30, "prefix_hits": 26}),
        worker("gpu", False, {"prefix_queries": 99, "prefix_hits": 99}),  # gone
        worker("cpu", True, None)])
    assert [(p.pool, p.workers, p.queries, p.hits, p.rate) for p in pools] == [
        ("cpu", 1, 0, 0, None), ("gpu", 2, 40, 30, 0.75)]
