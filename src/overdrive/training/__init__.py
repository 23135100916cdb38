"""The training loop and what it is built from.

    loop.py          `train(cfg)`: build the parts, run the optimizer steps, save, report
    settle.py        the run config settled once: the resume plan, the auto micro-batch, the Accelerator
    parts.py         the one builder of a run's parts and of its step's pieces:
    objective.py       what a micro-batch's loss is (token, classification; preference.py: pairs)
    forward_backward.py  how micro-batches go through the model (plain, context parallel; pipeline.py: stages)
    step_loss.py       the loss's normalisation over the global batch: units, ignore index, scale
    metrics.py       metrics.jsonl: its one writer and its one reader (pure)
    model.py         the model through the Transformers Auto classes
    tokenizer.py     a pretrained tokenizer, or a byte-level BPE trained on the data and cached
    optimization.py  AdamW and its learning-rate schedule
    telemetry.py     throughput, MFU, peak memory, metrics.jsonl, progress, trackers
    autobatch.py     `training.micro_batch_size: auto`
    nonfinite.py     keeping a NaN/inf step out of the weights
"""
