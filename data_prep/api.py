"""The one function training calls when its data directory is missing (on rank 0, while others wait)."""

from __future__ import annotations

from data_prep.config import register_configs
from ultrascale.config.compose import compose


def prepare(
    output_dir: str,
    source: str = "stdlib",
    seq_len: int = 256,
    vocab_size: int = 4096,
    max_files: int | None = 400,
    seed: int = 0,
    overrides: list[str] | None = None,
) -> dict:
    """Build a packed dataset in ``output_dir`` and return its manifest (a finished one is returned as is).

    ``source`` is ``stdlib`` or a directory/file path. Defaults take well under a minute on one core:
    400 stdlib files, one in-process map task, no progress bars. Raises DataError / ConfigError on bad input.
    """
    from data_prep.pipeline import run

    register_configs()
    ovr = [
        f"input={source}",
        f"output_dir={output_dir}",
        f"pack.seq_len={seq_len}",
        f"tokenizer.vocab_size={vocab_size}",
        f"source.max_files={'null' if max_files is None else max_files}",
        f"seed={seed}",
        "executor.progress=false",
        *(overrides or []),
    ]
    return run(compose(ovr, config_name="data_prep"))
