"""The loop that ties the rooms together: the policy, its update, checkpoints, loggers."""
