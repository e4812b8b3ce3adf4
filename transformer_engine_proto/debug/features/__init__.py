"""The `transformer_engine` namespace of nvdlfw_inspect features for transformer_engine_proto layers.

Pass this directory as a `feature_dirs` entry:

    import nvdlfw_inspect.api as debug_api
    from transformer_engine_proto.debug.features import FEATURE_DIR
    debug_api.initialize(config_file="config.yaml", feature_dirs=[FEATURE_DIR], log_dir="./log")

nvdlfw_inspect executes every file of the directory as a standalone module, so these files use
absolute imports only, and register their classes only when executed that way (a normal import,
e.g. `from transformer_engine_proto.debug.features.api import TEConfigAPIMapper` in a user's
feature, registers nothing).
"""
import os

FEATURE_DIR = os.path.dirname(os.path.abspath(__file__))


def loaded_by_nvdlfw(module_name: str) -> bool:
    """nvdlfw_inspect's loader names a feature module after its file, without a package."""
    return "." not in module_name
