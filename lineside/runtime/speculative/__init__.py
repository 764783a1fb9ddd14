"""Speculative decoding: a proposer guesses the next few tokens, one forward scores them all, and the
verification rule keeps exactly the ones the model itself would have produced (lossless)."""
