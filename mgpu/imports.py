"""The command's imports, lightened: what they would parse and load that it never uses.

In the ``mgpu`` command only (:func:`mgpu.lifetime.is_command`); mgpu imported as a library
changes nothing in its program.

- YAML is parsed by libyaml's C loader where PyYAML has it, not by its pure-Python one:
  Dask's and distributed's defaults (17 kB read as they are imported), mgpu's own and the
  job files; 20 ms of a submit's start on two cores. A document the C loader refuses is
  read again by the pure-Python one, so a malformed job file is reported as before.
- Dask is imported with Jinja2 hidden: Dask loads it for the HTML a notebook shows of its
  objects (15 ms), which the command never shows. Dask's HTML templates are then off, as
  where Jinja2 is not installed; Jinja2 itself can be imported again at once (the
  dashboard of a cluster the command starts uses it).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

from .lifetime import is_command

__all__ = ["c_yaml", "lighter_imports"]


@contextlib.contextmanager
def lighter_imports() -> Iterator[None]:
    """Around the command's first import of Dask: YAML through :func:`c_yaml` from now on,
    and Jinja2 hidden while Dask is imported. Outside the command, nothing changes."""
    if not is_command():
        yield
        return
    c_yaml()
    hidden = "jinja2" not in sys.modules
    if hidden:
        sys.modules["jinja2"] = None  # type: ignore[assignment]  # an import of it raises ImportError
    try:
        yield
    finally:
        if hidden and sys.modules.get("jinja2", ...) is None:
            del sys.modules["jinja2"]


def c_yaml() -> None:
    """Have ``yaml.safe_load`` parse with libyaml's C loader (where PyYAML was built with
    it), falling back to the pure-Python loader for a document the C one refuses."""
    import yaml

    if not getattr(yaml, "__with_libyaml__", False) or getattr(yaml.safe_load, "c_loader", False):
        return
    pure = yaml.safe_load

    def safe_load(stream: Any) -> Any:
        text = stream.read() if hasattr(stream, "read") else stream
        try:
            return yaml.load(text, Loader=yaml.CSafeLoader)  # noqa: S506  # the safe loader, in C
        except yaml.YAMLError:
            again: Any = text
            if hasattr(stream, "read"):  # the same name in the message as the stream had
                again = io.BytesIO(text) if isinstance(text, bytes) else io.StringIO(text)
                again.name = getattr(stream, "name", "<file>")
            return pure(again)

    safe_load.c_loader = True  # type: ignore[attr-defined]
    yaml.safe_load = safe_load
