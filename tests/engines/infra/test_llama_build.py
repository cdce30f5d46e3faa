"""The llama.cpp Conveyor installs runs on any x86-64 server CPU of the last
decade: it is built for a portable level (AVX2/FMA), not for the build
machine. A `-march=native` build on a Xeon that advertises AMX or AVX-512
holds instructions that kill the engine with SIGILL on a CPU without them."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import llama_cpp
import pytest

# AMX tile instructions, and the AVX-512 register file (zmm) or mask registers
_NOT_PORTABLE = ("tilezero", "tileloadd", "ldtilecfg", "tdpbf16ps", "tdpbssd", "%zmm", "%k1")


def _libraries() -> list[Path]:
    lib = Path(llama_cpp.__file__).parent / "lib"
    return sorted(p for p in lib.glob("*.so*") if "ggml" in p.name or "llama" in p.name)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_llama_cpp_holds_no_instruction_beyond_avx2() -> None:
    libs = _libraries()
    assert libs, "llama_cpp ships no shared library"
    for path in libs:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)],
                              capture_output=True, text=True, check=True).stdout
        found = [needle for needle in _NOT_PORTABLE if needle in text]
        assert not found, f"{path.name} was built for this machine's CPU: it uses {found}"
