"""Per-GEMM formats of a `CustomRecipe` whose factory returns identity or hybrid quantizers.

A Linear's three GEMMs each read one usage of two roles: fprop the rowwise input and weight,
dgrad the rowwise grad_output and the columnwise weight, wgrad the columnwise grad_output and
input. A hybrid quantizer gives each usage its own quantizer, an identity quantizer keeps it in
high precision. The Linear op does not take per-usage quantizers: it takes one quantizer per role
and decides per GEMM whether it runs quantized, in high precision on the original operands, or
in high precision on the forward's quantized operand dequantized (`LinearPlan`). `gemm_formats`
maps the factory's answer onto those choices, and refuses what they cannot express, naming the
GEMM and the roles:

- both operands identity: the GEMM runs in high precision on the original operands (exactly the
  recipe-off call);
- dgrad / wgrad whose grad_output is identity and whose other operand is an identity columnwise
  copy of the rowwise quantized values (`columnwise_source="rowwise_dequantized"`): the GEMM runs
  on the forward's quantized operand, dequantized (TE's `backward_override="dequantized"`);
- both operands quantized: the GEMM runs quantized, each role with its one quantizer;
- an identity operand beside a quantized one: NotImplementedError (TE hands such a pair to its
  GEMM as a plain and a quantized tensor, which no GEMM path here takes).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .quantizer import Quantizer

__all__ = ["GEMM_OPERANDS", "GemmFormats", "gemm_formats"]

# the (role, usage) pairs each GEMM reads
GEMM_OPERANDS = {
    "fprop": (("input", "rowwise"), ("weight", "rowwise")),
    "dgrad": (("grad_output", "rowwise"), ("weight", "columnwise")),
    "wgrad": (("grad_output", "columnwise"), ("input", "columnwise")),
}


class GemmFormats(NamedTuple):
    """One quantizer per role (None where no GEMM quantizes the role), and the GEMMs run in high
    precision on the original operands and on the dequantized forward operands."""

    roles: Dict[str, Optional[Quantizer]]
    high_precision_gemms: frozenset
    dequantized_gemms: frozenset


class _Operand(NamedTuple):
    quantizer: Optional[Quantizer]  # None: identity, kept in high precision
    dequantized: bool  # identity holding the rowwise copy's dequantized values
    rowwise: Optional[Quantizer]  # the quantizer of those rowwise values


def _operand(role: str, q: Quantizer, usage: str) -> _Operand:
    if not isinstance(q, HybridQuantizer):
        _check_identity_dtype(role, q)
        return _Operand(None if isinstance(q, IdentityQuantizer) else q, False, None)
    sub = getattr(q, f"{usage}_quantizer")
    _check_identity_dtype(role, sub)
    from_rowwise = usage == "columnwise" and q.columnwise_source == "rowwise_dequantized"
    row_quantized = not isinstance(q.rowwise_quantizer, IdentityQuantizer)
    if not isinstance(sub, IdentityQuantizer):
        if from_rowwise and row_quantized:
            raise NotImplementedError(
                f"CustomRecipe: {role}'s HybridQuantizer quantizes its columnwise copy with {type(sub).__name__} "
                "from the rowwise copy's dequantized values; the Linear op quantizes each usage from the "
                "original values only")
        return _Operand(sub, False, None)
    return _Operand(None, from_rowwise and row_quantized, q.rowwise_quantizer if from_rowwise else None)


def _check_identity_dtype(role: str, q: Quantizer) -> None:
    if isinstance(q, IdentityQuantizer) and q.dtype is not None:
        raise NotImplementedError(
            f"CustomRecipe: {role}'s IdentityQuantizer(dtype={q.dtype}) casts a GEMM operand; the Linear op runs "
            "its high-precision GEMMs on the operands as they are: use IdentityQuantizer() (dtype=None)")


def _same(q: Quantizer) -> Quantizer:
    return q.with_usage(rowwise=True, columnwise=True)


def gemm_formats(made: Dict[str, Quantizer]) -> GemmFormats:
    """`made`: the factory's quantizer per role ("input", "weight", "grad_output")."""
    wanted: Dict[str, set] = {role: set() for role in made}
    high, dequantized = set(), set()
    for gemm, pairs in GEMM_OPERANDS.items():
        ops = [(role, usage, _operand(role, made[role], usage)) for role, usage in pairs]
        quantized = [op for op in ops if op[2].quantizer is not None]
        if len(quantized) == len(ops):
            for role, _, op in ops:
                wanted[role].add(_same(op.quantizer))
        elif quantized:
            names = ", ".join(f"{role} {usage} {'identity' if op.quantizer is None else type(op.quantizer).__name__}"
                              for role, usage, op in ops)
            raise NotImplementedError(
                f"CustomRecipe: {gemm} reads an identity (high-precision) operand beside a quantized one ({names}); "
                "a Linear GEMM runs with both operands quantized in one format or both in high precision")
        else:
            (first_role, _, first), (role, _, other) = ops  # fprop's rowwise operands are never dequantized
            if first.dequantized:
                raise NotImplementedError(
                    f"CustomRecipe: {gemm} would read {first_role}'s columnwise copy dequantized from its rowwise "
                    "quantized values; the Linear op dequantizes the forward's input and weight only")
            if other.dequantized:
                dequantized.add(gemm)
                wanted[role].add(_same(other.rowwise))
            else:
                high.add(gemm)
    roles = {}
    for role, options in wanted.items():
        if len(options) > 1:
            found = sorted(map(repr, options))
            raise NotImplementedError(f"CustomRecipe: the {role} role is quantized by different quantizers in "
                                      f"different GEMMs ({found}); the Linear op takes one quantizer per role")
        roles[role] = next(iter(options), None)
    return GemmFormats(roles, frozenset(high), frozenset(dequantized))
