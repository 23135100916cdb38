"""The rules that need the model's own config: Transformers' config of the run (AutoConfig, no
weights), read before anything launches, so `explain` and `train` refuse what the loop would only
find once the weights are loaded (data.max_length over the model's positions, model.moe.* on a
dense model, heads, experts and layers against the layout, QLoRA of stacked experts).

Reading the config costs the import of Transformers (seconds). A config that asks nothing of the
model's shape and whose inline architecture states its positions is judged from the mapping
alone: `overdrive explain` of the embedded run stays without torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from overdrive.config.experts import qlora_problems
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError
from overdrive.strategies import layout

Where = Callable[[str], str]
# What a model that cannot be read here is refused by (a hub name offline, a missing directory).
UNREADABLE_KEYS = ("model.name_or_path", "model.revision")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")


def asks_the_shape(cfg: RunConfig) -> bool:
    """Whether a rule below asks the model's config beyond its positions: a layout axis that
    splits the model, experts, a quantized base, gradient checkpointing, a loss kernel by name."""
    lay, moe = layout.layout(cfg), cfg.model.moe
    return (lay.tp > 1 or lay.sp > 1 or lay.pp > 1 or cfg.parallel.ep_size > 1 or cfg.peft.method == "qlora"
            or moe.top_k is not None or moe.aux_loss_coef is not None or cfg.model.gradient_checkpointing
            or cfg.training.loss_kernel in ("chunked", "fused"))


def positions(config: Any) -> Optional[int]:
    """The longest sequence the model takes (a Transformers config, or an inline mapping)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    return next((get(name) for name in _POSITION_FIELDS if get(name)), None)


def positions_problems(cfg: RunConfig, config: Any, where: Where = lambda key: "") -> list[Problem]:
    limit, seq = positions(config), cfg.data.max_length
    if limit is None or seq <= limit:
        return []
    return [Problem("data.max_length", f"{seq} is longer than the model's {limit} positions", where("data.max_length"),
                    f"set data.max_length <= {limit}")]


def read(cfg: RunConfig) -> tuple[Any, list[Problem]]:
    """(the Transformers config the run builds, or None; the problems reading it met). A model
    that cannot be read is a problem keyed by UNREADABLE_KEYS; model.moe.* refused on the model
    (config/experts.apply_overrides) is keyed by its own key."""
    from overdrive.hf.model_config import model_config, quiet_transformers

    vocab = None if cfg.model.name_or_path else cfg.tokenizer.vocab_size
    try:
        with quiet_transformers():
            return model_config(cfg, vocab), []
    except UserError as error:
        refused = list(error.problems)
        if any(p.key.startswith("model.moe.") for p in refused):  # the model read without them: its other rules
            config, more = read(cfg.model_copy(update={"model": cfg.model.model_copy(update={"moe": type(cfg.model.moe)()})}))
            return config, refused + more
        return None, refused
    except Exception as error:  # a bad local directory, a config.json Transformers cannot parse
        return None, [Problem("model.name_or_path", f"cannot read the model config: {error}",
                              fix="give a local directory with config.json, or a hub name that can be read")]


def model_rules(cfg: RunConfig, where: Where = lambda key: "") -> tuple[list[Problem], list[Problem]]:
    """(problems, unreadable): every rule of the model's config, each named by key and where it was
    set; `unreadable`: the model could not be read here (train refuses it; explain, which may be
    given a config meant for another machine, says it could not check)."""
    found = layout.loop_problems(cfg)  # the loop's own limits (sequence parallel), no model needed
    if not cfg.model.from_scratch:
        from overdrive import hub

        found += [p for p in [hub.weightless_local(
            "model.name_or_path", cfg.model.name_or_path,
            "save the model with save_pretrained (its weights too), or set model.from_scratch=true to start "
            "from random weights of this config")] if p]
    arch = dict(cfg.model.architecture)
    if not cfg.model.name_or_path and not asks_the_shape(cfg) and positions(arch) is not None:
        return _placed(found + positions_problems(cfg, arch), where), []
    config, problems = read(cfg)
    unreadable = [p for p in problems if p.key in UNREADABLE_KEYS]
    found += [p for p in problems if p.key not in UNREADABLE_KEYS]
    if config is not None:
        found += shape_rules(cfg, config)
    return _placed(found, where), _placed(unreadable, where)


def shape_rules(cfg: RunConfig, config: Any, where: Where = lambda key: "") -> list[Problem]:
    """The rules of a model config already read (`estimate` has it from its MODEL argument):
    positions, heads, experts and layers against the layout, QLoRA of stacked experts."""
    from overdrive.resolving.validate_loss import model_rules as loss_rules

    return _placed(positions_problems(cfg, config) + layout.model_problems(cfg, config)
                   + qlora_problems(cfg.peft.method, config)  # stacked experts stay unquantized
                   + loss_rules(cfg, config) + checkpointing_problems(cfg, config)
                   + staged_experts_problems(cfg, config), where)


def staged_experts_problems(cfg: RunConfig, config: Any) -> list[Problem]:
    """A mixture of experts' router balance term under pipeline stages: the term sums every MoE
    layer's router, and each stage holds some of the layers, so it would be dropped."""
    from overdrive.config.experts import experts_of

    experts = experts_of(config)
    if (experts is None or not experts.aux_loss_coef or layout.layout(cfg).pp <= 1
            or cfg.model.task != "causal-lm" or cfg.preference.method != "none"):
        return []
    return [Problem("parallel.pp_size", f"the router balance term of this mixture of experts (coefficient "
                    f"{experts.aux_loss_coef:g}) sums every MoE layer's router, and each pipeline stage holds some of "
                    "the layers: the term would be dropped", fix="set parallel.pp_size=1 (parallel.ep_size spreads "
                    "the experts instead), or model.moe.aux_loss_coef=0 to train without the balance term")]


def checkpointing_problems(cfg: RunConfig, config: Any) -> list[Problem]:
    """`model.gradient_checkpointing` on a model class that does not support it (a class attribute:
    known from the config's class, as training/build/model.py finds it on the model built)."""
    if not cfg.model.gradient_checkpointing:
        return []
    from overdrive.hf.model_config import model_class

    cls = model_class(config, cfg.model.task)
    if cls is None or getattr(cls, "supports_gradient_checkpointing", True):
        return []
    return [Problem("model.gradient_checkpointing", f"{cls.__name__} does not support it",
                    fix="set model.gradient_checkpointing=false")]


def _placed(problems: list[Problem], where: Where) -> list[Problem]:
    from dataclasses import replace

    return [p if p.where else replace(p, where=where(p.key)) for p in problems]


def explained(config: RunConfig, chains) -> tuple[list[Problem], list[Problem]]:
    """`overdrive explain`'s rules (resolve.Rules): the model's rules are errors, as train's; a model
    that cannot be read here (a config meant for another machine) is a warning that says so."""
    from dataclasses import replace

    from overdrive.config.provenance import where

    errors, unreadable = model_rules(config, lambda key: where(chains, key, unset="default"))
    return errors, [replace(p, message=f"{p.message} (the rules that need the model's config were not checked "
                            "here)") for p in unreadable]
