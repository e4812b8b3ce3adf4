"""The test suite itself: no test replaces attributes of torch's config modules.

`monkeypatch.setattr(torch._dynamo.config, ...)` goes around the config module's own machinery;
on undo it can leave the attribute missing for every later test (seen with pytest 9.2:
`torch._dynamo.config has no attribute 'capture_scalar_outputs'`). Tests use
`torch._dynamo.config.patch(...)` / `torch._inductor.config.patch(...)` instead.
"""
import pathlib
import re

# torch.<...>.config, "torch.<...>.config" or a name bound to one (`from torch._inductor import config`)
_CONFIG_SETATTR = re.compile(r"monkeypatch\.setattr\(\s*(torch\.[\w.]*config|\"torch\.[\w.]*config|\w*config\s*,)")


def test_no_monkeypatch_of_torch_config_modules():
    here = pathlib.Path(__file__).parent
    hits = [f"{p.name}:{i}: {line.strip()}"
            for p in sorted(here.glob("*.py")) if p.name != pathlib.Path(__file__).name
            for i, line in enumerate(p.read_text().splitlines(), 1) if _CONFIG_SETATTR.search(line)]
    assert not hits, "use torch._dynamo.config.patch / torch._inductor.config.patch instead:\n" + "\n".join(hits)
