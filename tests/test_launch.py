"""Launch plumbing that needs no ranks: hostfiles, launcher command lines, the sbatch script (golden),
shell syntax of every script in launch/, network presets, sweep bookkeeping and the -m-inside-a-launcher guard.

Regenerate the sbatch goldens after an intended change with ``UPDATE_GOLDEN=1 pytest tests/test_launch.py``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launch.hostfile import expand_nodelist, hostfile_text, resolve_hosts
from launch.hostfile import main as hostfile_main
from launch.slurm import render_sbatch
from launch.spawn import is_driver, launcher_argv
from launch.sweep import collect, group_name, summarize
from tests.conftest import check, launch
from ultrascale.config.compose import compose
from ultrascale.errors import ConfigError
from ultrascale.paths import PROJECT_ROOT

GOLDEN = Path(__file__).parent / "golden"
LAUNCH = PROJECT_ROOT / "launch"

# (golden file, overrides): a 2-node InfiniBand recipe with requeue, and a 1-node torchrun job without it.
SBATCH_CASES = {
    "sbatch_starcoder2_7b_2node.sh": [
        "recipe=starcoder2_7b_zero3",
        "launcher=slurm",
        "launcher/env=infiniband",
        "launcher.slurm.partition=gpu",
        "launcher.slurm.account=proj42",
        "launcher.slurm.time=2-00:00:00",
        "output_dir=/scratch/runs/sc2_7b",
    ],
    "sbatch_cpu_smoke_torchrun.sh": [
        "recipe=cpu_smoke",
        "launcher=slurm",
        "launcher.slurm.node_launcher=torchrun",
        "launcher.slurm.requeue=false",
        "launcher.master_port=29600",
        "launcher.slurm.extra=[--exclusive]",
        "optim.lr=1e-3",
        "output_dir=/scratch/runs/smoke lr 1e-3",
    ],
}


def _render(overrides: list[str]) -> str:
    return render_sbatch(compose(overrides), overrides).replace(str(PROJECT_ROOT), "/path/to/ultrascale")


@pytest.mark.parametrize("name", sorted(SBATCH_CASES))
def test_sbatch_golden(name):
    text = _render(SBATCH_CASES[name])
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"sbatch for {name} changed; UPDATE_GOLDEN=1 if intended"


def test_sbatch_carries_the_run():
    text = _render(SBATCH_CASES["sbatch_starcoder2_7b_2node.sh"])
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --requeue",
        "export NCCL_IB_HCA=mlx5",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]:
        assert line in text.splitlines(), line
    srun = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("srun "))
    assert "launch/node.sh train.py recipe=starcoder2_7b_zero3" in srun
    assert srun.split()[-2:] == ["output_dir=/scratch/runs/sc2_7b", "&"]  # pinned: requeues resume the same run


def test_sbatch_quotes_overrides(tmp_path):
    """A value with spaces reaches train.py as one argument: run the rendered srun line with an echo stand-in."""
    text = _render(SBATCH_CASES["sbatch_cpu_smoke_torchrun.sh"])
    srun = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("srun ")).removesuffix(" &")
    out = subprocess.run(
        ["bash", "-c", f"srun() {{ printf '%s\\n' \"$@\"; }}; {srun}"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[-1] == "output_dir=/scratch/runs/smoke lr 1e-3"


def _shell_scripts() -> list[Path]:
    return sorted(p for p in LAUNCH.rglob("*") if p.is_file() and (p.suffix == ".sh" or _has_sh_shebang(p)))


def _has_sh_shebang(p: Path) -> bool:
    with open(p, "rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and (b"bash" in first or first.rstrip().endswith(b"/sh"))


def test_every_shell_script_parses(tmp_path):
    """``bash -n`` on every script in launch/ and on freshly rendered sbatch scripts."""
    scripts = _shell_scripts()
    assert LAUNCH / "node.sh" in scripts
    for name, overrides in SBATCH_CASES.items():
        (tmp_path / name).write_text(render_sbatch(compose(overrides), overrides))
        scripts.append(tmp_path / name)
    for p in scripts:
        res = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert res.returncode == 0, f"bash -n {p}: {res.stderr}"


def test_node_sh_refuses_without_master(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    res = subprocess.run(["bash", str(LAUNCH / "node.sh"), "train.py"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "set MASTER_ADDR" in res.stderr


def test_expand_nodelist():
    assert expand_nodelist("gpu[01-03,10],login1") == ["gpu01", "gpu02", "gpu03", "gpu10", "login1"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("node[098-101]") == ["node098", "node099", "node100", "node101"]
    for bad, match in [("a[3-1]", "backwards"), ("a[1-2", "unbalanced"), ("a[x]", "bad range"), ("a,a", "twice")]:
        with pytest.raises(ConfigError, match=match):
            expand_nodelist(bad)


def test_hostfile(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert hostfile_text(resolve_hosts([], None, 2), 1) == "node0 slots=1\nnode1 slots=1\n"
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[7-8]")
    assert resolve_hosts([], None, None) == ["gpu7", "gpu8"]
    with pytest.raises(ConfigError, match="only 2 hosts"):
        resolve_hosts([], None, 3)
    out = tmp_path / "hostfile"
    assert hostfile_main(["--slots", "8", "-o", str(out), "a", "b[1-2]"]) == 0
    assert out.read_text() == "a slots=8\nb1 slots=8\nb2 slots=8\n"
    assert hostfile_main(["--slots", "0", "a"]) == 2
    assert "at least one slot" in capsys.readouterr().err


def test_launcher_argv(tmp_path):
    cfg = compose(["launcher=deepspeed", "launcher.nproc_per_node=4"])
    cmd = launcher_argv(cfg.launcher, "train.py", ["zero=stage2"], port=1234)
    assert cmd[0].endswith("deepspeed") and cmd[1:] == [
        "--num_gpus",
        "4",
        "--master_port",
        "1234",
        "train.py",
        "zero=stage2",
    ]
    with pytest.raises(ConfigError, match=r"needs launcher\.hostfile"):
        launcher_argv(compose(["launcher=deepspeed", "launcher.nnodes=2"]).launcher, "train.py", [])
    hf = tmp_path / "hostfile"
    hf.write_text("a slots=8\nb slots=8\n")
    cmd = launcher_argv(
        compose(["launcher=deepspeed", "launcher.nnodes=2", f"launcher.hostfile={hf}"]).launcher, "t.py", [], 9
    )
    assert cmd[1:5] == ["--hostfile", str(hf), "--num_nodes", "2"]
    cmd = launcher_argv(compose(["launcher=torchrun"]).launcher, "train.py", [], port=77)
    assert cmd[0].endswith("torchrun") and cmd[1:] == ["--nproc_per_node", "2", "--master_port", "77",
                                                        "--max-restarts", "0", "--signals-to-handle",
                                                        "SIGTERM,SIGINT,SIGUSR1", "--shutdown-timeout", "300", "train.py"]  # fmt: skip
    with pytest.raises(ConfigError, match="one node per invocation"):
        launcher_argv(compose(["launcher=torchrun", "launcher.nnodes=2"]).launcher, "train.py", [])


def test_is_driver(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not is_driver(compose([]))  # launcher=local trains in this process
    assert is_driver(compose(["launcher=deepspeed"]))
    assert not is_driver(compose(["launcher=deepspeed", "dry_run=true"]))
    monkeypatch.setenv("WORLD_SIZE", "2")  # inside a launcher: a rank, never a driver
    assert not is_driver(compose(["launcher=deepspeed"]))


@pytest.mark.parametrize("preset", ["infiniband", "roce", "efa", "nvlink"])
def test_network_presets(preset):
    env = compose([f"launcher/env={preset}"]).launcher.env
    assert env["ULTRASCALE_NET_PRESET"] == preset
    assert all(isinstance(v, str) for v in env.values())
    # every setting carries its one-line reason as a comment on its own line
    for line in (PROJECT_ROOT / "conf" / "launcher" / "env" / f"{preset}.yaml").read_text().splitlines():
        if line and not line.startswith("#"):
            assert "  # " in line, f"{preset}.yaml: setting without a reason: {line}"
    assert compose([]).launcher.env == {}


def test_multirun_inside_a_launcher_is_refused(monkeypatch, capsys):
    from ultrascale.cli import run_app

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert run_app("train", lambda cfg: pytest.fail("must not run"), "", ["-m", "optim.lr=1e-4,3e-4"]) == 2
    err = capsys.readouterr().err
    assert "error: -m inside a multi-rank launcher" in err and "launcher=deepspeed" in err


def test_sweep_group_and_summary(tmp_path):
    assert group_name("multirun/2026-11-22/10-00-00") == "2026-11-22_10-00-00"
    assert group_name("runs/lr_sweep") == "lr_sweep"
    sweep = tmp_path / "lr_sweep"
    for num, lr, summary in [(0, "1e-4", '{"final_loss": 2.5, "tokens_per_s": 1234.5}'), (1, "3e-4", None)]:
        (sweep / str(num) / ".hydra").mkdir(parents=True)
        (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={lr}\n- launcher=deepspeed\n")
        if summary:
            (sweep / str(num) / "summary.json").write_text(summary)
    (sweep / "1" / "job_status.json").write_text('{"returncode": 1}')
    rows = collect(sweep)
    assert [(r["overrides"], r["status"], r["final_loss"]) for r in rows] == [
        ("optim.lr=1e-4", "done", 2.5),
        ("optim.lr=3e-4", "failed (exit 1)", None),
    ]
    path, text = summarize(sweep)
    assert path.read_text().splitlines()[0].startswith("job,overrides,status,final_loss")
    assert "1,234.5" in text and "failed (exit 1)" in text


def test_slurm_sweep_writes_one_sbatch_per_job(tmp_path):
    """``-m ... launcher=slurm``: every job its own sbatch script, run dir and wandb group (no Slurm here, so
    ``launcher.slurm.submit=false`` stops before ``sbatch``)."""
    sweep = tmp_path / "lr_sweep"
    args = ["-m", "optim.lr=1e-4,3e-4", "launcher=slurm", "launcher.nnodes=2", "launcher.slurm.submit=false",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = check(launch(args, launcher="python", timeout=120))
    for num, lr in [(0, "0.0001"), (1, "0.0003")]:
        text = (sweep / str(num) / "sbatch.sh").read_text()
        assert "#SBATCH --nodes=2" in text and f"#SBATCH --output={sweep / str(num)}/logs/slurm-%j.out" in text
        srun = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("srun "))
        assert f"optim.lr={lr}" in srun and "logger.wandb_group=lr_sweep" in srun
        assert srun.split()[-2:] == [f"output_dir={sweep / str(num)}", "&"]
        assert subprocess.run(["bash", "-n", str(sweep / str(num) / "sbatch.sh")]).returncode == 0
    rows = collect(sweep)
    assert [r["status"] for r in rows] == ["sbatch written", "sbatch written"]
    assert "sweep summary" in proc.stdout


@pytest.mark.parametrize("value", ["/s/launcher=torchrun,optim=muon,train.seed=1", "/s/it's [a, b]", "runs/plain-1.x"])
def test_a_sweep_job_passes_its_directory_as_one_value_whatever_its_name(value):
    """A job directory named by its overrides (``hydra.sweep.subdir='${hydra.job.override_dirname}'``, as an
    ablation sweep names its runs) holds ``=`` and ``,``: passed on unquoted, its launch failed in Hydra's grammar
    ("mismatched input '='") and every job of the sweep exited 1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launch.spawn import override

    parsed = OverridesParser.create().parse_override(override("output_dir", value))
    assert parsed.key_or_group == "output_dir" and parsed.value() == value
