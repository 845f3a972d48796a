"""The names of what a run directory holds: one list for the trainer that writes it and the report, export,
eval and SSD code that read it (the readers must not import the trainer's torch-heavy modules for a name).

    <output_dir>/config.yaml  ds_config.json  metrics.jsonl  summary.json  checkpoints/latest ...
"""

CONFIG = "config.yaml"
DS_CONFIG = "ds_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
"""In ``checkpoints/``: the tag of the newest complete checkpoint, replaced atomically after the save."""
META = "ultrascale_meta.json"
"""In each checkpoint tag directory: world size, topology, ZeRO stage, data offset and every file's size."""
ATTEMPTS = "attempts"
"""``attempts/NNN/config.yaml`` + ``ds_config.json``: each start's resolved config, kept even when it failed; the
run's own pair is replaced by an attempt's only once its checkpoint has loaded."""
STOP_REQUEST = "STOP"
"""Written by whoever asks the run to checkpoint and stop at its next step (the Slurm batch script on USR1, the
train.py driver on Ctrl-C, a user with ``echo why > STOP``); rank 0 removes it once the run has stopped."""
STOPPED = "STOPPED"
"""Written (JSON: signal, step, checkpoint) when the run stopped before its last step with a checkpoint: the
Slurm batch script requeues the job when it finds it. Removed when the next attempt starts."""
