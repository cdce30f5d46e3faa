"""The stages table: every layer is built from it, and is what it declares."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import _parser
from conveyor.registry import Registry
from conveyor.settings import load_settings
from tests.support.pipeline import TEST_MODELS
from workers.layer import Layer
from workers.replay import REPLAYABLE
from workers.stages import STAGES, Stage, UnknownStage, stage, stage_names


@pytest.mark.parametrize("declared", STAGES, ids=lambda s: s.name)
async def test_each_factory_builds_the_layer_its_stage_declares(
        declared: Stage, tmp_path: Path) -> None:
    settings = load_settings(topic_prefix="tstages", models_file=TEST_MODELS,
                        files_dir=tmp_path)
    layer: Layer = declared.make(settings, Registry.load(TEST_MODELS))
    try:
        assert layer.name == declared.name
        assert layer.source is declared.source
    finally:
        await layer.stop()


def test_names_are_unique_and_unknown_ones_name_the_choices() -> None:
    assert len(set(stage_names())) == len(STAGES)
    with pytest.raises(UnknownStage, match="choose from preprocess, route"):
        stage("infer")


def test_the_layer_command_and_replay_read_the_table() -> None:
    args = _parser().parse_args(["layer"])
    assert args.names == []  # all of them: stage_names()
    assert REPLAYABLE == ("preprocess", "route", "postprocess")
