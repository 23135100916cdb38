"""A plain Accelerate script, as a user would write it: a bare `Accelerator()`.

Run by `overdrive launch tests/user_script_probe.py -c CONFIG OUT.json`. It trains a few
steps of a tiny GPT-2 on random tokens and rank 0 writes OUT.json with what its Accelerator
was configured with (mixed_precision, gradient_accumulation_steps, distributed_type,
num_processes, zero_stage, offload, fsdp_version), the share of the parameter elements each rank
holds after prepare (`fraction`, one entry per rank), the losses, and its own argv.
"""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

accelerator = Accelerator()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = torch.utils.data.DataLoader(torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(0)),
                                     batch_size=4)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)


def held_here(param):
    """Elements of this parameter on this rank: a ZeRO-3 partition, an FSDP2 shard, or all."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.numel(), param.ds_numel
    if hasattr(param, "to_local"):
        return param.to_local().numel(), param.numel()
    return param.numel(), param.numel()


local, total = map(sum, zip(*(held_here(p) for p in model.parameters())))
fractions = accelerator.gather(torch.tensor([local / total])).tolist()

losses = []
for batch in loader:
    with accelerator.accumulate(model):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach().float(), "mean").item())

state = accelerator.state
report = {
    "argv": sys.argv[1:],
    "mixed_precision": accelerator.mixed_precision,
    "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
    "distributed_type": str(accelerator.distributed_type).split(".")[-1],
    "num_processes": accelerator.num_processes,
    "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
    "ds_bf16": state.deepspeed_plugin.deepspeed_config.get("bf16", {}).get("enabled") if state.deepspeed_plugin else None,
    "offload": [state.deepspeed_plugin.offload_param_device, state.deepspeed_plugin.offload_optimizer_device]
    if state.deepspeed_plugin else None,
    "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
    "fraction": fractions,
    "losses": losses,
}
if accelerator.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
accelerator.wait_for_everyone()
accelerator.end_training()
