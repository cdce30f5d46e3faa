"""The engines table: the flags each engine adds, the engine each factory
makes, and the flags ``conveyor up`` hands on to its workers."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.registry import Registry
from workers.infer.engines.scripted import DEFAULT_TEXT, ScriptedEngine
from workers.infer.engines.table import (
    ENGINES,
    EngineFlags,
    EngineSetupError,
    add_engine_flags,
    engine_argv,
    engine_named,
)

REGISTRY = Registry.load(Path("conveyor/models.toml"))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", default="cpu")
    add_engine_flags(parser)
    return parser.parse_args(argv)


def test_every_engine_is_declared_once() -> None:
    names = [e.name for e in ENGINES]
    assert sorted(names) == sorted(set(names)) == ["llamacpp", "openai", "scripted", "vllm"]
    assert parse().engine == "llamacpp"
    # the batching engine's former name is the one llama.cpp engine
    assert parse("--engine", "llamacpp-batch").engine == "llamacpp"
    assert engine_named("llamacpp-batch") is engine_named("llamacpp")
    with pytest.raises(SystemExit):
        parse("--engine", "nope")
    with pytest.raises(EngineSetupError, match="unknown engine"):
        engine_named("nope")


def test_building_the_flags_loads_no_engine_library() -> None:
    # only a factory imports its engine: every conveyor command builds the flags
    check = ("import argparse, sys\n"
             "from workers.infer.engines.table import add_engine_flags\n"
             "add_engine_flags(argparse.ArgumentParser())\n"
             "print(sorted({'llama_cpp', 'aiohttp', 'vllm', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_a_flag_two_engines_read_is_added_once_with_both_helps() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    contexts = next(a for a in parser._actions if "--contexts" in a.option_strings)

    assert contexts.help is not None
    assert contexts.help.startswith("llamacpp: ") and "; scripted: " in contexts.help
    assert parse("--contexts", "3").contexts == 3
    with pytest.raises(SystemExit):
        parse("--contexts", "0")


def test_two_engines_must_declare_a_shared_flag_alike() -> None:
    flags = EngineFlags(argparse.ArgumentParser())
    flags.engine = "one"
    flags.add("--slots", type=int, default=2, help="slots")
    flags.engine = "two"
    with pytest.raises(ValueError, match="two declares --slots unlike"):
        flags.add("--slots", type=int, default=4, help="slots")


def test_the_scripted_engine_from_its_flags() -> None:
    engine = engine_named("scripted").make(
        parse("--engine", "scripted", "--contexts", "3", "--token-delay-ms", "2.5"), REGISTRY)

    assert isinstance(engine, ScriptedEngine)
    assert (engine.script, engine.capacity, engine.token_delay_s) == ("echo", 3, 0.0025)
    fixed = engine_named("scripted").make(parse("--script-text", "Hi there."), REGISTRY)
    assert isinstance(fixed, ScriptedEngine)
    assert (fixed.script, fixed.text, fixed.capacity) == ("text", "Hi there.", 2)
    default = engine_named("scripted").make(parse("--script", "text"), REGISTRY)
    assert isinstance(default, ScriptedEngine) and default.text == DEFAULT_TEXT
    counting = engine_named("scripted").make(parse("--script", "count"), REGISTRY)
    assert isinstance(counting, ScriptedEngine) and counting.script == "count"
    with pytest.raises(EngineSetupError, match="--script-text"):
        engine_named("scripted").make(parse("--script", "echo", "--script-text", "x"), REGISTRY)
    with pytest.raises(SystemExit):
        parse("--token-delay-ms", "-1")


def test_factories_say_what_is_missing() -> None:
    with pytest.raises(EngineSetupError, match="--engine openai needs --upstream URL"):
        engine_named("openai").make(parse("--engine", "openai"), REGISTRY)
    if importlib.util.find_spec("vllm") is None:  # .venv; tests/vllm makes the engine
        with pytest.raises(EngineSetupError, match="run bash infra/vllm.sh"):
            engine_named("vllm").make(parse("--engine", "vllm"), REGISTRY)
    with pytest.raises(EngineSetupError, match="no model with a gguf file in pool 'gpu'"):
        engine_named("llamacpp").make(parse("--pool", "gpu"), REGISTRY)


def test_the_openai_engine_from_its_flags() -> None:
    from workers.infer.engines.openai_http import OpenAIHttpEngine

    engine = engine_named("openai").make(
        parse("--engine", "openai", "--upstream", "http://127.0.0.1:9/", "--capacity", "5"),
        REGISTRY)

    assert isinstance(engine, OpenAIHttpEngine)
    assert (engine.base_url, engine.capacity, engine.cache_salt) == ("http://127.0.0.1:9", 5, True)
    quiet = engine_named("openai").make(
        parse("--engine", "openai", "--upstream", "http://127.0.0.1:9/",
              "--no-upstream-cache-salt"), REGISTRY)
    assert isinstance(quiet, OpenAIHttpEngine) and quiet.cache_salt is False


def test_up_hands_on_the_engine_flags_it_was_given() -> None:
    given = parse("--engine", "scripted", "--contexts", "3", "--script-text", "-dash first",
                  "--token-delay-ms", "2.5")
    argv = engine_argv(given)

    assert argv == ["--contexts=3", "--script-text=-dash first", "--token-delay-ms=2.5"]
    again = parse("--engine", "scripted", *argv)
    assert vars(again) == vars(given)
    assert engine_argv(parse()) == []
    assert engine_argv(parse("--upstream", "http://u", "--threads", "2")) == [
        "--threads=2", "--upstream=http://u"]
