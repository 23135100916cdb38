"""The run config as a value: the schema (RunConfig and its sections), dotted keys, where each
value came from, the strict YAML/JSON reader, the batch arithmetic, the optimizer catalogue and
redaction. Nothing here imports from overdrive but errors/console: resolving a config from its
layers, and validating it against the strategies, is overdrive.resolving's work."""

from overdrive.config.provenance import Origin
from overdrive.config.schema import RunConfig

__all__ = ["Origin", "RunConfig"]
