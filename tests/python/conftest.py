import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rankpool import TRANSPORT_ENV, TRANSPORTS, RankPool  # noqa: E402

# --default-device=meta poisons torch's default device in this process and in every rank
# process before any test runs: a tensor made without an explicit device (in the library
# or in a test) then fails loudly on CPU, long before a GPU would see it.
POISON_ENV = "GRIDWEAVE_TEST_DEFAULT_DEVICE"


def pytest_addoption(parser):
    parser.addoption("--default-device", default=None,
                     help="set torch's default device (e.g. meta) in the test and rank processes")
    parser.addoption("--transport", default="gloo", choices=TRANSPORTS,
                     help="the CPU transport of the rank pool and of the main jobs the tests launch")
    parser.addoption("--emulate", default=None, choices=("nccl",),
                     help="keep NCCL's rules on the CPU transport in every grid the tests make "
                          "(GRIDWEAVE_EMULATE, inherited by the rank pool and the main jobs)")


def pytest_configure(config):
    os.environ[TRANSPORT_ENV] = config.getoption("--transport")  # read by the rank processes too
    if config.getoption("--emulate"):
        os.environ["GRIDWEAVE_EMULATE"] = config.getoption("--emulate")
    device = config.getoption("--default-device")
    if device:
        os.environ[POISON_ENV] = device  # inherited by the rank pool and subprocesses
        # processes the tests start (the main job's ranks) poison themselves at start-up
        poison = os.path.join(os.path.dirname(__file__), "poison")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [poison, os.environ.get("PYTHONPATH")]))
    device = os.environ.get(POISON_ENV)
    if device:
        import torch

        torch.set_default_device(device)


@pytest.fixture(scope="session")
def pool():
    p = RankPool(8, transport=os.environ[TRANSPORT_ENV])
    yield p
    p.close()



@pytest.fixture(scope="session")
def docs_hooks():
    """docs/hooks.py, the documentation site's build hooks, loaded as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hooks", os.path.join(os.path.dirname(__file__), "..", "..",
                                                                          "docs", "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks
