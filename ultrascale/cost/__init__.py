"""The planner's cost model: memory per rank, step time, the layout both are computed for, the checkpoint
interval (Young/Daly), inference-aware model sizing and measured cluster peaks. Arithmetic only: no search."""
