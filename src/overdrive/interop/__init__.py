"""Accelerate's and DeepSpeed's own files, in both directions.

    tables.py            the key tables: Accelerate and DeepSpeed names and the schema keys they map to
    reading.py           Accelerate YAML/JSON, ACCELERATE_* variables and DeepSpeed JSON -> settings
    deepspeed_reading.py DeepSpeed JSON -> settings
    deepspeed_config.py  run config -> the DeepSpeed dict (template, extra, "auto" filled)
    writing.py           run config -> Accelerate YAML, DeepSpeed JSON, `accelerate launch` flags
    tool_reading.py      Axolotl (axolotl.py), LLaMA-Factory (llamafactory.py, llamafactory_v1.py) and torchtune
                         (torchtune.py) training configs -> settings, over tool_common.py
"""
