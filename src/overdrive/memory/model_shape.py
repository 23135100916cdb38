"""MODEL_OR_CONFIG -> a Transformers config -> a model on the meta device -> ModelShape.

The meta device gives every parameter's shape without allocating or downloading a byte of
weights, so the estimate counts exactly the tensors the real model will have (tied
embeddings once, biases, norms) instead of a closed-form guess. torch and transformers are
imported here, inside functions, so `overdrive --help` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

from overdrive.errors import Problem, UserError
from overdrive.hf.model_config import quiet_transformers
from overdrive.memory.shape import ModelShape

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig
    from overdrive.memory.shape import Setup, Target

_YAML = (".yaml", ".yml")


@dataclass
class Source:
    """What MODEL_OR_CONFIG turned out to be."""

    config: Any  # transformers.PretrainedConfig
    name: str
    run: Any = None  # RunConfig when a run config was given
    task: str = "causal-lm"
    attn_implementation: Optional[str] = None


def load_run_config(path: Optional[str], cli: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from files and key=value items, through the layered resolver."""
    from overdrive.resolving import resolve

    return resolve(files=[path] if path else [], cli=list(cli)).config


def hf_config_for_run(cfg: RunConfig) -> Any:
    """The Transformers config a run would build, without weights or tokenizer."""
    from overdrive.hf.model_config import model_config

    vocab = None if cfg.model.name_or_path else cfg.tokenizer.vocab_size
    try:
        with quiet_transformers():
            return model_config(cfg, vocab)
    except UserError:
        raise
    except Exception as error:  # offline hub name, bad local directory
        raise UserError(Problem("model.name_or_path", f"cannot read the model config: {error}",
                                fix="give a local directory with config.json, or a config.json file")) from None


def resolve_source(spec: str, cli: Sequence[str] = ()) -> Source:
    with quiet_transformers():
        return _resolve_source(spec, cli)


def _resolve_source(spec: str, cli: Sequence[str]) -> Source:
    path = Path(spec).expanduser()
    if path.suffix.lower() in _YAML:
        if not path.is_file():
            raise UserError(Problem("", f"no such run config: {spec}"))
        cfg = load_run_config(str(path), cli)
        name = cfg.model.name_or_path or f"{cfg.model.architecture.get('model_type', '?')} ({path.name})"
        return Source(hf_config_for_run(cfg), name, run=cfg, task=cfg.model.task,
                      attn_implementation=cfg.model.attn_implementation)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(Problem("", f"{spec} has no config.json", fix="point at a save_pretrained directory"))
        path = path / "config.json"
    if path.is_file():
        return Source(_config_from_json(path), spec)
    from overdrive import hub

    hub.refuse_if_unreadable("MODEL", spec)  # before Transformers is imported
    from transformers import AutoConfig

    try:
        with hub.reading("MODEL", spec):
            config = AutoConfig.from_pretrained(spec)
    except UserError:
        raise
    except Exception as error:
        raise UserError(Problem("", f"{spec!r} is neither a local path nor a hub model whose config could be read "
                                    f"({type(error).__name__})",
                                fix="pass a directory with config.json, a config.json file, or a run YAML")) from None
    return Source(config, spec)


def _config_from_json(path: Path) -> Any:
    from transformers import AutoConfig

    from overdrive.config.sources import parse_text, read_text

    data, _ = parse_text(read_text(path, "model config"), str(path), json_first=True)
    if not isinstance(data, dict):
        raise UserError(Problem("", f"{path} must hold a JSON object", fix="is it a Transformers config.json?"))
    model_type = data.pop("model_type", None)
    if not model_type:
        raise UserError(Problem("", f"{path} has no `model_type`", fix="is it a Transformers config.json?"))
    for key in ("architectures", "transformers_version", "_name_or_path"):
        data.pop(key, None)
    from overdrive.hf.model_config import unknown_model_type

    problem = unknown_model_type("model_type", model_type, str(path))
    if problem is not None:
        raise UserError(problem)
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as error:
        raise UserError(Problem("", f"{path}: {error}")) from None


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def build_meta_model(config: Any, task: str = "causal-lm", attn_implementation: Optional[str] = None):
    import torch
    import transformers

    from overdrive.hf.model_config import auto_class
    from overdrive.hf.vision import is_vision_config

    cls = auto_class(task, vision=is_vision_config(config))
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        try:
            return cls.from_config(config, **kwargs)
        except ValueError:
            if task != "causal-lm":
                raise
            return transformers.AutoModel.from_config(config, **kwargs)


def _blocks(model) -> list:
    """The repeated layers: the ModuleList holding most parameters."""
    import torch

    best, best_count = [], 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = list(module), count
    return best


# Transformers' tensor-parallel styles -> the dimension of a weight they split (bias: dim 0 for
# column-wise, whole for row-wise). transformers/distributed/tensor_parallel.py.
_SPLIT_DIM = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "packed_colwise": 0,
              "rowwise": -1, "rowwise_rep": -1, "rowwise_split_input": -1, "packed_rowwise": -1,
              "embedding_rowwise": 0, "embedding_colwise": 1}


def _tp_splits(model) -> dict[int, int]:
    """id(parameter) -> the dimension the model's tensor-parallel plan splits it along."""
    import re

    plan = getattr(model, "tp_plan", None) or {}
    rules = [(re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"$"), style) for pattern, style in plan.items()]
    found = {}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")
        style = next((style for rule, style in rules if rule.match(module)), None)
        dim = _SPLIT_DIM.get(style or "")
        if dim is None or (kind == "bias" and dim != 0):
            continue
        found[id(param)] = dim if dim >= 0 else param.dim() - 1
    return found


def shape_of_model(model, name: str) -> ModelShape:
    import torch

    from overdrive.config import experts as moe
    from overdrive.hf.vision import is_vision_config

    # A vision-language model's sizes are its language model's (text_config); its tower and projector are
    # counted by part (the estimator leaves frozen parts without gradients or optimizer state).
    vision = is_vision_config(model.config)
    config = model.config.get_text_config() if vision else model.config
    params = list(model.parameters())  # deduplicated: a tied embedding appears once
    experts = moe.experts_of(config)
    expert_ids = {id(p) for n, p in model.named_parameters() if moe.is_expert_parameter(n)} if experts else set()
    blocks = _blocks(model)
    block_params = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    largest_module, autocast_params, gated = 0, 0, False
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        largest_module = max(largest_module, sum(p.numel() for p in own))
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear) or kind == "Conv1D":
            autocast_params += sum(p.numel() for p in own)
        if module_name.endswith(("gate_proj", "gate_up_proj", "w1", "wi_0")):
            gated = True
    if output is not None and not isinstance(output, torch.nn.Linear):
        autocast_params += sum(p.numel() for p in output.parameters())
    norm: Literal["layernorm", "rmsnorm"] = (
        "rmsnorm" if any("RMSNorm" in type(m).__name__ for m in model.modules()) else "layernorm")
    splits = _tp_splits(model)
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model"))
    heads = int(_first(config, "num_attention_heads", "n_head"))
    activation = _first(config, "hidden_act", "activation_function", default="gelu")
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    norms = {n.rpartition(".")[2]: m.weight.numel() for n, m in (blocks[0].named_modules() if blocks else [])
             if n.endswith(("q_norm", "k_norm")) and getattr(m, "weight", None) is not None}
    return ModelShape(
        name=name,
        model_type=str(getattr(config, "model_type", "?")),
        params=sum(p.numel() for p in params),
        param_shapes=tuple(tuple(p.shape) for p in params),
        layers=int(_first(config, "num_hidden_layers", "n_layer", default=len(blocks))),
        hidden=hidden,
        heads=heads,
        kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        intermediate=_intermediate(config, experts, hidden),
        vocab=int(_first(config, "vocab_size")),
        block_params=block_params,
        root_params=sum(p.numel() for p in params if id(p) not in in_blocks),
        hidden_matrix_params=sum(p.numel() for p in params if id(p) in in_blocks and p.dim() == 2),
        largest_module_params=largest_module,
        autocast_params=autocast_params,
        mlp="gated" if gated else "plain",
        activation=str(activation),
        norm=norm,
        attn_dropout=float(_first(config, "attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", default=0.0)),
        resid_dropout=float(_first(config, "resid_pdrop", "hidden_dropout", "hidden_dropout_prob", default=0.0)),
        embd_dropout=float(_first(config, "embd_pdrop", "embedding_dropout", "hidden_dropout_prob", default=0.0)),
        attn_implementation=getattr(config, "_attn_implementation", None),
        rotary=any(n.endswith("rotary_emb") for n, _ in model.named_modules()),
        learned_positions=any(isinstance(m, torch.nn.Embedding) and n.endswith(("wpe", "position_embeddings"))
                              for n, m in model.named_modules()),
        tp_split=tuple(splits.get(id(p), -1) for p in params) if splits else (),
        block_tp_split_params=sum(p.numel() for p in blocks[0].parameters() if id(p) in splits) if blocks and splits else 0,
        experts=experts.experts if experts else 0,
        top_k=experts.top_k if experts else 0,
        expert_params=sum(p.numel() for p in params if id(p) in expert_ids),
        expert_tensors=tuple(id(p) in expert_ids for p in params) if expert_ids else (),
        parts=_parts(model, params) if vision else (),
        vision_hidden=int(_first(model.config.vision_config, "hidden_size", "embed_dim", default=0)) if vision else 0,
        vision_layers=int(_first(model.config.vision_config, "num_hidden_layers", "depth", default=0)) if vision else 0,
        explicit_head_dim=head_dim if head_dim != hidden // heads else 0,
        q_norm=norms.get("q_norm", 0),
        k_norm=norms.get("k_norm", 0),
    )


def _parts(model, params: list) -> tuple[str, ...]:
    """Per unique parameter, the part of a vision-language model it belongs to (hf/vision.part_of)."""
    from overdrive.hf.vision import part_of

    where: dict[int, str] = {}
    for name, param in model.named_parameters():
        where.setdefault(id(param), part_of(name))
    return tuple(where[id(p)] for p in params)


def _intermediate(config, experts, hidden: int) -> int:
    """The MLP width one token's activations take: a mixture of experts' top_k experts side by side."""
    dense = int(_first(config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden)
    if experts is None:
        return dense
    return experts.top_k * int(_first(config, "moe_intermediate_size", default=dense))


def model_shape(source: Source) -> ModelShape:
    model = build_meta_model(source.config, source.task, source.attn_implementation)
    return shape_of_model(model, source.name)


def run_shape(cfg: RunConfig) -> ModelShape:
    """The shape of the model a run config trains (meta device, no weights): built once by
    whoever estimates for a run, and handed to `run_estimate` for every size it tries."""
    name = cfg.model.name_or_path or str(cfg.model.architecture.get("model_type"))
    return model_shape(Source(hf_config_for_run(cfg), name, run=cfg, task=cfg.model.task,
                              attn_implementation=cfg.model.attn_implementation))


def adapter_of_run(cfg: RunConfig):
    """What an adapter run (peft.method lora/qlora) trains, counted by PEFT itself on the model
    on the meta device (memory/adapter.py); None for full training. Cached per model and peft
    section: the tuner and the auto micro-batch estimate one run at many sizes."""
    if cfg.peft.method == "none":
        return None
    import json

    key = json.dumps([cfg.model.model_dump(mode="json"), cfg.peft.model_dump(mode="json"),
                      cfg.tokenizer.model_dump(mode="json")], sort_keys=True, default=str)
    if key not in _ADAPTERS:
        from overdrive.memory.adapter import adapter_shape

        from overdrive.hf.vision import frozen_parts_pattern, is_vision_config

        model = build_meta_model(hf_config_for_run(cfg), cfg.model.task, cfg.model.attn_implementation)
        # A vision-language model: the adapter leaves the frozen parts out, as training/build/adapter.py does.
        exclude = frozen_parts_pattern(cfg.model.vision) if is_vision_config(model.config) else None
        _ADAPTERS[key] = adapter_shape(model, cfg.peft, base_bytes=4 if cfg.model.dtype in ("float32", "auto") else 2,
                                       exclude=exclude)
    return _ADAPTERS[key]


_ADAPTERS: dict[str, Any] = {}


def teacher_params_of_run(cfg: RunConfig) -> int:
    """The parameters of a distillation teacher (`distill.teacher`), counted on the meta device from its
    config (no weights); 0 without one. Cached per teacher, as the adapter is."""
    if cfg.distill.teacher is None:
        return 0
    if cfg.distill.teacher not in _TEACHERS:
        from overdrive.hf.teacher import teacher_config

        with quiet_transformers():
            config = teacher_config(cfg)
        _TEACHERS[cfg.distill.teacher] = model_shape(Source(config, cfg.distill.teacher)).params
    return _TEACHERS[cfg.distill.teacher]


_TEACHERS: dict[str, int] = {}


def run_setup(cfg: RunConfig, target: Target = "cuda", **changes: Any) -> Setup:
    """The estimator's input built from a run: its Setup (memory/shape.setup_for_run) with the
    adapter it trains attached. The one place this is done: plan, estimate, the tuner and the
    auto micro-batch all size what trains."""
    from dataclasses import replace

    from overdrive.memory.shape import setup_for_run

    setup = setup_for_run(cfg, target, **changes)
    if cfg.distill.teacher is not None:  # a frozen teacher beside the student, placed as it is
        setup = replace(setup, teacher_params=teacher_params_of_run(cfg),
                        teacher_bytes=2 if cfg.model.dtype in ("bfloat16", "float16") else 4)
    adapter = changes.get("adapter", adapter_of_run(cfg))
    return replace(setup, adapter=adapter) if adapter is not None else setup


def run_estimate(cfg: RunConfig, target: Target = "cuda", shape: Optional[ModelShape] = None, **changes):
    """The estimate of a run config's own strategy: the one place the estimator's input is
    built from a run (the plan, the tuner, the auto micro-batch). `changes` go to the Setup."""
    from overdrive.memory import estimate
    from overdrive.memory.shape import strategy_of_run

    return estimate(shape or run_shape(cfg), run_setup(cfg, target, **changes), (strategy_of_run(cfg),))
