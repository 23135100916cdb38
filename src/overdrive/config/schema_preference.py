"""`preference.*`: training on pairs of answers, one preferred (`data.format: preference`).

The names are TRL's, so a TRL user finds the knob they know: `beta` (DPOConfig, CPOConfig;
ORPOConfig's `beta` is the paper's lambda), `label_smoothing`, `simpo_gamma`
(CPOConfig with `loss_type="simpo"`), `precompute_ref_log_probs` (here
`precompute_reference`), `center_rewards_coefficient` (RewardConfig), `desirable_weight` / `undesirable_weight` (KTOConfig). The losses are TRL's
(training/objectives/preference_loss.py).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from overdrive.config.sections import Section

# Methods that compare the policy with a reference model (the others need none).
WITH_REFERENCE = ("dpo", "ipo", "kto")


class PreferenceConfig(Section):
    """Preference training: DPO, IPO, ORPO, SimPO and reward models on chosen/rejected pairs; KTO on rows
    marked desirable or not."""

    method: Literal["none", "dpo", "ipo", "orpo", "simpo", "reward", "kto"] = Field(
        "none", description="`none`: the model task's own loss. `dpo`: TRL's DPO (sigmoid) loss against a reference "
        "model; `ipo`: its IPO loss (length-normalised log-ratios); `orpo`: odds-ratio loss plus the chosen answer's "
        "NLL, no reference; `simpo`: SimPO (length-normalised log-probs with a margin), no reference; `reward`: a "
        "reward model, a scalar head (`model.task: sequence-classification`) trained with TRL's RewardTrainer loss "
        "(Bradley-Terry); `kto`: TRL's KTO loss on unpaired rows (a prompt, a completion, a desirable/undesirable "
        "label; pairs are split into one of each) against a reference model. All need `data.format: preference` "
        "(docs/preference.md)."
    )
    beta: float = Field(
        0.1, gt=0, description="DPO/IPO: the strength of the tie to the reference (IPO's tau is 1/beta). ORPO: the "
        "weight of the odds-ratio term (the paper's lambda). SimPO: the reward scale (the paper uses about 2.0). KTO: "
        "the strength of the tie to the reference."
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="DPO and SimPO: the assumed share of pairs whose preference is flipped "
        "(conservative DPO); 0 is the plain loss."
    )
    simpo_gamma: float = Field(
        0.5, ge=0.0, description="SimPO: the target reward margin gamma (TRL's `simpo_gamma`)."
    )
    center_rewards_coefficient: Optional[float] = Field(
        None, ge=0.0, description="Reward: the weight of a penalty on the mean of (chosen + rejected reward)^2, which "
        "keeps the rewards centred on 0 (TRL's `center_rewards_coefficient`). Empty: none."
    )
    precompute_reference: bool = Field(
        False, description="DPO/IPO: compute the reference model's log-probs of every pair once before the first "
        "step (with the starting weights) and keep them in output_dir, instead of a reference forward at every "
        "step: no second model in memory for full-parameter training."
    )
    desirable_weight: float = Field(
        1.0, gt=0, description="KTO: the weight of the desirable rows' losses (TRL's `desirable_weight`); with "
        "fewer desirable than undesirable rows, raise it so that weight x count is about equal on both sides."
    )
    undesirable_weight: float = Field(
        1.0, gt=0, description="KTO: the weight of the undesirable rows' losses (TRL's `undesirable_weight`)."
    )
