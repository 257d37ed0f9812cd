"""split_training: backprop across the split, the stages pipelining each step among themselves."""
