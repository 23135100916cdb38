"""The memory estimator: bytes per device for every strategy, before anything launches.

    shape = model_shape(resolve_source("path/to/config.json"))   # meta device, no weights
    est = estimate(shape, Setup(devices=4, precision="bf16", micro_batch=1, seq_len=2048))
    est.rows[0].total_bytes

Layout: shape.py (plain inputs) · model_shape.py (config -> meta model -> ModelShape) ·
formulas.py (model states and buffers, ZeRO paper and the implementations) · adapter.py
(the same for LoRA/QLoRA runs) ·
activations.py (Korthikanti et al. 2022, adapted) · report.py (verdict, tables, JSON, plot) ·
plan.py (the run's batch and step arithmetic).

Only shape.py, formulas.py and activations.py are imported here; they are pure arithmetic.
"""

from overdrive.memory.estimator import (  # noqa: F401  (the package's names)
    Activations, Estimate, ModelShape, OOM_MARKS, Row, STRATEGIES, Setup, adapter_row, estimate,
    estimate_activations, estimate_row, mentions_out_of_memory, model_state_row, tp_slice, uses_autocast,
    zero_paper_bytes,
)
