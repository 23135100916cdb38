"""Does this adapter fit this base? Asked before PEFT loads one onto the other.

PEFT's own answer to an adapter of another base is torch's "Error(s) in loading state_dict"
(a shape) or a silent adapter that never reaches the modules it was trained on (a name): both
become one refusal here, naming the adapter, the base and the first modules that disagree.
The base an adapter names in its adapter_config.json, when it is a relative path, is read from
the adapter's own directory (where PEFT wrote it) before the directory the command runs in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from overdrive.errors import Problem

_PREFIX = "base_model.model."
_PIECES = (".lora_A.weight", ".lora_B.weight")
SHOWN = 3  # modules named in a refusal; the rest counted


def stored_base(adapter: Path, saved: dict) -> tuple[Optional[str], str]:
    """The base adapter_config.json names, and where that name was resolved ("" for a hub name
    or an absolute path). A relative path is taken from the adapter's directory when it exists
    there, else from the working directory, as PEFT itself would."""
    base = saved.get("base_model_name_or_path")
    if not base:
        return None, ""
    path = Path(str(base)).expanduser()
    if path.is_absolute():
        return str(path), ""
    beside = (adapter / path).resolve()
    if beside.exists():
        return str(beside), f"relative to the adapter's directory {adapter}"
    if path.exists():
        return str(path.resolve()), "relative to the working directory"
    if len(path.parts) > 2 or str(base).startswith("."):  # no hub name: a path that is nowhere here
        return str(base), f"a relative path found neither in the adapter's directory {adapter} nor here"
    return str(base), f"not in the adapter's directory {adapter} nor here, so read as a hub name"


def _adapter_shapes(adapter: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the adapter's saved weights, read from the safetensors header
    (no tensor loaded) or, for an old .bin adapter, from the file itself."""
    file = adapter / "adapter_model.safetensors"
    if file.is_file():
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    file = adapter / "adapter_model.bin"
    if file.is_file():
        import torch

        return {k: tuple(v.shape) for k, v in torch.load(file, map_location="cpu", weights_only=True).items()}
    return {}


def _in_out(module) -> Optional[tuple[int, int]]:
    if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int):
        return module.in_features, module.out_features  # Linear, and a 4-bit Linear whose weight is packed
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    if type(module).__name__ == "Conv1D":  # GPT-2's: the weight stored (in, out)
        return int(weight.shape[0]), int(weight.shape[1])
    return int(weight.shape[1]), int(weight.shape[0])


def fit_problems(model, adapter: Path, key: str, base: str) -> list[Problem]:
    """The adapter's LoRA pieces against the base's modules: each must exist and have the
    in/out features the piece was trained for."""
    modules = dict(model.named_modules())
    missing, wrong = [], []
    for name, shape in sorted(_adapter_shapes(adapter).items()):
        piece = next((p for p in _PIECES if name.endswith(p)), None)
        if piece is None or len(shape) != 2:
            continue
        path = name[: -len(piece)]
        path = path[len(_PREFIX):] if path.startswith(_PREFIX) else path
        module = modules.get(path)
        if module is None and path.startswith("model."):
            module = modules.get(path[len("model."):])
        if module is None:
            missing.append(path)
            continue
        features = _in_out(module)
        if features is None:
            continue
        expected = features[0] if piece == ".lora_A.weight" else features[1]
        got = shape[1] if piece == ".lora_A.weight" else shape[0]
        if expected != got:
            side = "in" if piece == ".lora_A.weight" else "out"
            wrong.append(f"{path} ({side} features: adapter {got}, base {expected})")
    problems = []
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    if missing:
        problems.append(Problem(key, f"the adapter in {adapter} was trained on modules the base {base} "
                                f"({model_type}) lacks: {', '.join(missing[:SHOWN])}"
                                + (f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""),
                                fix="give the base model the adapter was trained on"))
    if wrong:
        problems.append(Problem(key, f"the adapter in {adapter} does not fit the base {base} ({model_type}): "
                                f"{'; '.join(wrong[:SHOWN])}" + (f" and {len(wrong) - SHOWN} more"
                                                                 if len(wrong) > SHOWN else ""),
                                fix="give the base model the adapter was trained on"))
    return problems


def model_type_problems(model, adapter: Path, saved: dict, key: str, base: str) -> list[Problem]:
    """The base's model type against the one the adapter was trained on, when the base the
    adapter names is a directory here (its config.json says): shapes can agree across families
    (a Llama and a Mistral of one size) whose weights mean different things."""
    trained_on, _ = stored_base(adapter, saved)
    config = Path(trained_on) / "config.json" if trained_on else None
    if config is None or not config.is_file():
        return []
    try:
        theirs = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return []
    ours = getattr(getattr(model, "config", None), "model_type", None)
    if not theirs or not ours or theirs == ours:
        return []
    return [Problem(key, f"the adapter in {adapter} was trained on a {theirs} ({trained_on}, from adapter_config.json); "
                    f"the base {base} is a {ours}", fix="give the base model the adapter was trained on")]
