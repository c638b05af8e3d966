"""Online training (``python -m train stream``): follow arriving partitions, publish deltas."""
