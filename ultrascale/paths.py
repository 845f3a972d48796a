"""Where the project's files are: the repository root, its config and recipe folders, and what a relative path in
a config means. Every layer reads paths from here, so none of them imports the config composer for a folder name."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"
RECIPES_DIR = PROJECT_ROOT / "recipes"


def resolve_path(p: str | Path) -> Path:
    """Relative data/model paths mean the project root, not Hydra's or the launcher's cwd."""
    path = Path(p).expanduser()
    return path if path.is_absolute() else PROJECT_ROOT / path
