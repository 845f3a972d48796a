"""What the warm forkserver (``tests/support/warm.py``) imports once, before it forks any rank.

The third-party modules every launch of ``train.py`` imports (torch, DeepSpeed, transformers and the model classes
the tests build, Hydra, matplotlib for the report), and transformers' lazy tables touched once, so a forked rank
starts where a fresh one would be after several seconds of imports. Importing has no side effect a rank could
notice: no thread is started and nothing is read from the environment that a test changes (``warm.STARTUP_ENV``
lists what is, and a launch that changes it is not forked). First-party code is imported by each rank.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # what ultrascale.report does before it draws; headless

import deepspeed  # noqa: F401
import hydra  # noqa: F401
import matplotlib.pyplot
import numpy  # noqa: F401
import omegaconf  # noqa: F401
import psutil  # noqa: F401
import torch
import torch.distributed  # noqa: F401
import transformers
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

for _model_type in ("llama", "mixtral", "qwen2"):  # the model types the tests build: their config and modeling
    AutoConfig.for_model(_model_type)
import transformers.models.llama.modeling_llama  # noqa: E402
import transformers.models.mixtral.modeling_mixtral  # noqa: E402, F401
