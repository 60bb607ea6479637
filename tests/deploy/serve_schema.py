"""Strict offline validation of a Ray Serve config (the `serve deploy` YAML / `serveConfigV2`).

`ServeDeploySchema.model_validate` alone is lenient: it silently ignores unknown keys at every
level (a typo such as `placement_group_bundle` passes), takes dicts for `autoscaling_config`
and friends without validating them (`Union[Dict, AutoscalingConfig]`), and does not check the
placement-group strategy (only `Deployment.options()` does, at deploy time). This module closes
those gaps:

    from serve_schema import validate_serve_config      # with tests/deploy on sys.path
    schema = validate_serve_config(yaml.safe_load(text))  # raises ServeConfigError

`validate_serve_config` runs, in order: the pydantic model; a recursive unknown-key check of
the raw dict against each model's `model_fields` (aliases accepted), which also validates dicts
that a Union would let through against the model they stand for; and, per deployment, Serve's
own `Deployment.options(...)` with the config's options. Needs only `ray[serve]`, no cluster.
"""
from __future__ import annotations

import types
import typing
import warnings
from typing import Any

import pydantic


def _import_serve():
    """`ray.serve` and its schema module, without Ray's pydantic deprecation noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from ray import serve
        from ray.serve import schema
    return serve, schema


class ServeConfigError(ValueError):
    """The config is invalid; `problems` lists every finding as "path: message"."""

    def __init__(self, problems: list[str]):
        super().__init__("invalid Serve config:\n  " + "\n  ".join(problems))
        self.problems = problems


def _model_types(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation can hold directly (through Optional/Union/Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_types(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        out: list[type[pydantic.BaseModel]] = []
        for arg in typing.get_args(annotation):
            out.extend(_model_types(arg))
        return out
    return []


def _item_annotation(annotation: Any) -> Any | None:
    """For List[X] / Optional[List[X]] / Tuple[X, ...]: X; otherwise None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _item_annotation(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(annotation):
            item = _item_annotation(arg)
            if item is not None:
                return item
        return None
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(annotation)
        return args[0] if args else None
    return None


def _fields_by_key(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        keys[name] = field.annotation
        if field.alias:
            keys[field.alias] = field.annotation
    return keys


def unknown_keys(data: Any, model: type[pydantic.BaseModel], path: str = "") -> list[str]:
    """Every key of `data` (recursively) that `model` does not define, as "path: message".

    A dict standing for a nested model is checked against that model, also where the field's
    type is a Union with `Dict` (Serve's `autoscaling_config`, `request_router_config`, ...);
    such dicts are also validated by the nested model, since Serve will do so at deploy time.
    """
    problems: list[str] = []
    if not isinstance(data, dict):
        return problems
    allows_extra = model.model_config.get("extra") == "allow"
    fields = _fields_by_key(model)
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            if not allows_extra:
                problems.append(f"{where}: unknown key for {model.__name__} "
                                f"(known: {', '.join(sorted(model.model_fields))})")
            continue
        annotation = fields[key]
        models = _model_types(annotation)
        if isinstance(value, dict) and models:
            sub = models[0]
            problems.extend(unknown_keys(value, sub, where))
            try:
                sub.model_validate(value)
            except pydantic.ValidationError as e:
                for err in e.errors():
                    loc = ".".join(str(p) for p in err["loc"])
                    problems.append(f"{where}.{loc}: {err['msg']}" if loc else f"{where}: {err['msg']}")
            continue
        item = _item_annotation(annotation)
        item_models = _model_types(item) if item is not None else []
        if isinstance(value, list) and item_models:
            for i, elem in enumerate(value):
                if isinstance(elem, dict):
                    problems.extend(unknown_keys(elem, item_models[0], f"{where}[{i}]"))
    return problems


def check_deployment_options(config: dict) -> list[str]:
    """Run Serve's `Deployment.options()` on each deployment's options (what `serve deploy`
    applies): catches e.g. an invalid `placement_group_strategy` or `ray_actor_options` that
    do not fit bundle 0 of `placement_group_bundles`."""
    serve, _ = _import_serve()
    problems: list[str] = []
    for a, app in enumerate(config.get("applications") or []):
        for d, dep in enumerate(app.get("deployments") or []):
            where = f"applications[{a}].deployments[{d}]"
            opts = {k: v for k, v in dep.items() if k != "name"}

            class _Probe:  # a stand-in class: options() does not look at it
                pass

            try:
                serve.deployment(name=dep.get("name", "probe"))(_Probe).options(**opts)
            except Exception as e:  # ValueError/TypeError from Serve's own checks
                problems.append(f"{where} ({dep.get('name')}): {type(e).__name__}: {e}")
    return problems


def validate_serve_config(config: dict, *, check_options: bool = True):
    """Validate a Serve config dict strictly; return the parsed `ServeDeploySchema`.

    Raises `ServeConfigError` listing every problem found.
    """
    ServeDeploySchema = _import_serve()[1].ServeDeploySchema
    if not isinstance(config, dict):
        raise ServeConfigError([f"top level: expected a mapping, got {type(config).__name__}"])
    problems: list[str] = []
    schema = None
    try:
        schema = ServeDeploySchema.model_validate(config)
    except pydantic.ValidationError as e:
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            problems.append(f"{loc}: {err['msg']}")
    problems.extend(unknown_keys(config, ServeDeploySchema))
    if check_options and not problems:
        problems.extend(check_deployment_options(config))
    if problems:
        raise ServeConfigError(problems)
    return schema
