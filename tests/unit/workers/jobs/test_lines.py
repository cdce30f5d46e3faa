"""Checking a batch input file: every line, before any runs."""

from __future__ import annotations

import json
from typing import Any

from workers.jobs.files import parse_lines

CHAT = "/v1/chat/completions"


def line(custom_id: str = "a", **overrides: Any) -> str:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "smollm2", "max_tokens": 4,
                     "messages": [{"role": "user", "content": "Hi"}]}}
    item.update(overrides)
    return json.dumps(item)


def parse(*lines: str, endpoint: str = CHAT, max_lines: int = 100) -> Any:
    return parse_lines("\n".join(lines).encode(), endpoint, max_lines)


def test_good_lines_become_generations_in_order() -> None:
    lines, errors = parse(line("x"), "", line("y"))
    assert errors == []
    assert [(ln.index, ln.custom_id) for ln in lines] == [(0, "x"), (1, "y")]
    assert lines[0].generation["kind"] == "chat"
    assert lines[0].generation["sampling"]["max_tokens"] == 4
    assert lines[0].generation["stream"] is False


def test_completions_lines() -> None:
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "smollm2", "prompt": "Once", "max_tokens": 3}})
    lines, errors = parse(raw, endpoint="/v1/completions")
    assert errors == [] and lines[0].generation["prompt"] == "Once"


def test_every_bad_line_is_named_and_nothing_runs() -> None:
    lines, errors = parse(line("a"), "not json", line("a"), line("b", method="GET"),
                          line("c", url="/v1/completions"), line("d", body=[1]),
                          line("e", body={"model": "smollm2", "messages": [], "n": 2}),
                          line("f", body={"model": "smollm2", "stream": True,
                                          "messages": [{"role": "user", "content": "x"}]}))
    assert lines == []
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_method"),
        (5, "mismatched_url"), (6, "invalid_request"), (7, "invalid_request"),
        (8, "invalid_request")]
    assert errors[5]["param"].startswith("body")
    assert errors[6]["param"] == "body.stream"


def test_file_level_problems() -> None:
    assert parse_lines(b"\xff\xfe", CHAT, 10)[1][0]["code"] == "invalid_file"
    assert parse_lines(b"\n\n", CHAT, 10)[1][0]["code"] == "empty_file"
    too_many = "\n".join(line(str(i)) for i in range(3)).encode()
    assert parse_lines(too_many, CHAT, 2)[1][0]["code"] == "too_many_requests"


def test_a_line_asking_for_several_choices_is_refused_naming_n() -> None:
    body = {"model": "smollm2", "n": 2, "messages": [{"role": "user", "content": "x"}]}
    lines, errors = parse(line("a"), line("b", body=body))
    assert lines == [] and [(e["line"], e["param"]) for e in errors] == [(2, "body.n")]


def test_a_bad_body_is_worded_as_the_http_route_words_it() -> None:
    """The most telling of a line's validation errors (the union branch that got
    furthest), in the words a request sent alone would get, naming its param."""
    content = [{"type": "text", "text": "ok"}, {"type": "text", "text": 5}]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}]}
    _, errors = parse(line("a", body=body))
    assert errors == [{"code": "invalid_request", "line": 1, "param":
                       "body.messages[0].content[1].text", "message":
                       "Input should be a valid string (messages[0].content[1].text)"}]


def test_a_line_with_an_image_is_refused_naming_the_part() -> None:
    """Only POST /v1/chat/completions reads and stores images."""
    content = [{"type": "text", "text": "ok"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}]}
    lines, errors = parse(line("a", body=body))
    assert lines == []
    assert [(e["line"], e["param"]) for e in errors] == [(1, "body.messages[0].content[1]")]
    assert "POST /v1/chat/completions only" in errors[0]["message"]
