"""``python -m data_prep.show output_dir=DIR n=K [split=train]``: decode packed samples back to text.

Special tokens stay visible (``<fim_prefix>``, ``<|endoftext|>``, ...), so FIM structure and document
boundaries can be checked by eye. ``n=-1`` shows every sample.
"""

from __future__ import annotations

import sys
from pathlib import Path

from data_prep.config import register_configs
from ultrascale.config.compose import compose
from ultrascale.config.describe import help_if_asked
from ultrascale.errors import UltrascaleError


def decode_samples(output_dir: str, n: int = 4, split: str = "train") -> list[str]:
    from data_prep.tokenizer import load_dir
    from ultrascale.data.shards import load_manifest, open_split

    manifest = load_manifest(output_dir)
    reader = open_split(output_dir, split)
    tok = load_dir(Path(output_dir) / manifest["tokenizer"])
    count = len(reader) if n < 0 else min(n, len(reader))
    out = []
    for start in range(0, count, 256):
        idx = list(range(start, min(start + 256, count)))
        for row in reader.get(idx):
            out.append(tok.decode(row.tolist(), skip_special_tokens=False))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if (rc := help_if_asked("data_prep_show", argv, __doc__)) is not None:
        return rc
    try:
        cfg = compose(argv, config_name="data_prep_show")
        texts = decode_samples(cfg.output_dir, cfg.n, cfg.split)
    except UltrascaleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, t in enumerate(texts):
        print(f"===== {cfg.split} sample {i} =====")
        print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
