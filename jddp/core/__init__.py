"""The strategy-agnostic training math: the task (loss, gradient, update), its state, weighted
means, loss scaling, and the Linen / NNX adapter."""
