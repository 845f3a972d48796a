"""ultrascale: DeepSpeed training recipes for code LMs, composed from typed Hydra configs."""

__version__ = "0.1.0"
