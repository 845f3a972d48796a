"""Test-free SSD prompts (ultrascale/data/prompts.py): what becomes a prompt, what is dropped and why.

Each test writes a small corpus (one directory per repository, as data prep reads a directory input) and
builds prompts from it through the real reader, mining and decontamination code.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from ultrascale.config.problems import ProblemsConfig
from ultrascale.data.prompts import build_prompts, load_prompt_jsonl
from ultrascale.errors import DataError

GEOMETRY = '''\
import math
from dataclasses import dataclass

UNIT = 2.0


def _scale(x):
    return x * UNIT


def circle_area(r):
    """Area of a circle of radius r, in scaled units."""

    return _scale(math.pi * r * r)


def undocumented(x):
    return x + 1


@dataclass
class Square:
    """An axis-aligned square."""

    side: float

    def area(self):
        """The square's area."""
        return math.pow(self.side, 2)

    def helper(self):
        return self.side
'''


def problems_cfg(corpus: Path, **overrides) -> DictConfig:
    cfg = OmegaConf.structured(ProblemsConfig)
    return OmegaConf.merge(cfg, {"input": str(corpus), "max_problems": None, **overrides})


def write_corpus(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def by_entry(prompts: list[dict]) -> dict[str, dict]:
    return {p["entry_point"]: p for p in prompts}


def test_documented_function_without_doctests_is_a_humaneval_shaped_prompt(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"geo/shapes.py": GEOMETRY})
    prompts, report = build_prompts(problems_cfg(corpus))
    p = by_entry(prompts)["circle_area"]
    assert p["prompt"] == (
        "import math\n\n\n"
        "UNIT = 2.0\n\n\n"
        "def _scale(x):\n    return x * UNIT\n\n\n"
        'def circle_area(r):\n    """Area of a circle of radius r, in scaled units."""\n'
    )
    assert p["reference"] == "    return _scale(math.pi * r * r)\n"
    assert (p["task_id"], p["path"], p["repo"], p["kind"]) == (
        "geo/shapes.py::circle_area",
        "geo/shapes.py",
        "geo",
        "function",
    )
    assert set(p) == {"task_id", "prompt", "entry_point", "path", "repo", "kind", "reference"}
    # the undocumented function is no candidate at all; its helper-like neighbour without a docstring neither
    assert "undocumented" not in by_entry(prompts) and "Square.helper" not in by_entry(prompts)
    assert report["undocumented"] == 3  # _scale, undocumented, Square.helper
    assert report["candidates"] == 2 and report["files"] == 1
    assert (report["kept"], report["functions"], report["methods"]) == (2, 1, 1)


def test_method_prompt_is_its_class_header_then_the_method(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"geo/shapes.py": GEOMETRY})
    prompts, _ = build_prompts(problems_cfg(corpus))
    p = by_entry(prompts)["Square.area"]
    assert p["kind"] == "method" and p["task_id"] == "geo/shapes.py::Square.area"
    # imports the method and the class header use (math, dataclass), never the module's helpers or other members
    assert p["prompt"] == (
        "import math\nfrom dataclasses import dataclass\n\n\n"
        '@dataclass\nclass Square:\n    """An axis-aligned square."""\n\n'
        '    def area(self):\n        """The square\'s area."""\n'
    )
    assert p["reference"] == "        return math.pow(self.side, 2)\n"


def test_stub_bodies_are_dropped_and_counted(tmp_path):
    corpus = write_corpus(
        tmp_path / "corpus",
        {
            "r/stubs.py": '''
            def a():
                """Does a."""
                pass


            def b():
                """Does b."""
                ...


            class Base:
                def c(self):
                    """Does c."""
                    raise NotImplementedError("subclasses do")

                def d(self):
                    """Only a docstring."""


            def real(x):
                """Not a stub: it raises something else after work."""
                if x:
                    raise ValueError(x)
                return x
            ''',
        },
    )
    prompts, report = build_prompts(problems_cfg(corpus))
    assert [p["entry_point"] for p in prompts] == ["real"]
    assert report["stub"] == 3 and report["no_body"] == 1 and report["candidates"] == 5


def test_deny_list_applies_only_on_request(tmp_path):
    corpus = write_corpus(
        tmp_path / "corpus",
        {"r/io.py": 'import os\n\n\ndef here():\n    """The working directory."""\n    return os.getcwd()\n'},
    )
    assert [p["entry_point"] for p in build_prompts(problems_cfg(corpus))[0]] == ["here"]
    with pytest.raises(DataError, match=r"no prompt survived .*'denied_name': 1"):
        build_prompts(problems_cfg(corpus), deny=True)


def test_long_prompts_and_bodies_are_dropped(tmp_path):
    body = "".join(f"    x += {i}\n" for i in range(10))
    long_doc = "\n".join(f"    line {i}" for i in range(10))
    corpus = write_corpus(
        tmp_path / "corpus",
        {
            "r/long.py": f'def long_body(x):\n    """Adds."""\n{body}    return x\n\n\n'
            f'def long_doc(x):\n    """Doc.\n\n{long_doc}\n    """\n    return x\n\n\n'
            'def short(x):\n    """Short."""\n    return -x\n',
        },
    )
    prompts, report = build_prompts(problems_cfg(corpus, max_prompt_lines=8, max_reference_lines=5))
    assert [p["entry_point"] for p in prompts] == ["short"]
    assert report["reference_too_long"] == 1 and report["prompt_too_long"] == 1


def test_duplicates_are_dropped_keeping_the_first(tmp_path):
    fn = 'def norm(v):\n    """Euclidean norm of v."""\n    return sum(x * x for x in v) ** 0.5\n'
    renamed = 'def length(v):\n    """Length of the vector."""\n    return sum(x * x for x in v) ** 0.5\n'
    other = 'def total(v):\n    """Sum of v."""\n    return sum(v)\n'
    corpus = write_corpus(tmp_path / "corpus", {"a/one.py": fn, "b/two.py": fn + "\n\n" + other, "c/three.py": renamed})
    prompts, report = build_prompts(problems_cfg(corpus))
    assert [p["task_id"] for p in prompts] == ["a/one.py::norm", "b/two.py::total"]
    assert report["duplicate_prompt"] == 1  # the same function copied to another file
    assert report["duplicate_body"] == 1  # the same body under another name and docstring


def test_humaneval_copy_is_decontaminated(tmp_path):
    from ultrascale.eval.humaneval import load_problems

    he = load_problems(1)[0]
    assert he["task_id"] == "HumanEval/0"
    clean = 'def shout(s):\n    """Upper-case s and add an exclamation mark."""\n    return s.upper() + "!"\n'
    corpus = write_corpus(
        tmp_path / "corpus", {"r/copied.py": he["prompt"] + he["canonical_solution"] + "\n\n" + clean}
    )
    prompts, report = build_prompts(problems_cfg(corpus))
    assert [p["entry_point"] for p in prompts] == ["shout"]
    assert report["humaneval_contaminated"] == 1


HELD_OUT = '''
def interleave(first, second):
    """Alternate the items of two lists, then append what is left of the longer one.

    >>> interleave([1, 2, 3], ["a"])
    [1, 'a', 2, 3]
    """
    out = []
    for a, b in zip(first, second):
        out.extend([a, b])
    shorter = min(len(first), len(second))
    return out + list(first[shorter:]) + list(second[shorter:])


def sign(x):
    """Too short for n-grams: only an identical body can catch a copy.

    >>> sign(-3)
    -1
    """
    return (x > 0) - (x < 0)


def undocumented_but_held_out(x):
    """No examples: not an evaluation problem."""
    return x * 3 + 1
'''

TRAIN = '''
def merge_alternating(first, second):
    """A copy of the held-out problem under another name and docstring."""
    out = []
    for a, b in zip(first, second):
        out.extend([a, b])
    shorter = min(len(first), len(second))
    return out + list(first[shorter:]) + list(second[shorter:])


def interleave(first, second):
    """Near copy: same code plus a guard, so only the n-gram match can catch it."""
    if not first:
        return list(second)
    out = []
    for a, b in zip(first, second):
        out.extend([a, b])
    shorter = min(len(first), len(second))
    return out + list(first[shorter:]) + list(second[shorter:])


def signum(x):
    """The sign of a number as -1, 0 or 1."""
    return (x > 0) - (x < 0)


def triple_plus_one(x):
    """Same body as a held-out function that has no doctests, hence is no evaluation problem."""
    return x * 3 + 1
'''


def test_training_prompts_never_overlap_the_validation_repos_problems(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", {"trainrepo/mod.py": TRAIN, "valrepo/mod.py": HELD_OUT})
    prep = tmp_path / "prepared"
    prep.mkdir()
    (prep / "repos.json").write_text(json.dumps({"trainrepo": "train", "valrepo": "validation"}))
    prompts, report = build_prompts(problems_cfg(corpus, train_repos_from=str(prep)))
    assert [p["task_id"] for p in prompts] == ["trainrepo/mod.py::triple_plus_one"]
    assert report["validation_contaminated"] == 3 and report["heldout_problems"] == 2
    assert report["files"] == 1 and report["files_held_out_repo"] == 1
    # without the split, both repositories are training data and nothing is held out
    everything, report = build_prompts(problems_cfg(corpus))
    assert report["validation_contaminated"] == 0 and report["heldout_problems"] == 0
    assert [p["task_id"] for p in everything] == [
        f"trainrepo/mod.py::{n}" for n in ("merge_alternating", "interleave", "signum", "triple_plus_one")
    ]
    assert report["duplicate_body"] == 3  # valrepo's three functions are now plain copies of trainrepo's


def test_max_problems_is_a_seeded_sample_in_corpus_order(tmp_path):
    files = {f"r{i}/m.py": f'def f{i}(x):\n    """Adds {i}."""\n    return x + {i}\n' for i in range(12)}
    corpus = write_corpus(tmp_path / "corpus", files)
    everything, _ = build_prompts(problems_cfg(corpus))
    a, report = build_prompts(problems_cfg(corpus, max_problems=5, seed=3))
    b, _ = build_prompts(problems_cfg(corpus, max_problems=5, seed=3))
    c, _ = build_prompts(problems_cfg(corpus, max_problems=5, seed=4))
    ids = [p["task_id"] for p in everything]
    assert len(ids) == 12 and ids == sorted(ids)
    assert [p["task_id"] for p in a] == [p["task_id"] for p in b]
    assert [p["task_id"] for p in a] != [p["task_id"] for p in c]
    assert [p["task_id"] for p in a] == [i for i in ids if i in {p["task_id"] for p in a}]
    assert report["over_max_problems"] == 7 and report["kept"] == 5


def test_prompt_jsonl_needs_only_prompt_and_names_a_bad_line(tmp_path):
    good = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "def f(x):\n    '''Double x.'''\n"},
        {"prompt": "Write g.", "task_id": "mine/g", "entry_point": "g"},
    ]
    good.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_prompt_jsonl(good)
    assert [(r["task_id"], r.get("entry_point")) for r in loaded] == [("jsonl/1", None), ("mine/g", "g")]
    assert loaded[0]["prompt"] == rows[0]["prompt"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl line 2 is not valid JSON"):
        load_prompt_jsonl(bad)
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: 'prompt' is missing"):
        load_prompt_jsonl(bad)


def test_a_prompt_jsonl_is_decontaminated_like_the_corpus_in_the_rounds_problems_stage(tmp_path):
    """method=ssd with problems.source=jsonl went straight from the file to sampling: a HumanEval prompt in it was
    trained on. The round's problems stage now runs it through the corpus's matcher (HumanEval, and with
    train_repos_from the validation repositories' problems), and the manifest counts each drop."""
    from ultrascale.config.compose import compose
    from ultrascale.eval.humaneval import load_problems
    from ultrascale.jsonio import read_jsonl
    from ultrascale.ssd.config import register_ssd_configs
    from ultrascale.ssd.rounds import Round, SSDRun

    he = load_problems(1)[0]
    clean = 'def shout(s):\n    """Upper-case s and add an exclamation mark."""\n'
    copy = TRAIN.strip("\n").splitlines(keepends=True)[:8]  # merge_alternating: a held-out body, renamed
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": he["prompt"]}, {"prompt": clean, "task_id": "mine/shout"},
            {"prompt": "".join(copy[:2]), "reference": "".join(copy[2:])}]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = write_corpus(tmp_path / "corpus", {"trainrepo/mod.py": TRAIN, "valrepo/mod.py": HELD_OUT})
    prep = tmp_path / "prepared"
    prep.mkdir()
    (prep / "repos.json").write_text(json.dumps({"trainrepo": "train", "valrepo": "validation"}))
    register_ssd_configs()
    for split, kept, dropped in ((None, ["jsonl/3", "mine/shout"], (1, 0)), (prep, ["mine/shout"], (1, 1))):
        cfg = compose([f"output_dir={tmp_path / 'run'}", "problems.source=jsonl", f"problems.jsonl={prompts}",
                       f"problems.input={corpus}", f"problems.train_repos_from={split or 'null'}"], "ssd")  # fmt: skip
        run = SSDRun(cfg)
        rnd = Round(run, 0, tmp_path / "model")
        report = run._problems(rnd)["report"]
        assert sorted(p["task_id"] for p in read_jsonl(rnd.path("problems.jsonl"))) == kept
        assert (report["humaneval_contaminated"], report["validation_contaminated"]) == dropped
        assert report["seen"] == 3 and report["kept"] == len(kept)
