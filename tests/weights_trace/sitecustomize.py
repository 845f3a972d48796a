"""Imported at start-up by every Python process whose ``PYTHONPATH`` names this folder (the pipeline test puts it
there for the ranks it launches): with ``WEIGHTS_TRACE=PREFIX`` set, each process appends one line
``<file>\t<tensor>`` to ``PREFIX.rank<RANK>`` for every tensor it reads from a safetensors file, whoever reads it.

The product's own loader is not asked what it read: ``safetensors.safe_open`` is wrapped before anything imports
it (transformers' ``from_pretrained``, ``safetensors.torch.load_file`` and our loader all open files through it),
and an audit hook records a safetensors file opened from Python (read whole, e.g. ``safetensors.torch.load``
of its bytes) as ``<file>\t*``."""

import os
import sys

_PREFIX = os.environ.get("WEIGHTS_TRACE")


def _record(path, key: str) -> None:
    with open(f"{_PREFIX}.rank{os.environ.get('RANK', '0')}", "a") as out:
        out.write(f"{os.path.realpath(os.fsdecode(path))}\t{key}\n")


class _Traced:
    """A ``safe_open`` handle that records each tensor (or slice handle) taken from it."""

    def __init__(self, handle, path):
        self._handle, self._path = handle, path

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, key):
        _record(self._path, key)
        return self._handle.get_tensor(key)

    def get_slice(self, key):
        _record(self._path, key)
        return self._handle.get_slice(key)

    def get_tensors(self):
        for key in self._handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            _record(self._path, key)
        return self._handle.get_tensors()

    def __getattr__(self, name):
        return getattr(self._handle, name)


if _PREFIX:
    import safetensors

    _safe_open = safetensors.safe_open

    def safe_open(filename, *args, **kwargs):
        return _Traced(_safe_open(filename, *args, **kwargs), filename)

    safetensors.safe_open = safe_open

    def _audit(event: str, args: tuple) -> None:
        path = args[0] if event == "open" else None
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).endswith(".safetensors"):
            _record(path, "*")

    sys.addaudithook(_audit)
