import pytest
from tiny import LOWER_FRACTION, tiny_model_dir, write_run_config


@pytest.fixture(scope="session")
def parallel_setup(tmp_path_factory):
    """The tiny model and run config the several-rank tests share (test_parallel.py,
    test_ray_launch.py), so that one one-process reference run serves them all."""
    root = tmp_path_factory.mktemp("parallel")
    model = tiny_model_dir(root / "model")
    return root, write_run_config(root, model, reward=LOWER_FRACTION)
