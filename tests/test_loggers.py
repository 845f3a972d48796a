"""The dashboards never cost a run its step: a view that fails (wandb's service killed, as DeepSpeed's launcher
does on Ctrl-C) turns itself off with one warning while metrics.jsonl keeps every row, wandb's service lives outside
the process that logs, and a held logger shows nothing until it is released."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT, TEST_ENV

# Run in its own interpreter: it kills a wandb service and leaves wandb's process-wide state broken behind it.
_KILLED_SERVICE = textwrap.dedent("""
    import json, logging, os, signal, sys, time
    from pathlib import Path
    import psutil
    from ultrascale.config.logger import LoggerConfig
    from ultrascale.train.loggers import MetricLogger, read_metrics

    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("ultrascale").addHandler(Keep())
    out = Path(sys.argv[1])
    m = MetricLogger(LoggerConfig(tensorboard=True, wandb=True), out, True, {"note": "test"})
    m.log(1, {"loss": 2.0})
    helper = os.environ["WANDB_SERVICE"].split("-")[1]  # the token names the process that started the service
    (service,) = [p for p in psutil.process_iter(["cmdline"]) if f"port-{helper}.txt" in " ".join(p.info["cmdline"] or [])]
    outside = service.pid not in {c.pid for c in psutil.Process().children(recursive=True)}
    service.terminate()  # what launch.py does to a rank's children on Ctrl-C
    service.wait(30)
    for step in range(2, 9):
        m.log(step, {"loss": 2.0 / step})
        m.event(step, "checkpoint", checkpoint_s=0.1)
    off = m.wandb_run is None
    m.close()
    rows = read_metrics(out / "metrics.jsonl")
    print(json.dumps({"outside": outside, "off": off, "tb": m.tb is not None, "warnings": warnings,
                      "steps": sorted({r["step"] for r in rows if "loss" in r})}))
""")


def test_a_killed_wandb_service_turns_wandb_off_with_one_warning_and_the_rows_go_on(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, **TEST_ENV}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SERVICE, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["outside"], "wandb's service is a child of the logging process (a launcher's teardown reaches it)"
    assert got["off"] and got["tb"], got  # wandb off, TensorBoard untouched
    assert len(got["warnings"]) == 1 and got["warnings"][0].startswith("wandb failed"), got["warnings"]
    assert got["steps"] == list(range(1, 9))


def test_a_held_logger_writes_metrics_jsonl_at_once_and_shows_the_rest_on_release(tmp_path, caplog):
    from ultrascale.config.logger import LoggerConfig
    from ultrascale.train.loggers import MetricLogger, read_metrics

    m = MetricLogger(LoggerConfig(tensorboard=False, wandb=False), tmp_path, True, {})
    caplog.set_level(logging.INFO, logger="ultrascale")
    m.hold()
    m.log(7, {"loss": 1.5})
    m.event(7, "stop", signal="SIGINT", checkpoint="step_00000007")
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [7, 7]  # the record is not held
    assert not [r for r in caplog.records if "step      7" in r.getMessage()]
    m.release()
    shown = [r.getMessage() for r in caplog.records if "step      7" in r.getMessage()]
    assert len(shown) == 2 and "loss 1.5" in shown[0] and "stop: signal=SIGINT" in shown[1], shown
    m.close()
