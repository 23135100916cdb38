"""How a step's micro-batches go through the model, whichever objective: the forward-backward
(plain, context parallel, the pipeline's schedule), the loss normalised over the global batch
(step_loss.py, loss_tokens.py), the loss kernels that spare the whole logits, activation offloading.
"""
