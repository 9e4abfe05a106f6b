"""Model names a client may send: the served names and their aliases.

A served name (`model_names`) is what the engines serve and what metrics and usage are
labelled with. An alias is another name for a served model, optionally with its own
default thinking mode, so code written for another platform works unchanged:

    [model_aliases]
    deepseek-chat = { thinking = false }              # built in
    deepseek-reasoner = { thinking = true }           # built in
    claude-sonnet-4-5 = "DeepSeek-V4.1-Flash"         # shorthand: the served name only

An alias without `model` names the first served model. The built-in DeepSeek platform
names are always present; a configured entry of the same name replaces one. An alias's
`thinking` is the default for requests that do not ask themselves (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator


class ModelAlias(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="The served name; none: the first of model_names.")
    thinking: bool | None = Field(None, description="Thinking mode of requests that do not ask; none: the gateway's.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"model": value} if isinstance(value, str) else value


BUILTIN_ALIASES: dict[str, ModelAlias] = {
    "deepseek-chat": ModelAlias(thinking=False),
    "deepseek-reasoner": ModelAlias(thinking=True),
}


def check_aliases(model_names: tuple[str, ...], aliases: Mapping[str, ModelAlias]) -> None:
    """Every alias names a served model and no alias hides a served name (ValueError otherwise)."""
    for name, alias in aliases.items():
        if name in model_names:
            raise ValueError(f"{name}: is a served model name (model_names), not an alias")
        if alias.model is not None and alias.model not in model_names:
            raise ValueError(f"{name}: model {alias.model!r} is not served (model_names: {', '.join(model_names)})")


def _with_builtins(aliases: dict[str, ModelAlias], info: ValidationInfo) -> dict[str, ModelAlias]:
    merged = {**BUILTIN_ALIASES, **aliases}
    model_names = info.data.get("model_names")
    if model_names:  # absent when model_names itself failed validation: that error is reported
        check_aliases(tuple(model_names), merged)
    return merged


# The settings field type: the configured table plus the built-in names, checked against
# `model_names` (which must be declared before it).
ModelAliases = Annotated[dict[str, ModelAlias], AfterValidator(_with_builtins)]


@dataclass(frozen=True)
class ModelTarget:
    """What a requested name resolves to."""

    served: str
    thinking: bool | None  # the name's default thinking mode; None: the gateway's default


class ModelCatalog:
    """Resolves requested names; lists the names a caller may use (served names first)."""

    def __init__(self, model_names: tuple[str, ...], aliases: Mapping[str, ModelAlias] = BUILTIN_ALIASES):
        check_aliases(model_names, aliases)
        self.served = model_names
        self._targets = {name: ModelTarget(name, None) for name in model_names}
        for name, alias in aliases.items():
            self._targets[name] = ModelTarget(alias.model or model_names[0], alias.thinking)

    def resolve(self, name: str) -> ModelTarget | None:
        return self._targets.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def visible(self, allows: Callable[[str], bool]) -> list[tuple[str, str]]:
        """(name, served name) of every name `allows` admits by itself or by its served name."""
        return [(name, t.served) for name, t in self._targets.items() if allows(name) or allows(t.served)]
