"""infra/kafka-cds.sh, the class archive the Kafka scripts start their JVMs
with: recorded by a broker while there is none, kept once a JVM accepts it,
never used while its recorder runs, and dropped when a JVM refuses it. Driven
with a stand-in ``java`` on the PATH that accepts an archive whose text is
"good" (the real JVM's use of the archive is in the fault tier's broker
restarts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

CDS = Path(__file__).resolve().parents[3] / "infra" / "kafka-cds.sh"

FAKE_JAVA = """#!/bin/sh
if [ "$1" = -version ]; then echo 'openjdk version "17"'; exit 0; fi
for arg in "$@"; do
  case "$arg" in
    -XX:SharedArchiveFile=*) grep -qx good "${arg#*=}" || exit 1 ;;
  esac
done
exit 0
"""


@pytest.fixture
def libs(tmp_path: Path) -> Path:
    folder = tmp_path / "libs"
    folder.mkdir()
    (folder / "kafka-server.jar").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(FAKE_JAVA)
    java.chmod(0o755)
    return folder


def flags(libs: Path, then: str = "") -> list[str]:
    """What one start does: ``cds_flags`` (then ``then``); cds_opts and cds_use."""
    script = f'. "{CDS}"; cds_flags "{libs}"; {then}\nprintf "%s\\n%s\\n" "$cds_opts" "$cds_use"'
    env = {**os.environ, "PATH": f"{libs.parent / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return out.split("\n")[:2]


def recording(opts: str) -> Path:
    assert opts.startswith("-XX:ArchiveClassesAtExit="), opts
    return Path(opts.split("=", 1)[1])


def test_with_no_archive_a_start_records_one_and_shares_nothing(libs: Path) -> None:
    opts, use = flags(libs, then='cds_started 999999')
    assert use == ""
    path = recording(opts)
    assert path.parent == libs.resolve() and ".recording-" in path.name
    assert path.with_suffix(".pending").read_text().strip() == "999999"


def test_a_finished_recording_that_a_jvm_accepts_becomes_the_archive(libs: Path) -> None:
    path = recording(flags(libs, then="sleep 0 & cds_started $!; wait")[0])
    path.write_text("good\n")  # the recorder exited and wrote it
    opts, use = flags(libs)
    assert opts == use
    archive = Path(use.split()[0].split("=", 1)[1])
    assert archive.read_text() == "good\n" and archive.parent == libs.resolve()
    assert "-Xshare:auto" in use  # a JVM that cannot map it runs without it
    assert not list(libs.glob(".kafka-*.recording-*"))


def test_a_recording_a_jvm_refuses_is_deleted_and_recorded_again(libs: Path) -> None:
    path = recording(flags(libs, then="sleep 0 & cds_started $!; wait")[0])
    path.write_text("cut short\n")
    opts, use = flags(libs)
    assert use == "" and recording(opts) != path
    assert not path.exists() and not path.with_suffix(".pending").exists()


def test_a_recording_whose_jvm_still_runs_is_left_alone(libs: Path) -> None:
    path = recording(flags(libs, then=f"cds_started {os.getpid()}")[0])
    path.write_text("good\n")  # as far as this start can tell, still being written
    opts, use = flags(libs)
    assert use == "" and path.exists() and path.with_suffix(".pending").exists()


def test_the_class_path_names_the_jars_by_their_real_folder(libs: Path, tmp_path: Path) -> None:
    link = tmp_path / "linked"
    link.symlink_to(libs)
    out = subprocess.run(["bash", "-c", f'. "{CDS}"; cds_classpath "{link}"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{libs.resolve()}/*"
