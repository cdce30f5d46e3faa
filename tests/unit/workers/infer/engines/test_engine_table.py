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
from conveyor.settings import load_settings
from workers.infer.engines.scripted import DEFAULT_TEXT, ScriptedEngine
from workers.infer.engines.table import ENGINES, EngineOptions, EngineSetupError, engine_named

REGISTRY = Registry.load(Path("conveyor/models.toml"))
SETTINGS = load_settings()


def parse(*argv: str) -> EngineOptions:
    parser = argparse.ArgumentParser()
    EngineOptions.add_flags(parser)
    return EngineOptions.from_args(parser.parse_args(argv))


def test_every_engine_is_declared_once() -> None:
    names = [e.name for e in ENGINES]
    assert sorted(names) == sorted(set(names)) == ["encoder", "llamacpp", "openai",
                                                     "scripted", "vllm"]
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
             "from workers.infer.engines.table import EngineOptions\n"
             "EngineOptions.add_flags(argparse.ArgumentParser())\n"
             "print(sorted({'llama_cpp', 'aiohttp', 'vllm', 'numpy'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_an_option_two_engines_read_is_one_flag_with_both_helps() -> None:
    parser = argparse.ArgumentParser()
    EngineOptions.add_flags(parser)
    contexts = next(a for a in parser._actions if "--contexts" in a.option_strings)

    assert contexts.help is not None
    assert contexts.help.startswith("llamacpp: ") and "; scripted: " in contexts.help
    assert parse("--contexts", "3").contexts == 3
    with pytest.raises(SystemExit):
        parse("--contexts", "0")
    assert EngineOptions.readers("contexts") == ("llamacpp", "vllm", "scripted", "encoder")
    assert EngineOptions.readers("pool") is None  # every engine


def test_an_option_the_engine_does_not_read_is_refused() -> None:
    with pytest.raises(EngineSetupError, match="--engine scripted reads no --batches, --upstream"):
        parse("--engine", "scripted", "--batches", "3", "--upstream", "http://u").make(
            REGISTRY, SETTINGS)


def test_the_scripted_engine_from_its_flags() -> None:
    engine = parse("--engine", "scripted", "--contexts", "3",
                   "--token-delay-ms", "2.5").make(REGISTRY, SETTINGS)

    assert isinstance(engine, ScriptedEngine)
    assert (engine.script, engine.capacity, engine.token_delay_s) == ("echo", 3, 0.0025)
    fixed = parse("--engine", "scripted", "--script-text", "Hi there.").make(REGISTRY, SETTINGS)
    assert isinstance(fixed, ScriptedEngine)
    assert (fixed.script, fixed.text, fixed.capacity) == ("text", "Hi there.", 2)
    default = parse("--engine", "scripted", "--script", "text").make(REGISTRY, SETTINGS)
    assert isinstance(default, ScriptedEngine) and default.text == DEFAULT_TEXT
    counting = parse("--engine", "scripted", "--script", "count").make(REGISTRY, SETTINGS)
    assert isinstance(counting, ScriptedEngine) and counting.script == "count"
    with pytest.raises(EngineSetupError, match="--script-text"):
        parse("--engine", "scripted", "--script", "echo", "--script-text", "x").make(
            REGISTRY, SETTINGS)
    with pytest.raises(SystemExit):
        parse("--token-delay-ms", "-1")


def test_factories_say_what_is_missing() -> None:
    with pytest.raises(EngineSetupError, match="--engine openai needs --upstream URL"):
        parse("--engine", "openai").make(REGISTRY, SETTINGS)
    if importlib.util.find_spec("vllm") is None:  # .venv; tests/vllm makes the engine
        with pytest.raises(EngineSetupError, match="run bash infra/vllm.sh"):
            parse("--engine", "vllm").make(REGISTRY, SETTINGS)
    with pytest.raises(EngineSetupError, match="no model with a gguf file in pool 'gpu'"):
        parse("--engine", "llamacpp", "--pool", "gpu").make(REGISTRY, SETTINGS)


def test_the_openai_engine_from_its_flags() -> None:
    from workers.infer.engines.openai_http import OpenAIHttpEngine

    engine = parse("--engine", "openai", "--upstream", "http://127.0.0.1:9/",
                   "--capacity", "5").make(REGISTRY, SETTINGS)

    assert isinstance(engine, OpenAIHttpEngine)
    assert (engine.base_url, engine.capacity, engine.cache_salt) == ("http://127.0.0.1:9", 5, True)
    quiet = parse("--engine", "openai", "--upstream", "http://127.0.0.1:9/",
                  "--no-upstream-cache-salt").make(REGISTRY, SETTINGS)
    assert isinstance(quiet, OpenAIHttpEngine) and quiet.cache_salt is False


def test_up_hands_on_the_options_it_was_given() -> None:
    given = parse("--engine", "scripted", "--contexts", "3", "--script-text", "-dash first",
                  "--token-delay-ms", "2.5", "--no-upstream-cache-salt")
    argv = given.argv()

    assert argv == ["--engine=scripted", "--contexts=3", "--no-upstream-cache-salt",
                    "--script-text=-dash first", "--token-delay-ms=2.5"]
    assert parse(*argv) == given
    assert parse().argv() == []
    assert parse("--upstream", "http://u", "--threads", "2").argv() == [
        "--threads=2", "--upstream=http://u"]
