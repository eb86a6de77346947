"""The image in a real container engine, as ``make image-check`` runs it (``bench/image_check.py``):
built, a mesh of its containers through a kill and a joiner, and ``deploy/compose.yaml``.

Deselected by default (the ``container`` marker); ``make image-check`` selects it and passes the
script's arguments in GOSSIPMESH_IMAGE_CHECK. Skipped, with one line, where no engine runs."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import image_check

ARGS = os.environ.get("GOSSIPMESH_IMAGE_CHECK")
OPTIONS = image_check.parse_args(shlex.split(ARGS or ""))
pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(ARGS is None, reason="run by make image-check (GOSSIPMESH_IMAGE_CHECK)"),
]
if ARGS is not None and image_check.find_engine(OPTIONS.engine, OPTIONS.setup) is None:
    pytest.skip(image_check.NO_ENGINE, allow_module_level=True)


@pytest.fixture(scope="module")
def engine() -> image_check.Engine:
    """The engine, once the image is built."""
    prepared = image_check.prepare(OPTIONS)
    assert prepared is not None
    engine, build_seconds = prepared
    print(f"\nengine: {engine.program}; build: {build_seconds:.1f} s")
    return engine


def test_a_mesh_of_containers_survives_a_kill_and_takes_a_joiner(engine: image_check.Engine) -> None:
    figures = image_check.check_mesh(engine)
    image_check.show("mesh of containers", figures)
    assert sorted(figures.results) == ["node-0", "node-1", "node-2", "node-3"]
    assert figures.failures() == []


def test_the_compose_file_runs_a_mesh_that_finishes(engine: image_check.Engine) -> None:
    figures = image_check.check_compose(engine)
    image_check.show("compose", figures)
    assert figures.failures() == []
