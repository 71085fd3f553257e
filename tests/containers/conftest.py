"""The container suite (marker `containers`, not in the default run): `.ci/containers.sh` builds
the image of docs/examples/Dockerfile from this checkout and runs `pytest -m containers` with
VLAUNCH_TEST_IMAGE set. Without that image the tests fail; they never skip. The checkpoint is
`vlaunch demo`'s (two tensor-parallel ranks on CPU); the engine is the reference engine. Every
container, volume and Compose project a test creates is named by dockerlib.unique and removed
afterwards.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.containers.dockerlib import IMAGE_ENV, docker, unique


@pytest.fixture(scope="session")
def image() -> str:
    """The image of docs/examples/Dockerfile built from this checkout (.ci/containers.sh)."""
    tag = os.environ.get(IMAGE_ENV, "")
    if not tag:
        pytest.fail(f"{IMAGE_ENV} is not set: .ci/containers.sh builds the image from this "
                    "checkout and runs this suite against it")
    docker("image", "inspect", tag)  # fails loudly when it is not there
    return tag


@pytest.fixture(scope="session")
def models(demo_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory as the recipes mount it (VLAUNCH_MODELS): llama/ is the demo
    checkpoint, readable by the containers' user."""
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(demo_ckpt, root / "llama")
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture
def recipe_env(image: str, models: Path) -> dict[str, str]:
    """The recipes' variables: this image, these models, a name of the test's own and an
    engine port on 127.0.0.1 that Docker picks."""
    return {"VLAUNCH_IMAGE": image, "VLAUNCH_MODELS": str(models),
            "VLAUNCH_NAME": unique("llama"), "VLAUNCH_PORT": "127.0.0.1:"}
