"""LogTensorStats: statistics of high-precision tensors."""
from typing import Dict

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import state, stats
from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ScheduledInspectFeature


class LogTensorStats(ScheduledInspectFeature):
    """
    Logs statistics of high-precision tensors.

    Stats are computed in every micro-batch (as device tensors, no host sync) and logged at
    `debug_api.step()`, reduced across ranks in a distributed run. With several forward/backward
    passes per step, stats of all tensors except weights are accumulated over the micro-batches.
    Weight stats of a tensor-parallel layer are reduced over its TP group (the whole weight's
    stats; `transformer_engine_proto.debug.set_weight_tensor_tp_group_reduce(False)`: per rank).
    If no feature is active for a layer in a step, the layer runs its normal fast path.

    Parameters
    ----------
    stats: List[str | Dict]
        min, max, mean, std, l1_norm, l2_norm, cur_amax (max |x|),
        dynamic_range (log2(amax) - log2(smallest non-zero |x|)),
        max_blockwise_dynamic_range (the largest dynamic_range of one block; written as a mapping,
        `- max_blockwise_dynamic_range: {block_size: 32, dims: 1}`, both keys optional: dims 1
        blocks are block_size consecutive elements of a row, dims 2 block_size x block_size tiles;
        for activation and weight, which GEMMs also read transposed, the transposed blocks count
        too; logged as `max_blockwise_dynamic_range_block_size_<b>_dims_<d>[_max_over_orientations]`)
    tensors/tensors_struct: List[str]
        activation, gradient, weight, output, wgrad, dgrad
    freq: Optional[int], default = 1
    start_step, end_step: Optional[int]
        inclusive window (end_step -1 or absent: no end)
    start_end_list: Optional[List[[int, int]]]
        non-overlapping inclusive windows in increasing order; start_step/end_step are then ignored

    Example
    -------
    .. code-block:: yaml

        example_tensor_stat_collection:
            enabled: True
            layers:
                layer_name_regex_pattern: .*(fc1|self_attention).*
            transformer_engine:
                LogTensorStats:
                    enabled: True
                    tensors_struct:
                        - tensor: activation
                          stats: [mean]
                          freq: 10
                          start_step: 5
                          end_step: 100
                        - tensor: gradient
                          stats: [mean, max, min]
                          freq: 2
                          start_end_list: [[0, 20], [80, 100]]
                        - tensor: weight
                          stats:
                            - dynamic_range
                            - max_blockwise_dynamic_range:
                                block_size: 32
                                dims: 1
    """

    def _get_supported_stats_list(self):
        return set(stats.HP_STATS)

    @api_method
    def inspect_tensor(self, config: Dict, layer_name: str, tensor_name: str, iteration: int, tensor=None,
                       tp_group=None, **kwargs):
        requested = config.get("stats", [])
        for s in requested:
            try:
                stats.parse_hp_stat(s, tensor_name)
            except ValueError as e:
                raise ValueError(f"LogTensorStats ({layer_name}, {tensor_name}): {e}") from None
        if tensor is None:
            return None
        stats.feed_tensor(layer_name, tensor_name, requested, tensor, iteration, tp_group)
        state.log_message(f"Feature={self.__class__.__name__}, API=inspect_tensor: {tensor_name}", layer_name)
        return None


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(LogTensorStats)
