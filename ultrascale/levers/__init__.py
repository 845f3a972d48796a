"""Policy: what the run does with the config it was given on the machine it has. ``decide`` makes every choice
once (``Decisions``), ``rules`` refuses configs that cannot run, ``hardware`` holds the per-CPU/GPU tables, and
``deepspeed`` turns config + decisions into the DeepSpeed JSON."""
