"""What keeps a bad step out of the weights: each guard decides, the loop applies the decision before
the optimizer steps (a non-finite loss, a loss spike, an fp16 overflow the scaler skipped, an
out-of-memory step redone at a smaller micro-batch).
"""
