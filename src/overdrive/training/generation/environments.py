"""The environment a policy acts in while it generates (`rl.environment`), as TRL 1.16's GRPOTrainer
takes one (`environment_factory`): an import path `module:factory` of a callable with no arguments
that returns an instance with

    reset(**row) -> str | None   called before each rollout with the prompt's data row (every column,
                                 `prompt` included); a string is appended to the last user message
    <public methods>             the environment's tools: type hints and a Google style docstring each,
                                 called by the policy as `rl.tools` are; their results are tool messages
                                 (context, never in the loss), an exception answered as `{"error": ...}`
    get_reward() -> float        optional: the rollout's reward, read once it ends, as one more reward
                                 (weight 1, named after the class) beside `rl.reward_funcs`

One instance per completion, reused (reset) from step to step; reward functions get the step's
instances as `environments=`. A rollout ends when the policy stops calling tools, at
`rl.max_tool_calling_iterations` or at `rl.max_completion_length` (TRL has no `step`/`done`: the
tools are the actions, their results the observations, and the rollout is done when no call is made).

    build(path, columns)    the probed factory (refused by `rl.environment`: import, contract, schemas)
    problems(path, columns) the same, as Problems, for `explain`
    Pool                    the instances a step uses, made once and reset each rollout
    seeded(seed)            Python's and NumPy's random streams set for a group, restored after
    streams_kept, reseed    the same split: restored once around many reseeds (a rollout's tool calls)
"""

from __future__ import annotations

import contextlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from overdrive.errors import Problem, UserError
from overdrive.training.generation import tools as tools_mod
from overdrive.training.build import user_code

KEY = "rl.environment"
_SPECIAL = ("reset", "get_reward")


@dataclass
class Environment:
    """The probed factory: what every instance it makes offers (TRL reads the class, not the instance)."""

    path: str
    factory: Callable[[], Any]
    cls: type
    tool_names: list[str]
    schemas: list[dict]
    has_reward: bool
    probe: Any = None  # the instance made to read the class: the pool's first

    @property
    def name(self) -> str:
        return self.cls.__name__


def _made(factory: Callable[[], Any], path: str) -> Any:
    try:
        return factory()
    except BaseException as error:
        if isinstance(error, user_code.PASSED_THROUGH):
            raise
        raise UserError(Problem(KEY, f"the factory {path!r} {user_code.what_it_did(error)} when called with no "
                                "arguments", fix="make the factory return an environment instance (TRL's "
                                "environment_factory: a class, or a function of no arguments)")) from None


def _public_methods(cls: type) -> list[str]:
    # On the class, as TRL lists them: on an instance, getmembers would evaluate its properties.
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in _SPECIAL and not name.startswith("_")]


def _binds(function: Callable[..., Any], arguments: dict) -> str:
    """'' when `function(**arguments)` binds, else why not."""
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as error:
        return str(error)
    except ValueError:  # a builtin without a signature: left to the call
        return ""
    return ""


def build(path: str, columns: Optional[Sequence[str]] = None) -> Environment:
    """The environment factory imported and probed once (TRL probes one instance too): `reset` present and taking
    the data's `columns` (None: not known), each public method a tool with a schema, `get_reward` taking nothing."""
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name:
        raise UserError(Problem(KEY, f"{path!r} is not an import path", fix="write `package.module:factory` (a class "
                                "or a function of no arguments returning the environment)"))
    factory = user_code.import_attribute(path, module_name, attribute, KEY)
    probe = _made(factory, path)
    cls = type(probe)
    contract = ("an environment has reset(**row) -> str | None, its tools as public methods with type hints and "
                "a docstring, and optionally get_reward() -> float (TRL's environment_factory)")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(Problem(KEY, f"the environment {cls.__name__} (from {path!r}) has no reset method",
                                fix=f"define reset(self, **kwargs): {contract}"))
    if columns is not None:
        unbound = _binds(probe.reset, {c: None for c in columns})
        if unbound:
            raise UserError(Problem(KEY, f"{cls.__name__}.reset cannot take the data row's columns "
                                    f"({', '.join(columns)}): {unbound}",
                                    fix="take the columns you need by name and **kwargs for the rest: "
                                    "def reset(self, answer=None, **kwargs)"))
    has_reward = callable(getattr(cls, "get_reward", None))
    if has_reward and _binds(probe.get_reward, {}):
        raise UserError(Problem(KEY, f"{cls.__name__}.get_reward must take no arguments (it reads the rollout's "
                                "state from the instance)", fix=f"define get_reward(self) -> float: {contract}"))
    names, schemas = _public_methods(cls), []
    for name in [*_SPECIAL, *_public_methods(cls)]:
        if inspect.iscoroutinefunction(getattr(cls, name, None)):
            raise UserError(Problem(KEY, f"{cls.__name__}.{name} is async: async environments are not supported",
                                    fix="define it with def (run any awaiting inside it, e.g. with asyncio.run)"))
    for name in names:
        schemas.append(tools_mod.schema_of(getattr(probe, name), f"{cls.__name__}.{name}", KEY))
    return Environment(path, factory, cls, names, schemas, has_reward, probe)


def problems(path: str, columns: Optional[Sequence[str]] = None) -> list[Problem]:
    try:
        build(path, columns)
    except UserError as error:
        return list(error.problems)
    return []


@dataclass
class Pool:
    """The instances a step's completions act in, one each, made as needed and reused (reset) afterwards:
    TRL's "construct once, reset often"."""

    environment: Environment
    instances: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.environment.probe is not None:
            self.instances.append(self.environment.probe)

    def take(self, count: int) -> list:
        while len(self.instances) < count:
            self.instances.append(_made(self.environment.factory, self.environment.path))
        return self.instances[:count]


def tools_of(instance: Any, environment: Environment) -> list["tools_mod.Tool"]:
    """An instance's tools: its bound methods, with the schemas read from the class."""
    return [tools_mod.Tool(name, getattr(instance, name), schema, KEY)
            for name, schema in zip(environment.tool_names, environment.schemas)]


def reset(instance: Any, row: dict, place: str) -> Optional[str]:
    """The instance reset for a rollout of `row`; what reset raises stops the run by `rl.environment` and the row
    (TRL lets it end the run: an environment that cannot start has nothing to answer the policy with)."""
    try:
        observation = instance.reset(**row)
    except BaseException as error:
        if isinstance(error, user_code.PASSED_THROUGH):
            raise
        raise UserError(Problem(KEY, f"{type(instance).__name__}.reset {user_code.what_it_did(error)}", place,
                                fix="fix reset: it is called before every rollout with the row's columns"),
                        title="the environment failed while training") from None
    if observation is not None and not isinstance(observation, str):
        raise UserError(Problem(KEY, f"{type(instance).__name__}.reset returned {type(observation).__name__}, not "
                                "a string or None", place, fix="return the text to append to the prompt, or None"),
                        title="the environment failed while training")
    return observation


def with_observation(prompt: list[dict], observation: str) -> list[dict]:
    """The prompt's turns with reset's text appended to the last message (TRL's; the row itself untouched)."""
    return prompt[:-1] + [{**prompt[-1], "content": str(prompt[-1].get("content") or "") + observation}]


def reset_group(instances: Sequence[Any], row: dict, prompt: list[dict], prompt_ids: list[int], tokenizer: Any,
                schemas: list[dict], place: str) -> tuple[list, list[list[int]]]:
    """Each completion's instance reset with the prompt's row (TRL's `reset(**row)`), and each one's prompt and its
    ids: where reset returns text, appended to the last user message and rendered again with the tools' schemas."""
    prompts, ids = [], []
    for instance in instances:
        observation = reset(instance, row, place)
        if observation is None:
            prompts.append(prompt)
            ids.append(prompt_ids)
            continue
        turns = with_observation(prompt, observation)
        prompts.append(turns)
        ids.append(list(tokenizer.apply_chat_template(turns, tools=schemas or None, add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"]))
    return prompts, ids


def reward_function(environment: Environment) -> Callable[..., list]:
    """The environment's reward as a reward function: get_reward() of each completion's instance."""
    def of(instance: Any) -> Any:
        return instance.get_reward()

    def reward(prompts, completions, environments: Sequence[Any], **columns) -> list:
        return [of(e) if type(e) is environment.cls else None for e in environments]

    reward.__name__ = environment.name
    return reward


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's and NumPy's global random streams set from `seed` (a group's) and restored after: an environment
    that draws from them draws the same on 1 process or N, and after a resume."""
    with streams_kept(), reseed(seed):
        yield


@contextlib.contextmanager
def streams_kept() -> Iterator[None]:
    """Python's and NumPy's global random streams restored after the block, however it reseeds them: a
    rollout keeps them once around all its tool calls and `reseed`s before each (saving and restoring
    NumPy's state cost 0.34 ms, a tool turn of every completion paid it; seeding costs 0.02 ms)."""
    import numpy as np  # ships with torch

    state, numpy_state = random.getstate(), np.random.get_state(legacy=False)
    try:
        yield
    finally:
        random.setstate(state)
        np.random.set_state(numpy_state)


@contextlib.contextmanager
def reseed(seed: int) -> Iterator[None]:
    """Python's and NumPy's global random streams set from `seed`, not restored (inside `streams_kept`)."""
    import numpy as np

    np.random.seed(seed % 2 ** 32)
    random.seed(seed)
    yield
