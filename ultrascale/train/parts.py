"""The names of the parts a step's wall time is split into: the one list the trainer, the loggers and the
comb report share (``ultrascale/train/breakdown.py`` says how each is measured).

    data_wait_s + fwd_s + bwd_s + comm_s + opt_s + other_s = step_s
    (+ gen_s + reward_s + sync_s in a GRPO step)
"""

DATA_WAIT = "data_wait_s"
"""Waiting for the next batch: the one part that is a stall of the input pipeline, not of the step."""
RL = ("gen_s", "reward_s", "sync_s")
"""A GRPO step's own parts: generating the rollouts, scoring them in the sandbox, and (ZeRO-3) gathering the
weights the sampler runs on. Only a GRPO run's rows carry them."""
MEASURED = (DATA_WAIT, *RL, "fwd_s", "bwd_s", "comm_s", "opt_s")
"""Timed directly (host clocks on CPU, CUDA events on GPU)."""
OTHER = "other_s"
"""The rest of the step's wall time: bookkeeping, waits and Python between the timed parts."""
PARTS = (*MEASURED, OTHER)
COMPUTE = ("fwd_s", "bwd_s")
