"""Self-distillation for code (SSD): sample once from the frozen model, drop empty and stub responses, finetune.

The default (``method=ssd``) is the paper's method (Zhang et al. 2026, arXiv 2604.01193): one sample per prompt
from the frozen input model at a training temperature with top-k/top-p truncation; only empty responses and
single-line stubs are dropped; no tests, no execution, no verifier; plain SFT on the raw samples (prompt masked);
the result is decoded at a separate evaluation temperature (``python -m ultrascale.ssd.evaluate`` picks it on a
dev split). ``method=rft`` (rejection-sampling finetuning) differs in three places: its problems need tests, it
samples several completions per problem, and it executes each in the kernel sandbox and keeps only those that pass.

``python -m ultrascale.ssd ssd=smollm2_135m`` runs it; ultrascale/ssd/README.md has the whole chain (import,
data prep, continued pretraining, SSD rounds, eval) and, per stage of a round, the module that runs it.
"""
