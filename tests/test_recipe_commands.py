"""Every command a recipe's header tells a user to type composes against the config it names.

A recipe header is the first thing a user copies. ``recipes/llama_1b_zero0.yaml`` told them to prepare its data with
``data.seq_len=4096``, which data_prep answers with "unknown config key 'data'" (its key is ``pack.seq_len``). So
each command in a header (train.py under python/torchrun/deepspeed, data_prep, eval.py, plan.py, the exporter,
SSD) is parsed out of the comments and composed here, with the world size its launcher gives for train.py.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ultrascale.config.compose import compose
from ultrascale.paths import PROJECT_ROOT

HEADERS = sorted([*(PROJECT_ROOT / "recipes").glob("*.yaml"), *(PROJECT_ROOT / "conf" / "ssd").glob("*.yaml")])
START = re.compile(r"(?:^|[\s(`:])((?:python3?|deepspeed|torchrun)\s.*)")
PLACEHOLDER = "/tmp/recipe_command_path"


def comment_text(path: Path) -> list[str]:
    """The comments of a recipe (whole-line and trailing), continuation lines joined."""
    lines, pending = [], ""
    for raw in path.read_text().splitlines():
        if "#" not in raw:
            continue
        text = raw.split("#", 1)[1].strip()
        text = pending + " " + text if pending else text
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        if text.count("`") % 2:  # a backticked command that goes on in the next comment line
            pending = text
            continue
        pending = ""
        lines.append(text)
    return lines


def commands(path: Path) -> list[list[str]]:
    """Every command in ``path``'s comments, as argv (shell variables replaced by a placeholder path)."""
    out = []
    for line in comment_text(path):
        for segment in line.split("`"):
            m = START.search(segment)
            if not m:
                continue
            cmd = re.split(r"\s+#|\)\s*$|;", m.group(1))[0].strip()
            if re.match(r"python3?\s+-c\b", cmd):
                continue  # a shell helper (SP=$(python -c ...)), not a command of ours
            cmd = re.sub(r"\$\w+|\$\([^)]*\)", PLACEHOLDER, cmd)
            argv = shlex.split(cmd)
            if any("=" in a and a.split("=", 1)[0].isupper() for a in argv[:1]):
                continue  # a shell assignment (SP=...), not a command of ours
            out.append(argv)
    return out


def entry(argv: list[str]) -> tuple[str, list[str], int]:
    """(what runs: train/eval/plan/data_prep/export/ssd/gguf_import, its overrides, the world size it launches)."""
    world, rest = 1, list(argv)
    launcher = rest.pop(0)
    if launcher in ("deepspeed", "torchrun"):
        gpus = nodes = 1
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0)
            key, _, value = flag.partition("=")
            if not value and rest and not rest[0].endswith(".py"):
                value = rest.pop(0)
            if key in ("--num_gpus", "--nproc_per_node", "--nproc-per-node"):
                gpus = int(value)
            elif key in ("--num_nodes", "--nnodes"):
                nodes = int(value)
        world = gpus * nodes
    if rest and rest[0] == "-m":
        module = rest[1]
        name = {"data_prep": "data_prep", "ultrascale.export": "export", "ultrascale.ssd": "ssd",
                "ultrascale.model.gguf_import": "gguf_import"}.get(module, module)  # fmt: skip
        return name, rest[2:], world
    script = Path(rest[0]).stem
    return script, rest[1:], world


ALL = [(p.name, " ".join(argv)) for p in HEADERS for argv in commands(p)]


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """The jobs of a ``train.py -m`` command: a comma-separated value is swept (every combination); ``hydra.*``
    settings (where the sweep writes) are the launcher's, not the job's config."""
    import itertools

    axes = []
    for o in overrides:
        if o.startswith("hydra."):
            continue
        key, _, value = o.partition("=")
        swept = "," in value and not any(c in value for c in "[]{}()'\"")
        axes.append([f"{key}={v}" for v in value.split(",")] if swept else [o])
    return [list(job) for job in itertools.product(*axes)]


def _check_train(overrides: list[str], world: int) -> None:
    from ultrascale.levers.rules import validate

    cfg = compose(overrides)
    if cfg.model.pretrained_path and not Path(cfg.model.pretrained_path).exists():
        cfg.model.pretrained_path = None  # the user's weights are not here: the recipe's model group has the shape
    if world > 1 or cfg.launcher.nproc_per_node * cfg.launcher.nnodes > 1:
        cfg.dry_run = True  # the recipe's hardware, as the dry run plans it
    validate(cfg, world if world > 1 else cfg.launcher.nproc_per_node * cfg.launcher.nnodes)


def test_the_headers_hold_the_commands_users_copy():
    """The parser finds the commands (a parser that found none would pass everything below)."""
    kinds = {entry(shlex.split(cmd))[0] for _, cmd in ALL}
    assert {"train", "data_prep", "eval", "plan", "export", "ssd", "gguf_import"} <= kinds, kinds
    assert len(ALL) >= 20


@pytest.mark.parametrize(("recipe", "command"), ALL, ids=[f"{r}:{c[:60]}" for r, c in ALL])
def test_a_header_command_composes(recipe: str, command: str):
    kind, overrides, world = entry(shlex.split(command))
    if kind == "train" and overrides[:1] == ["-m"]:  # a sweep: every job it launches composes and validates
        for job in sweep_jobs(overrides[1:]):
            _check_train(job, world)
    elif kind == "train":
        _check_train(overrides, world)
    elif kind == "ultrascale.report.ablation":
        from ultrascale.report.ablation import parser

        parser().parse_args(overrides)
    elif kind == "data_prep":
        from data_prep.config import register_configs

        register_configs()
        compose(overrides, config_name="data_prep")
    elif kind == "eval":
        from ultrascale.eval.config import check, register_eval_configs

        register_eval_configs()
        check(compose(overrides, config_name="eval"))
    elif kind in ("data_prep.chat", "data_prep.instruct"):
        from data_prep.config import register_configs

        register_configs()
        compose(overrides, config_name=kind.replace(".", "_"))
    elif kind == "plan":
        compose(overrides, config_name="plan")
    elif kind == "ssd":
        from ultrascale.ssd.config import register_ssd_configs

        register_ssd_configs()
        compose(overrides, config_name="ssd")
    elif kind == "export":
        from ultrascale.export import ExportConfig

        OmegaConf.merge(OmegaConf.structured(ExportConfig), OmegaConf.from_dotlist(overrides))
    elif kind == "gguf_import":
        from ultrascale.model import gguf_import

        assert len(overrides) == 2 and overrides[0].startswith(("pypi:", "/", "models/")), overrides
        assert callable(gguf_import.main)
    elif kind == "ultrascale.ssd.evaluate":
        from ultrascale.ssd.compare import parser

        parser().parse_args(overrides)  # an unknown flag or a bad value exits with argparse's message
    else:
        pytest.fail(f"{recipe}: a command this test does not know how to check: {command}")
