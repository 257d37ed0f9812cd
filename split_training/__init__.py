"""split_training: backprop across the split (distributed autograd)."""
