"""`peft.*`: fine-tuning through an adapter (PEFT's LoRA), and QLoRA's quantized base.

The values are handed to PEFT's own `LoraConfig` and Transformers' `BitsAndBytesConfig`
(training/build/adapter.py); nothing of either is re-implemented. The names follow theirs:
`r`, `alpha` (lora_alpha), `dropout` (lora_dropout), `target_modules`, `modules_to_save`,
`use_dora`, `use_rslora`; for qlora `bits`, `quant_type`, `double_quant`, `storage_dtype`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field

from overdrive.config.sections import Section


class PeftConfig(Section):
    """Train an adapter on a frozen base model instead of every weight."""

    method: Literal["none", "lora", "qlora"] = Field(
        "none", description="`none`: train every parameter. `lora`: a LoRA adapter on the frozen base. `qlora`: "
        "LoRA on a base quantized by bitsandbytes (4 or 8 bit, `peft.bits`)."
    )
    r: int = Field(16, ge=1, description="LoRA rank: the inner width of each adapter's two matrices.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapter's output is scaled by alpha / r "
                         "(alpha / sqrt(r) with `use_rslora`).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Modules that get an adapter: `all-linear` (every linear layer but the output "
        "head), or a list of module names (`q_proj`, `v_proj`, ...; a name matches a module whose path ends with it)."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full beside the adapter and saved with it "
        "(e.g. `lm_head`, `embed_tokens` after adding tokens)."
    )
    use_dora: bool = Field(False, description="DoRA: weight-decomposed LoRA (a magnitude vector per module).")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    bits: Literal[4, 8] = Field(4, description="qlora: bits per frozen base weight.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="qlora, 4 bit: the data type (NormalFloat4 or FP4).")
    double_quant: bool = Field(True, description="qlora, 4 bit: quantize the quantization constants too.")
    storage_dtype: Literal["auto", "uint8", "float32", "bfloat16", "float16"] = Field(
        "auto", description="qlora, 4 bit: the dtype packed 4-bit weights are stored in. `auto`: uint8, or under FSDP "
        "the dtype FSDP computes in (bf16/fp16 mixed precision, else the model's float dtype): FSDP casts every float "
        "parameter to it on each all-gather, which must leave the packed bytes alone. DeepSpeed under bf16/fp16 casts "
        "float parameters too: a float storage dtype there must be that one."
    )
    adapter_path: Optional[str] = Field(
        None, description="Continue training an adapter that exists: a PEFT adapter directory (adapter_config.json "
        "and its weights). Its r, alpha, targets, dropout and method are checked against `peft.*`, key by key."
    )
    save_merged: bool = Field(
        False, description="Also write the base with the adapter merged in (`merge_and_unload`) to "
        "`<output_dir>/merged`, loadable by AutoModelForCausalLM. The base model's own files are never written."
    )
