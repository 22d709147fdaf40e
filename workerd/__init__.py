"""kvloom workerd: one rank of the worker group; runs its model shard on SchedulerOutput diffs."""
