"""Starting runs: local multi-rank launchers, DeepSpeed multi-node hostfiles, Slurm batch scripts, sweeps.

Every path ends in the same ``train.py <overrides>`` command on every rank, so a run behaves the same
whether it was started by hand, by ``python train.py launcher=...``, by a Hydra ``-m`` sweep or by Slurm.
"""
