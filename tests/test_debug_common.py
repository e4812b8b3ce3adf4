"""Helpers shared by the precision-debug tests (test_debug_*.py); no tests here."""
import contextlib
import os
import re
import textwrap

import nvdlfw_inspect.api as debug_api
import torch

from transformer_engine_proto.debug import FEATURE_DIR

STAT_LINE = re.compile(r"INFO - (\S+)\s+iteration=(\d+)\s+value=(\S+)")


@contextlib.contextmanager
def debug_session(tmp_path, config, feature_dirs=(), name="session"):
    """A debug session from a YAML string (written to a file, as users do) or a dict."""
    log_dir = os.path.join(str(tmp_path), name)
    os.makedirs(log_dir, exist_ok=True)
    if isinstance(config, str):
        path = os.path.join(log_dir, "config.yaml")
        with open(path, "w") as f:
            f.write(textwrap.dedent(config))
        config = path
    debug_api.end_debug()  # a failed test may have left one open
    debug_api.initialize(config_file=config, feature_dirs=[FEATURE_DIR, *feature_dirs], log_dir=log_dir)
    try:
        yield log_dir
    finally:
        debug_api.end_debug()


def main_log(log_dir) -> str:
    with open(os.path.join(log_dir, "nvdlfw_inspect_logs", "nvdlfw_inspect_globalrank-0.log")) as f:
        return f.read()


def stat_lines(log_dir):
    """[(name, iteration, value)] from the statistics log."""
    with open(os.path.join(log_dir, "nvdlfw_inspect_statistics_logs", "nvdlfw_inspect_globalrank-0.log")) as f:
        return [(m.group(1), int(m.group(2)), float(m.group(3))) for m in STAT_LINE.finditer(f.read())]


def direct_stats(x: torch.Tensor) -> dict:
    x = x.detach().double().reshape(-1)
    a = x.abs()
    nz = a[a != 0]
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(), "std": x.std().item(),
            "l1_norm": a.sum().item(), "l2_norm": x.norm().item(), "cur_amax": a.max().item(),
            "dynamic_range": (torch.log2(a.max()) - torch.log2(nz.min())).item()}


def assert_close(a: float, b: float, what: str, rel=1e-9, abs_=1e-12):
    assert abs(a - b) <= abs_ + rel * abs(b), f"{what}: {a} != {b}"


def max_stats_config(layer_type: str) -> dict:
    """LogTensorStats of the activation's max for layers whose name contains `layer_type`."""
    return {"s": {"enabled": True, "layers": {"layer_types": [layer_type]},
                  "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["max"],
                                                            "tensors": ["activation"]}}}}
