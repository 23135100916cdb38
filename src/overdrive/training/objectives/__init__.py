"""What a micro-batch's loss is: one class per objective (objective.py's contract), each with its data,
its metrics, the guards' measure and, for RL and on-policy distillation, a generation phase.

    objective.py        the contract and the token objective (causal LM, classification)
    preference*.py      DPO, IPO, SimPO, ORPO, KTO, the reward model, as TRL defines them; reference.py
    grpo*.py            GRPO and its family (TRL's arithmetic), rewards.py and reward_checks.py
    distill*.py         logit distillation from a teacher (TRL's generalised JSD)
    moe.py              a mixture of experts' router balance term, a second term of the token loss
"""
