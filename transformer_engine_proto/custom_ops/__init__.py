"""torch.library custom ops (namespace `te_proto`) with fake impls built from TensorProtos."""
from . import linear as linear_ops  # noqa: F401  (registers te_proto::linear_fwd / linear_bwd)
from . import norm as norm_ops  # noqa: F401  (registers te_proto::norm_fwd / norm_bwd)
