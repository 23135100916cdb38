"""The training loop and what it is built from, in sub-packages that show the step.

    loop.py          `train(cfg)`: build the parts, run the optimizer steps, save, report
    loop_state.py    where the loop is (saved and restored whole), the result of a run
    objectives/      what a micro-batch's loss is: token, preference, GRPO, distillation, MoE's balance term
    step/            how the micro-batches go through the model, and the loss's normalisation
    guards/          non-finite, loss spike, fp16 overflow, OOM retry: decisions the loop applies
    build/           parts.py, the one builder, and what it builds: model, adapter, tokenizer, optimizers
    generation/      the rollouts of an objective that samples (GRPO's turns and tools)
    metrics.py       metrics.jsonl: its one writer and its one reader (pure)
    telemetry.py     throughput, MFU, peak memory, progress, trackers
    benchmark_eval.py  the benchmarks and sample answers of `eval.*` at each evaluation
"""
