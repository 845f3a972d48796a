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
