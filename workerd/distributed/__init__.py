"""Where a rank sits in the TP x PP grid, its collectives, its device, and how a
hung collective is released."""
