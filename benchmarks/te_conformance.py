"""Conformance run: Transformer Engine's own PyTorch tests, unchanged, against this package.

Why: TE's test suite is the best statement of what a TE user's code does with the API. Running it
through the opt-in alias (`transformer_engine_proto/as_te.py`: `import transformer_engine.pytorch`
resolves to this package) measures how much of it our re-implementation satisfies, and groups what
fails into families (a missing name, a refused argument, a CUDA-only kernel, ...).

How: each test file runs in its own subprocess

    python -m transformer_engine_proto.as_te -m pytest <file> -q -p no:cacheprovider --junitxml=...

from a fresh temp cwd (so this repo's tests/conftest.py never applies), with TE's tests/pytorch on
PYTHONPATH (its tests import `utils`, `references...`) and a wall-clock cap per file (at the cap
pytest gets SIGINT, which still writes the junit XML of what ran). The XML files are parsed into
`conformance.json` and `conformance.md` in `--out`.

TE's shared test helpers (tests/pytorch/utils.py) import TE internals at module level (attention
backend selection, `_extra_state`, `ops.fuser`, ...), so without help a whole file fails to collect on
one internal name. Unless `--no-stubs`, a pytest plugin (STUB_PLUGIN) stands in for those: a missing
`transformer_engine*` module, or a name missing from one of our aliased modules when asked for by
TE's test code, is a stub whose every use raises `NotImplementedError("te_conformance stub: <name>")`,
so only the tests that actually use it fail, each in the family of the name it needed (a name our
module refuses on purpose, like a te.ops op not built yet, keeps its reason). One
internal that ModelConfig calls at import (`check_set_window_size`) is a small working shim instead,
and a constant the tests use as a value (`_extra_state.UNSAFE_PICKLE_EXTRA_STATE_ENV`) is TE's.

    git -C <TE mirror> archive HEAD tests/pytorch | tar -x -C /tmp/te_src
    python benchmarks/te_conformance.py --te-src /tmp/te_src --out /tmp/te_conf --te-commit <sha>
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ["debug/test_*.py", "test_sanity.py", "test_recipe.py", "test_numerics.py",
                 "test_fusible_ops.py", "test_cuda_graphs.py", "test_identity_quantizer.py"]
# what TE's own CI (qa/L0_pytorch_*unittest/test.sh) sets for these files
ENV = {"NVTE_TORCH_COMPILE": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NVTE_FUSED_ATTN": "0"}


STUB_PLUGIN = r'''
import importlib, importlib.abc, importlib.machinery, os, sys, types
import transformer_engine_proto.as_te
transformer_engine_proto.as_te.install()  # pytest-xdist workers start without `-m ...as_te`
_TESTS = os.environ["TE_CONFORMANCE_TESTS_DIR"]
_ROOTS = ("transformer_engine", "transformer_engine_torch")


def _fail(name):
    raise NotImplementedError(f"te_conformance stub: {name}")


class _StubMeta(type):
    def __getattr__(cls, a):
        if a.startswith("__"):
            raise AttributeError(a)
        _fail(f"{cls.__qualname__}.{a}")

    def __getitem__(cls, k):
        _fail(cls.__qualname__)

    def __setitem__(cls, k, v):
        _fail(cls.__qualname__)


def _stub(name):
    return _StubMeta(name.rpartition(".")[2], (), {"__qualname__": name, "__init__": lambda self, *a, **k: _fail(name)})


def _from_tests():  # the caller's caller is TE's test code (not our package, not importlib)
    f = sys._getframe(2)
    return f.f_code.co_filename.startswith(_TESTS)


class _StubModule(types.ModuleType):
    def __getattr__(self, a):
        if a.startswith("__"):
            raise AttributeError(a)
        v = _stub(f"{self.__name__}.{a}")
        setattr(self, a, v)
        return v


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in _ROOTS and fullname not in sys.modules:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _missing_name_hook(mod, own=None):
    def __getattr__(a):
        try:
            if own is None:
                raise AttributeError(f"module {mod.__name__!r} has no attribute {a!r}")
            return own(a)  # the module's own __getattr__ (te.ops names the ops not built yet)
        except AttributeError as e:
            if a.startswith("__") or not _from_tests():
                raise
            why = f"{mod.__name__}.{a}" if own is None else f"{mod.__name__}.{a} ({e})"
        if hasattr(mod, "__path__"):  # a real submodule of ours is imported, not stubbed
            try:
                return importlib.import_module(f"{mod.__name__}.{a}")
            except ModuleNotFoundError:
                pass
        return _stub(why)
    return __getattr__


def check_set_window_size(attn_mask_type, window_size=None):
    """Shim of TE's attention-utils helper that TE's tests/pytorch/utils.py ModelConfig calls at import:
    the sliding window a mask type implies ((-1, 0) causal, (-1, -1) otherwise), given one or not."""
    if "causal" in attn_mask_type:
        return (-1, 0) if window_size in (None, (-1, -1)) else (window_size[0], 0)
    return (-1, -1) if window_size in (None, (-1, 0)) else tuple(window_size)


_SHIMS = {"transformer_engine.pytorch.attention.dot_product_attention.utils": {
    "check_set_window_size": check_set_window_size},
    # the environment variable's name (a string the tests set and restore), not behaviour
    "transformer_engine.pytorch._extra_state": {
    "UNSAFE_PICKLE_EXTRA_STATE_ENV": "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"}}
sys.meta_path.insert(0, _Finder())
for _name, _names in _SHIMS.items():
    vars(importlib.import_module(_name)).update(_names)
for _name, _mod in list(sys.modules.items()):
    if _name.split(".")[0] in _ROOTS and not isinstance(_mod, _StubModule):
        _mod.__getattr__ = _missing_name_hook(_mod, vars(_mod).get("__getattr__"))
        if not hasattr(_mod, "__path__"):
            _mod.__path__ = []  # TE has packages where we have modules (ops.basic): its submodules stub
'''


def resolve_files(tests_dir: Path, patterns) -> list[Path]:
    out = []
    for pat in patterns:
        hits = sorted(tests_dir.glob(pat)) if any(c in pat for c in "*?[") else [tests_dir / pat]
        out += [p for p in hits if p not in out]
    return out


def run_file(path: Path, tests_dir: Path, xml_dir: Path, limit_s: float, stubs: bool, extra=()) -> dict:
    """One test file in its own pytest subprocess (`extra`: more pytest arguments, such as
    pytest-xdist's `-n 12` for a file of thousands of cases); returns its parsed result."""
    rel = path.relative_to(tests_dir).as_posix()
    xml = xml_dir / (rel.replace("/", "__") + ".xml")
    cmd = [sys.executable, "-m", "transformer_engine_proto.as_te", "-m", "pytest", str(path), "-q",
           "-p", "no:cacheprovider", f"--junitxml={xml}", f"--rootdir={tests_dir}", *extra]
    if stubs:
        cmd += ["-p", "_te_conformance_stubs"]
    if rel.startswith("debug/"):  # TE's qa script passes these to the debug tests (debug/conftest.py)
        cmd += [f"--feature_dirs={REPO / 'transformer_engine_proto/debug/features'}",
                f"--configs_dir={tests_dir / 'debug/test_configs'}/"]  # TE's tests append file names
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join(
        [str(REPO), str(tests_dir), str(xml_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TE_CONFORMANCE_TESTS_DIR": str(tests_dir)}
    t0, timed_out = time.time(), False
    with tempfile.TemporaryDirectory() as cwd, open(xml.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGINT)  # pytest stops and still writes the XML
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    res = {"file": rel, "rc": rc, "seconds": round(time.time() - t0, 1), "timed_out": timed_out,
           **parse_junit(xml)}
    if res["collected"] == 0 and rc not in (0, 5):  # nothing came back: count the file as one error
        tail = [ln for ln in xml.with_suffix(".log").read_text(errors="replace").splitlines() if ln.strip()]
        reason = ("timed out after %d s" % limit_s) if timed_out else (tail[-1] if tail else f"exit {rc}")
        res.update(collected=1, errors=1, cases=[{"id": rel, "outcome": "errors", "message": reason}])
    print(f"{rel}: {res['passed']}/{res['collected']} passed, {res['failed']} failed, {res['errors']} errors, "
          f"{res['skipped']} skipped ({res['seconds']} s{', timed out' if timed_out else ''})", flush=True)
    return res


def _first_error_line(el) -> str:
    """The exception line of a failure/error element: the first `E   Type: msg` line of the
    traceback, else the element's message attribute."""
    for line in (el.text or "").splitlines():
        m = re.match(r"E\s+((?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception|Exit|Failed|Warning)\b.*)", line)
        if m:
            return m.group(1).strip()
    msg = (el.get("message") or "").strip()
    m = re.match(r'failed on (?:setup|teardown) with "(.*)', msg, re.S)
    return (m.group(1) if m else msg).splitlines()[0] if msg else el.tag


# a failure that only says the test needs a GPU: on a CPU-only run such tests are not the package's to pass
_NEEDS_CUDA = re.compile(r"Torch not compiled with CUDA enabled|has no attribute '_cuda_|Found no NVIDIA driver|"
                         r"No CUDA GPUs are available|cannot be accessed from Triton \(cpu tensor\?\)")


def parse_junit(xml: Path) -> dict:
    """Counts per outcome (`needs_cuda`: the failures and errors among them that only ask for CUDA)
    and one case record per test not passed."""
    counts = dict(collected=0, passed=0, failed=0, errors=0, skipped=0, needs_cuda=0)
    cases = []
    if not xml.exists():
        return {**counts, "cases": cases}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        tid = f"{cls}::{name}" if cls else name
        kids = {k.tag: k for k in tc if k.tag in ("failure", "error", "skipped")}
        if "error" in kids and "failure" not in kids and any(c["id"] == tid for c in cases):
            counts["errors"] += 1  # a teardown error of a test already counted: not a new test
            continue
        counts["collected"] += 1
        if "failure" in kids or "error" in kids:
            kind = "failed" if "failure" in kids else "errors"
            counts[kind] += 1
            el = kids.get("failure", kids.get("error"))
            message = _first_error_line(el)
            counts["needs_cuda"] += bool(_NEEDS_CUDA.search(message))
            cases.append({"id": tid, "outcome": kind, "message": message})
        elif "skipped" in kids:
            counts["skipped"] += 1
            cases.append({"id": tid, "outcome": "skipped", "message": (kids["skipped"].get("message") or "")[:200]})
        else:
            counts["passed"] += 1
    return {**counts, "cases": cases}


def family(message: str) -> str:
    """Normalised error line: paths, addresses, numbers, shapes and dtypes stripped."""
    s = message.splitlines()[0] if message else "?"
    s = re.sub(r"(/[\w.\-+]+)+(\.py)?(:\d+)?", "<path>", s)
    s = re.sub(r"0x[0-9a-fA-F]+", "<addr>", s)
    s = re.sub(r"\b([a-z]\w*?)_\d+\b", r"\1_N", s)  # a module's default name (grouped_linear_60)
    s = re.sub(r"torch\.(float|bfloat|int|uint)\w*", "<dtype>", s)
    s = re.sub(r"\b\d+(\.\d+)?(e[-+]?\d+)?\b", "N", s)
    s = re.sub(r"\((N, )*N,?\)|\[(N, )*N\]", "<shape>", s)
    return s[:160]


def summarise(results: list[dict]) -> dict:
    keys = ("collected", "passed", "failed", "errors", "skipped", "needs_cuda")
    totals = {k: sum(r.get(k, 0) for r in results) for k in keys}
    fams = collections.OrderedDict()
    for r in results:
        for c in r["cases"]:
            if c["outcome"] in ("failed", "errors"):
                f = fams.setdefault(family(c["message"]), {"count": 0, "example": c["id"], "files": {}})
                f["count"] += 1
                f["files"][r["file"]] = f["files"].get(r["file"], 0) + 1
    fams = sorted(({"family": k, **v} for k, v in fams.items()), key=lambda f: -f["count"])
    skips = collections.Counter(family(c["message"]) for r in results for c in r["cases"] if c["outcome"] == "skipped")
    return {"totals": totals, "families": fams, "skip_reasons": skips.most_common(15)}


def pct(r):
    return f"{100.0 * r['passed'] / r['collected']:.1f}" if r["collected"] else "-"


def pct_run(r):
    """Passed of the tests that ran here: not skipped (TE's own skips) and not only asking for CUDA."""
    ran = r["collected"] - r["skipped"] - r.get("needs_cuda", 0)
    return f"{100.0 * r['passed'] / ran:.1f}" if ran > 0 else "-"


_FAMILIES_SHOWN = 80  # the rest are in conformance.json


def write_md(meta: dict, results: list[dict], summ: dict, path: Path) -> None:
    ln = ["# Transformer Engine's PyTorch tests through `transformer_engine_proto.as_te`", "",
          *(f"- {k}: `{v}`" for k, v in meta.items()), "",
          "| file | collected | passed | failed | errors | skipped | needs CUDA | pass % | pass % of run | s | note |",
          "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in results:
        note = "timed out (partial)" if r["timed_out"] else ""
        ln.append(f"| {r['file']} | {r['collected']} | {r['passed']} | {r['failed']} | {r['errors']} | "
                  f"{r['skipped']} | {r.get('needs_cuda', 0)} | {pct(r)} | {pct_run(r)} | {r['seconds']} | {note} |")
    t = summ["totals"]
    ln += [f"| **total** | {t['collected']} | {t['passed']} | {t['failed']} | {t['errors']} | {t['skipped']} | "
           f"{t['needs_cuda']} | {pct(t)} | {pct_run(t)} | | |", "",
           "pass % is of collected (skips count as not passed); pass % of run leaves out TE's own skips and "
           "the failures that only ask for CUDA (`needs CUDA`: on a machine without a GPU).", "",
           f"## Failure families (failures and errors by normalised first error line; the {_FAMILIES_SHOWN} largest)",
           "", "| count | family | files | example |", "|--:|---|---|---|"]
    for f in summ["families"][:_FAMILIES_SHOWN]:
        files = ", ".join(f"{k} ({v})" for k, v in f["files"].items())
        ln.append(f"| {f['count']} | `{f['family'].replace('|', '/')}` | {files} | `{f['example']}` |")
    ln += ["", "## Top skip reasons", "", "| count | reason |", "|--:|---|"]
    ln += [f"| {n} | `{r.replace('|', '/')}` |" for r, n in summ["skip_reasons"]]
    path.write_text("\n".join(ln) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--te-src", required=True, type=Path, help="directory holding TE's tests/pytorch")
    ap.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="globs relative to tests/pytorch")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--limit-s", type=float, default=900, help="wall-clock cap per file")
    ap.add_argument("--jobs", type=int, default=1, help="files run at once")
    ap.add_argument("--no-stubs", action="store_true", help="no stand-ins for TE-internal names (see docstring)")
    ap.add_argument("--te-commit", default="", help="TE commit the tests come from (recorded)")
    ap.add_argument("--pytest-args", default="", help="more arguments for each file's pytest, e.g. '-n 12'")
    args = ap.parse_args(argv)
    tests_dir = (args.te_src / "tests/pytorch").resolve()
    files = resolve_files(tests_dir, args.files)
    args.out.mkdir(parents=True, exist_ok=True)
    xml_dir = args.out / "junit"
    xml_dir.mkdir(exist_ok=True)
    (xml_dir / "_te_conformance_stubs.py").write_text(STUB_PLUGIN)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        extra = args.pytest_args.split()
        results = list(pool.map(lambda p: run_file(p, tests_dir, xml_dir, args.limit_s, not args.no_stubs, extra),
                                files))
    import torch
    meta = {"te_commit": args.te_commit or "unknown", "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "ours": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                   capture_output=True, text=True).stdout.strip(),
            "limit_s_per_file": args.limit_s, "stubs": not args.no_stubs,
            "pytest_args": args.pytest_args, "date": time.strftime("%Y-%m-%d %H:%M")}
    summ = summarise(results)
    (args.out / "conformance.json").write_text(json.dumps({"meta": meta, **summ, "files": results}, indent=1))
    write_md(meta, results, summ, args.out / "conformance.md")
    print((args.out / "conformance.md").read_text())


if __name__ == "__main__":
    main()
