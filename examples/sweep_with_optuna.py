"""Drive Optuna yourself, with overdrive configs as the trials.

`overdrive sweep` does all of this from a `sweep:` section; this is for when the search loop
is yours (your own sampler, callbacks, or a study shared with other code). Each trial is a
real `overdrive train` of `load_config(*files, overrides=space(trial))` in its own output
directory, reports its eval loss for pruning, and returns the last one.

    python examples/sweep_with_optuna.py                         # the embedded default job, shortened
    python examples/sweep_with_optuna.py run.yaml --trials 10    # your config
"""

from __future__ import annotations

import argparse

import optuna

from overdrive.sweep import objective


def space(trial: optuna.Trial) -> dict:
    """Dotted config keys -> the trial's values: anything `load_config(overrides=...)` takes."""
    return {
        "optim.lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True),
        "training.micro_batch_size": trial.suggest_categorical("micro_batch_size", [4, 8]),
        "scheduler.warmup_steps": trial.suggest_int("warmup_steps", 0, 20, step=10),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="run config files (none: the embedded default job)")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--output-dir", default="runs/optuna-example")
    args = parser.parse_args()
    # Short trials for the example: a few evaluations to prune on. Drop these for real runs.
    short = [] if args.configs else ["training.max_steps=60", "training.eval_every_steps=20", "data.max_bytes=2000000"]

    study = optuna.create_study(direction="minimize", pruner=optuna.pruners.MedianPruner(n_startup_trials=2))
    study.optimize(objective(*args.configs, space=space, cli=short, output_dir=args.output_dir), n_trials=args.trials)
    best = study.best_trial
    print(f"best: trial {best.number}, eval_loss {best.value:.4f}, {best.params}")
    print(f"its run: {args.output_dir}/trial-{best.number:04d}")


if __name__ == "__main__":
    main()
