"""argparse for the flag-style tools (hostfile, sweep summary, GGUF import, peak, memprobe, demo).

argparse answers bad usage with a ``usage:`` block and ``prog: error: ...``; every other entry point answers
in one ``error: ...`` line (exit 2), so scripts and people read one format. ``--help`` is unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one ``error:`` line that points at ``--help``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see `{self.prog} --help`)", file=sys.stderr, flush=True)
        raise SystemExit(2)
