"""A Transformers causal LM cut at its decoder layers into pipeline stages.

Each stage is the whole model with what it does not run removed: the first keeps the
embedding, the last the final norm and the head, every stage its own decoder layers, kept
under their own numbers (a ModuleDict keyed "0", "1", ...), so a stage's parameter names are
the whole model's and the stages' state dicts join into the one `save_pretrained` writes.
Its forward is the model's own, layer by layer: the causal mask from Transformers'
`create_causal_mask`, rotary position embeddings where the family has them (Llama-like), learned
positions on the first stage where it has those (GPT-2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    layers: str  # the decoder layer list on the base model
    embeddings: tuple[str, ...]  # what the first stage keeps
    norm: str  # the final norm the last stage keeps


LLAMA_LIKE = Family("layers", ("embed_tokens",), "norm")
GPT2_LIKE = Family("h", ("wte", "wpe"), "ln_f")


def family_of(model) -> Family:
    base = model.base_model
    if hasattr(base, "layers") and hasattr(base, "embed_tokens") and hasattr(base, "norm"):
        return LLAMA_LIKE
    if hasattr(base, "h") and hasattr(base, "wte") and hasattr(base, "ln_f"):
        return GPT2_LIKE
    raise ValueError(f"{type(model).__name__} is neither Llama-like nor GPT-2-like: no known decoder layer list")


class StageModule(nn.Module):
    """Decoder layers [start, end) of `model`, with the embedding when `first`, the final norm
    and the head when `last`. Takes token ids (first) or hidden states; returns hidden states,
    or logits (last)."""

    def __init__(self, model, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.family, self.first, self.last = family_of(model), first, last
        self.lm = model
        base = model.base_model
        layers = getattr(base, self.family.layers)
        setattr(base, self.family.layers, nn.ModuleDict({str(i): layers[i] for i in range(start, end)}))
        if not first:
            for name in self.family.embeddings:
                setattr(base, name, None)
        if not last:
            setattr(base, self.family.norm, None)
            model.lm_head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        base = self.lm.base_model
        hidden = self._embed(base, x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        extra = {"position_ids": positions}
        if getattr(base, "rotary_emb", None) is not None:
            extra["position_embeddings"] = base.rotary_emb(hidden, position_ids=positions)
        for layer in getattr(base, self.family.layers).values():
            hidden = layer(hidden, attention_mask=mask, **extra)
            if isinstance(hidden, tuple):  # Transformers before 5 returned (hidden, ...)
                hidden = hidden[0]
        if self.last:
            hidden = self.lm.lm_head(getattr(base, self.family.norm)(hidden))
        return hidden

    def _embed(self, base, ids: torch.Tensor) -> torch.Tensor:
        if self.family is GPT2_LIKE:
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            return base.drop(base.wte(ids) + base.wpe(positions))
        return base.embed_tokens(ids)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the whole model's names."""
        return {name[len("lm."):]: value for name, value in self.state_dict().items()}


def cut(model, layer_ranges: list[tuple[int, int]], stage_ids: list[int]) -> list[StageModule]:
    """The stages `stage_ids` of `model` (of len(layer_ranges) stages). With one stage the
    model itself is cut; with several each is cut from its own copy."""
    count, stages = len(layer_ranges), []
    for k, stage in enumerate(stage_ids):
        source = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        start, end = layer_ranges[stage]
        stages.append(StageModule(source, start, end, first=stage == 0, last=stage == count - 1))
    return stages
