"""GRPO from execution feedback: the objective, the rollouts, the rewards and the step, as parts of the one trainer
(``grpo=default``). ``loss`` is pure tensor code (TRL's arithmetic, checked against TRL's own values);
``rewards`` runs completions in the sandbox and never raises; ``rollout`` samples with the policy's weights;
``step`` is the optimizer step; ``trainer`` is :class:`~ultrascale.train.trainer.Trainer` with problems for data."""
