"""The generation phase of an objective that samples (GRPO, on-policy distillation): rollouts over
several turns, with the tools a policy may call.
"""
