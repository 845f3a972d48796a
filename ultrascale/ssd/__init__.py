"""Self-distillation for code (SSD): sample from the model, execute in the sandbox, keep what passes, finetune.

``python -m ultrascale.ssd ssd=smollm2_135m`` runs it; ultrascale/ssd/README.md has the whole chain (import,
data prep, continued pretraining, SSD rounds, eval). One module per job: ``mine`` + ``problems`` (the problem
source), ``execute`` (the sandbox verdict), ``sample``, ``sft`` (the loss-masked finetuning set), ``finetune``
(train.py + export), ``evaluate`` (HumanEval) and ``rounds`` (stages, manifests, resume).
"""
