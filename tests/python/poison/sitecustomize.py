"""Put on PYTHONPATH by tests that start processes (the main job's ranks): poisons torch's
default device there too when the suite runs with --default-device (see conftest.py)."""
import os

if os.environ.get("GRIDWEAVE_TEST_DEFAULT_DEVICE"):
    import torch

    torch.set_default_device(os.environ["GRIDWEAVE_TEST_DEFAULT_DEVICE"])
