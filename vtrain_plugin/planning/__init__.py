"""Planning on top of the estimate: plan search, time and cost to train, compute-optimal model size."""
