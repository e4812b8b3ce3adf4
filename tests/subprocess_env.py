"""The environment for tests that start a Python process: the package importable from any working
directory, installed or run from a checkout (as the GPU suite runs it)."""
import os
from pathlib import Path

import transformer_engine_proto

PACKAGE_ROOT = str(Path(transformer_engine_proto.__file__).resolve().parents[1])


def package_env(*first_on_path) -> dict:
    """os.environ with `first_on_path` and then the package's root at the front of PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first_on_path), PACKAGE_ROOT,
                                         *filter(None, [env.get("PYTHONPATH")])])
    return env
