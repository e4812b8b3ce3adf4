"""The docs keep up with the code: every module's constructor and forward arguments are in its
docstring's numpy-style `Parameters` section (and nothing else is), and every package file or
relative link that README.md and docs/*.md name exists."""
import inspect
import re
from pathlib import Path

import pytest

import transformer_engine_proto as te

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = [te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.LayerNorm, te.RMSNorm, te.GroupedLinear,
           te.DotProductAttention, te.MultiheadAttention, te.TransformerLayer]


def documented_parameters(doc: str) -> set:
    """Names in the `Parameters` section of a numpy-style docstring. An entry is a line at the
    section's indentation, `name : type` or `a, b : type`; the section ends at the next heading
    (a line over dashes) or at a line of prose at that indentation."""
    lines = inspect.cleandoc(doc or "").splitlines()
    names = set()
    for i, line in enumerate(lines[:-1]):
        if line.strip() != "Parameters" or set(lines[i + 1].strip()) != {"-"}:
            continue
        indent = len(line) - len(line.lstrip())
        body = lines[i + 2:]
        for j, entry in enumerate(body):
            if not entry.strip():
                continue
            depth = len(entry) - len(entry.lstrip())
            if depth < indent:
                break
            if depth > indent:
                continue  # an entry's description
            if j + 1 < len(body) and set(body[j + 1].strip()) == {"-"}:
                break  # the next section's heading
            head = entry.strip().split(" : ")[0]
            if not re.fullmatch(r"\w+(, \w+)*", head):
                break  # prose after the section
            names.update(head.split(", "))
    return names


def argument_names(fn) -> set:
    """The named arguments of `fn` (a class: its constructor), without self / *args / **kwargs."""
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.name != "self"
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def test_the_parser_reads_numpy_sections():
    doc = """Summary.

    Parameters
    ----------
    a : int
        The first.
    b, c : bool, default = False
        Two at once.

    Other keywords are a TypeError.

    Returns
    -------
    d : int
    """
    assert documented_parameters(doc) == {"a", "b", "c"}
    assert documented_parameters("No section.") == set()


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_every_constructor_argument_is_documented(cls):
    own_doc = cls.__dict__.get("__doc__")
    assert own_doc, f"{cls.__name__} has no class docstring of its own"
    documented, wanted = documented_parameters(own_doc), argument_names(cls)
    assert not wanted - documented, f"{cls.__name__}: arguments missing from its docstring's Parameters"
    assert not documented - wanted, f"{cls.__name__}: documented names that are no arguments"


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_every_forward_argument_is_documented(cls):
    documented, wanted = documented_parameters(cls.forward.__doc__), argument_names(cls.forward)
    assert not wanted - documented, f"{cls.__name__}.forward: arguments missing from its docstring"
    assert not documented - wanted, f"{cls.__name__}.forward: documented names that are no arguments"


def _package_paths(text: str):
    return set(re.findall(r"transformer_engine_proto/[\w/.-]*?\.py\b", text))


def _relative_links(text: str):
    """Targets of markdown links that are neither URLs nor anchors, without their #fragment."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return {t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_package_files_exist(doc):
    missing = sorted(p for p in _package_paths(doc.read_text()) if not (ROOT / p).is_file())
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    missing = sorted(t for t in _relative_links(doc.read_text()) if not (doc.parent / t).exists())
    assert not missing, f"{doc.name} links to paths that do not exist: {missing}"
