"""`compile.*` -> Accelerate's TorchDynamoPlugin (torch.compile applied inside prepare)."""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig


def dynamo_plugin(cfg: RunConfig) -> Any:
    from accelerate.utils import TorchDynamoPlugin

    c = cfg.compile
    plugin = TorchDynamoPlugin(
        backend=(c.backend or "no").upper(),
        mode=c.mode or "default",
        fullgraph=c.fullgraph,
        dynamic=c.dynamic,
        use_regional_compilation=c.regional,
    )
    # The plugin reads ACCELERATE_DYNAMO_USE_DYNAMIC when `dynamic` is None ("torch decides"):
    # put the configured value back so the environment cannot change it.
    plugin.dynamic = c.dynamic
    return plugin
