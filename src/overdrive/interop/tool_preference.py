"""The preference stages of Axolotl, LLaMA-Factory and torchtune configs, onto `preference.*`.

Each tool hands its trainers TRL's (or its own copy of TRL's) losses under other names:

    Axolotl        rl: dpo | ipo | orpo | simpo | kto; rl_beta (dpo_beta before it), orpo_alpha (ORPO's
                   beta, as Axolotl passes it to TRL), simpo_gamma, cpo_alpha (TRL's CPOConfig default 1.0
                   adds the chosen NLL to SimPO: overdrive's SimPO has none, so only 0 is read),
                   dpo_label_smoothing, kto_desirable_weight / kto_undesirable_weight
    LLaMA-Factory  stage: dpo | kto | rm; pref_beta, pref_loss: sigmoid | ipo | orpo | simpo, simpo_gamma,
                   dpo_label_smoothing, kto_chosen_weight / kto_rejected_weight; pref_ftx (an SFT term in
                   the DPO loss) only at 0
    torchtune      the DPO recipes' loss component: DPOLoss (beta, label_smoothing), SimPOLoss (beta, gamma)

The reference model is the one training starts from (the adapter disabled under LoRA), as in each
tool by default; a reference named otherwise is refused by its key. What has no counterpart
(PPO and the other online stages but Axolotl's GRPO, read by interop/tool_rl.py, hinge and other loss variants, an SFT term mixed in) is
refused by the file's key, saying what overdrive runs instead.
"""

from __future__ import annotations

from typing import Any, Optional

from overdrive.interop.tool_common import ToolReader

OFFERED = "overdrive trains dpo, ipo, orpo, simpo, kto and reward models (preference.method)"
AXOLOTL_RL = ("dpo", "ipo", "orpo", "simpo", "kto")
LLAMAFACTORY_LOSSES = {"sigmoid": "dpo", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}


def _number(value: Any) -> float:
    return float(value)


def method(r: ToolReader, name: str, *path: str) -> None:
    r.put("preference.method", name, *path)
    r.put("data.format", "preference", *path)


def axolotl(r: ToolReader) -> Optional[str]:
    """`rl:` and its keys; the method, or None for a supervised run."""
    rl = r.get("rl")
    if r.given("reward_model") and r.data["reward_model"] not in (False, "none"):
        r.put("preference.method", "reward", "reward_model")
        r.put("model.task", "sequence-classification", "reward_model")
        r.put("data.format", "preference", "reward_model")
        r.put_key("center_rewards_coefficient", "preference.center_rewards_coefficient", _number)
        r.get("num_labels")  # one score per sequence: the reward head
        return "reward"
    if r.given("process_reward_model") and r.data["process_reward_model"] not in (False, "none"):
        r.refuse(("process_reward_model",), "a process reward model (a score per step) has no counterpart", OFFERED)
    if rl in (None, False, "none"):
        return None
    rl = str(rl).lower()
    if rl == "grpo":  # online RL, onto rl.* (interop/tool_rl.py)
        from overdrive.interop.tool_rl import axolotl_grpo

        axolotl_grpo(r)
        return rl
    if rl not in AXOLOTL_RL:
        r.refuse(("rl",), f"rl: {rl!r} is a training stage overdrive does not run (an online or other loss)",
                 f"{OFFERED}, and GRPO (rl: grpo, onto rl.*); train this stage with Axolotl")
        return None
    loss_type = r.get("dpo_loss_type")
    if rl == "dpo" and loss_type:
        names = loss_type if isinstance(loss_type, list) else [loss_type]
        if [str(n) for n in names] == ["ipo"]:
            rl = "ipo"
        elif [str(n) for n in names] != ["sigmoid"]:
            r.refuse(("dpo_loss_type",), f"DPO loss {loss_type!r} has no counterpart", "use sigmoid or ipo")
    method(r, rl, "dpo_loss_type" if loss_type and rl == "ipo" else "rl")
    beta_key = "orpo_alpha" if rl == "orpo" and r.given("orpo_alpha") else "rl_beta" if r.given("rl_beta") else \
        "dpo_beta" if r.given("dpo_beta") else None
    r.used.update({"rl_beta", "dpo_beta", "orpo_alpha"})
    if beta_key:
        r.put("preference.beta", _number(r.data[beta_key]), beta_key)
    r.put_key("dpo_label_smoothing", "preference.label_smoothing", _number)
    r.put_key("simpo_gamma", "preference.simpo_gamma", _number)
    r.put_key("kto_desirable_weight", "preference.desirable_weight", _number)
    r.put_key("kto_undesirable_weight", "preference.undesirable_weight", _number)
    if rl == "simpo":
        alpha = r.get("cpo_alpha")
        if alpha is None or float(alpha) != 0:
            r.refuse(("cpo_alpha",) if alpha is not None else ("rl",), "SimPO here is TRL's CPO loss with cpo_alpha "
                     f"0; {'cpo_alpha ' + str(alpha) if alpha is not None else 'unset, TRL CPOConfig default 1.0,'} "
                     "adds the chosen answer's NLL", "set cpo_alpha: 0 (or train this stage with Axolotl)")
    for key, what in (("rpo_alpha", "an NLL term added to the DPO loss (RPO)"),
                      ("dpo_use_weighting", "WPO's weighting of the pairs"), ("dpo_norm_loss", "a normalised DPO loss"),
                      ("ref_model", "a reference model other than the one training starts from")):
        value = r.get(key)
        if value not in (None, False, 0, 0.0):
            r.refuse((key,), f"{what} has no counterpart", f"remove {key}: the reference is the model training "
                     "starts from" if key == "ref_model" else f"remove {key}")
    return rl


def axolotl_dataset(r: ToolReader, path: tuple[str, ...], entry: dict, rl: str, out: dict) -> bool:
    """An `rl:` run's dataset `type` (Axolotl's DPO / KTO strategies) onto the preference layouts; False
    when the type has no counterpart (refused here)."""
    kind = str(entry.get("type") or "")
    style = kind.split(".")[-1] if "." in kind else kind
    if kind.startswith("chat_template") and style in ("chat_template", "default"):
        out["layout"] = "messages"
        out["prompt_column"] = entry.get("field_messages") or "messages"
        mapping = entry.get("message_property_mappings") or {}
        if mapping.get("role", "role") == "from":
            out["layout"] = "sharegpt"
            out["messages_column"] = out.pop("prompt_column")
        roles = entry.get("roles") or {}
        if any(list(v) != [k] for k, v in roles.items() if isinstance(v, list)):
            r.c.warn(path + ("roles",), "roles are read as their names (user, assistant, system, tool)")
    elif kind.startswith("chat_template") and style == "argilla_chat":
        out["layout"] = "messages"  # the prompt is what chosen and rejected share (TRL's implicit prompt):
        out["prompt_column"] = "-"  # a column no row has
    elif kind == "bradley_terry.chat_template":  # a reward model's rows: system, input, chosen, rejected text
        out.update(layout="alpaca", prompt_column="input", input_column="-")
    elif style in ("intel", "prompt_pairs", "ultra", "argilla", "icr") and not kind.startswith("chat_template"):
        # a prompt column, one user turn, rendered by the chat template here (not the tool's ChatML text)
        out["layout"] = "alpaca"
        out["prompt_column"] = {"intel": "question", "prompt_pairs": "prompt", "ultra": "prompt",
                                "icr": "input"}.get(style, entry.get("field_prompt") or "instruction")
        out["input_column"] = "-"  # the prompt column is the whole user turn: no input column beside it
        if style == "argilla":
            out["chosen_column"], out["rejected_column"] = "chosen_response", "rejected_response"
        r.c.warn(path + ("type",), f"{kind} read as prompt/chosen/rejected columns: the prompt is rendered by the "
                 "tokenizer's chat template, not the strategy's own text")
    elif kind in ("", "passthrough", "user_defined.default") or style == "passthrough":
        for field, target in (("field_prompt", "prompt_column"), ("field_chosen", "chosen_column"),
                              ("field_rejected", "rejected_column"), ("field_system", "system_column")):
            if entry.get(field):
                out[target] = entry[field]
        if entry.get("prompt_format") or entry.get("chosen_format"):
            r.refuse(path + ("prompt_format",), "a prompt format string has no counterpart (the chat template "
                     "renders the prompt)", "drop the format strings")
            return False
    else:
        r.refuse(path + ("type",), f"{rl} dataset type {kind!r} has no counterpart in overdrive", "use type: "
                 "chat_template.default (prompt turns + chosen / rejected), chat_template.argilla_chat, "
                 "chatml.prompt_pairs / intel / ultra, or rows already in prompt/chosen/rejected columns")
        return False
    for field, target in (("field_chosen", "chosen_column"), ("field_rejected", "rejected_column")):
        if entry.get(field) and target not in out:
            out[target] = entry[field]
    if rl == "kto" and entry.get("field_label"):
        out["label_column"] = entry["field_label"]
    return True


def llamafactory(r: ToolReader, stage: str) -> None:
    """`stage: dpo | kto | rm` and the pref_* / kto_* keys."""
    if stage == "rm":
        method(r, "reward", "stage")
        r.put("model.task", "sequence-classification", "stage")
        r.c.warn(("stage",), "LLaMA-Factory's reward model is a value head on the LM scoring the last token; "
                 "here it is a sequence-classification head trained with the same pairwise loss")
        return
    if stage == "kto":
        method(r, "kto", "stage")
    else:
        loss = str(r.get("pref_loss", "sigmoid")).lower()
        if loss not in LLAMAFACTORY_LOSSES:
            r.refuse(("pref_loss",), f"pref_loss {loss!r} has no counterpart", "use sigmoid (dpo), ipo, orpo or "
                     "simpo (preference.method)")
            return
        method(r, LLAMAFACTORY_LOSSES[loss], "pref_loss" if r.given("pref_loss") else "stage")
    r.put_key("pref_beta", "preference.beta", _number)
    r.put_key("dpo_label_smoothing", "preference.label_smoothing", _number)
    r.put_key("simpo_gamma", "preference.simpo_gamma", _number)
    r.put_key("kto_chosen_weight", "preference.desirable_weight", _number)
    r.put_key("kto_rejected_weight", "preference.undesirable_weight", _number)
    for key, what in (("pref_ftx", "an SFT term added to the preference loss"),
                      ("pref_bco_weight", "BCO's term added to the DPO loss"),
                      ("ref_model", "a reference model other than the one training starts from"),
                      ("ref_model_adapters", "reference adapters"), ("ld_alpha", "LD-DPO's length weighting")):
        value = r.get(key)
        if value not in (None, False, 0, 0.0, ""):
            r.refuse((key,), f"{what} has no counterpart", f"remove {key}" + (
                " (the reference is the model training starts from)" if key.startswith("ref_") else ""))
    r.get("ref_model_quantization_bit")


def torchtune_loss(r: ToolReader, loss: dict, name: str) -> bool:
    """A DPO recipe's loss component; False when it is not a preference loss read here."""
    where = ("loss", "_component_")
    if name == "DPOLoss":
        method(r, "dpo", *where)
        if loss.get("label_smoothing") is not None:
            r.put("preference.label_smoothing", float(loss["label_smoothing"]), "loss", "label_smoothing")
    elif name == "SimPOLoss":
        method(r, "simpo", *where)
        if loss.get("gamma") is not None:
            r.put("preference.simpo_gamma", float(loss["gamma"]), "loss", "gamma")
    else:
        return False
    if loss.get("beta") is not None:
        r.put("preference.beta", float(loss["beta"]), "loss", "beta")
    else:
        r.default("preference.beta", 0.1 if name == "DPOLoss" else 2.0, f"{name}'s beta default")
    if name == "SimPOLoss" and loss.get("gamma") is None:
        r.default("preference.simpo_gamma", 0.5, "SimPOLoss's gamma default")
    reference = (r.get("ref_checkpointer") or {}).get("checkpoint_dir")
    policy = (r.get("checkpointer") or {}).get("checkpoint_dir")
    if reference and reference != policy:
        r.refuse(("ref_checkpointer", "checkpoint_dir"), "a reference model other than the one training starts "
                 "from has no counterpart", "point ref_checkpointer at the policy's checkpoint_dir, or remove it")
    return True
