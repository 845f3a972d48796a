"""What the READMEs and recipe headers claim, held against the code (issue 42, part 6).

A claim in a README or a recipe header is read by someone booking machines; each test here ties one to the
code that keeps it, or to the command that reproduces a measured figure. All in-process and cheap.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ultrascale.config.compose import compose
from ultrascale.paths import RECIPES_DIR

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _cluster_decisions(overrides: list[str]):
    """The decisions the recipe's cluster ranks make (nccl, the cluster's card), as ``dry_run=true`` prints them."""
    from ultrascale.levers.rules import validate
    from ultrascale.plan.dryrun import target

    cfg = compose([*overrides, "dry_run=true"])
    t = target(cfg)
    return cfg, validate(cfg, t.world, backend=t.backend, gpu=t.gpu)


def test_long_context_recipe_keeps_packed_documents_apart_under_ulysses():
    """``long_context_ulysses_32k`` packs documents into 32k rows under sp=8. Ulysses drops 4-D masks, so with
    sdpa every document would attend to the ones packed before it; the recipe runs flash_attention_2, whose
    varlen kernel reads the boundaries from the all-gathered position ids, and its header says why."""
    cfg, d = _cluster_decisions(["recipe=long_context_ulysses_32k"])
    assert d.topo.sp == 8 and cfg.data.document_masking
    assert d.document_masking.on, d.document_masking.why
    assert "no cross-document attention" in d.document_masking.why
    header = (RECIPES_DIR / "long_context_ulysses_32k.yaml").read_text().split("\ndefaults:")[0]
    assert "flash_attention_2" in header and "flash-attn" in header
    # the rule the recipe avoids: the same recipe on sdpa would mix documents, and decide() says so
    _, sdpa = _cluster_decisions(["recipe=long_context_ulysses_32k", "model.attn_implementation=sdpa"])
    assert not sdpa.document_masking.on and "Ulysses" in sdpa.document_masking.why


def test_flash_attention_without_its_package_is_one_config_error():
    """The recipe's kernel is a package HF imports at build time; a node without it gets one line naming the key."""
    from transformers.utils import is_flash_attn_2_available

    from ultrascale.errors import ConfigError
    from ultrascale.model.build import require_attn_kernel

    require_attn_kernel("sdpa")
    if is_flash_attn_2_available():
        require_attn_kernel("flash_attention_2")
        return
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=flash_attention_2 .*flash-attn"):
        require_attn_kernel("flash_attention_2")


def _readme_recipe_table() -> list[str]:
    """The first cells of README.md's recipe table (``| recipe | model | hardware | layout |``)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(r"\|\s*recipe\s*\|\s*model\s*\|", ln))
    names = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        names.append(ln.split("|")[1].strip().strip("`"))
    return names


def test_readme_recipe_table_lists_every_recipe_once():
    names = _readme_recipe_table()
    assert sorted(names) == RECIPES, (
        f"README.md's recipe table: missing {sorted(set(RECIPES) - set(names))}, "
        f"stale {sorted(set(names) - set(RECIPES))}, repeated {sorted({n for n in names if names.count(n) > 1})}"
    )


def test_no_readme_calls_a_required_package_not_installed():
    """A README saying "X (not installed)" beside a requirements.txt that pins X is a stale claim."""
    pinned = {
        re.split(r"[=<>\[ ;#]", ln.strip(), maxsplit=1)[0].lower()
        for ln in (ROOT / "requirements.txt").read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    }
    for md in [ROOT / "README.md", *ROOT.glob("*/README.md"), *ROOT.glob("ultrascale/*/README.md")]:
        for m in re.finditer(r"(\w[\w.-]*) \(not installed\)", md.read_text()):
            assert m.group(1).lower() not in pinned, (
                f"{md.relative_to(ROOT)}: {m.group(0)!r} but requirements.txt pins it"
            )


MEASURED = re.compile(
    r"\bmeasured\b|\btook\b|\bwent\b|\bs/step|tokens/s\b|after \d+ steps?\b|\bnats\b|perplexity \d", re.I
)
"""Words of a measured figure in a recipe header (not arithmetic such as the batch line's tokens/step)."""
COMMAND = re.compile(r"python3? (-m )?[\w./-]+|torchrun |deepspeed |make [\w-]+|dry_run=true")


def _header_blocks(name: str) -> list[str]:
    """A recipe header's ``# Key:`` blocks, each with its continuation lines."""
    head = (RECIPES_DIR / f"{name}.yaml").read_text().split("\ndefaults:")[0]
    blocks: list[list[str]] = []
    for ln in head.splitlines():
        if not ln.startswith("#") or ln.startswith("# @package"):
            continue
        if re.match(r"^# [A-Za-z][\w ./-]*:", ln) or not blocks:
            blocks.append([])
        blocks[-1].append(ln)
    return ["\n".join(b) for b in blocks]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_header_measured_figures_carry_the_command_that_reproduces_them(name):
    """``bench/results/`` is not kept, so a figure in a header is only as good as the command beside it."""
    for block in _header_blocks(name):
        if MEASURED.search(block):
            assert COMMAND.search(block), f"recipes/{name}.yaml: a measured figure without its command:\n{block}"
