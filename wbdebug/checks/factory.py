"""``--factory package.module:function``: how ``wbdebug check`` gets the user's model, loss, optimizer and data."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn


@dataclass
class CheckSetup:
    """What a factory returns (this dataclass, or a dict with the same keys).

    Attributes:
        model: the freshly initialised ``nn.Module``.
        criterion: the loss, called as ``criterion(model(inputs), targets)``.
        optimizer: the optimizer over ``model.parameters()``.
        train: the training DataLoader (or Dataset, iterable of ``(inputs, targets)`` batches, ``(X, y)`` pair).
        val: the validation split in any of the same forms, or None.
        num_classes: C for classification, or None to infer it.
    """

    model: nn.Module
    criterion: Callable
    optimizer: torch.optim.Optimizer
    train: Any
    val: Any = None
    num_classes: int | None = None


REQUIRED = ("model", "criterion", "optimizer", "train")
EXPECTED_SHAPE = (
    "a wbdebug.CheckSetup, or a dict with keys model, criterion, optimizer, train (and optional val, num_classes)"
)


def as_setup(value: Any, where: str) -> CheckSetup:
    """Validate a factory's return value: a :class:`CheckSetup` or a dict of its fields."""
    if isinstance(value, CheckSetup):
        setup = value
    elif isinstance(value, Mapping):
        missing = [k for k in REQUIRED if k not in value]
        unknown = sorted(set(value) - {f.name for f in fields(CheckSetup)})
        if missing or unknown:
            problem = f"missing {missing}" if missing else f"unknown keys {unknown}"
            raise ValueError(f"{where} returned a dict with {problem}; expected {EXPECTED_SHAPE}")
        setup = CheckSetup(**value)
    else:
        raise ValueError(f"{where} returned a {type(value).__name__}; expected {EXPECTED_SHAPE}")
    if not isinstance(setup.model, nn.Module):
        raise ValueError(f"{where} returned model={type(setup.model).__name__}; expected a torch.nn.Module")
    if not callable(setup.criterion):
        raise ValueError(f"{where} returned criterion={type(setup.criterion).__name__}; expected a loss such as nn.CrossEntropyLoss()")
    if not isinstance(setup.optimizer, torch.optim.Optimizer):
        raise ValueError(f"{where} returned optimizer={type(setup.optimizer).__name__}; expected a torch.optim.Optimizer")
    if setup.train is None:
        raise ValueError(f"{where} returned train=None; expected a DataLoader or iterable of (inputs, targets) batches")
    nc = setup.num_classes
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, int) or nc < 2):
        raise ValueError(f"{where} returned num_classes={nc!r}; expected an int >= 2 or None")
    return setup


def load_factory(spec: str) -> Callable[..., Any]:
    """The function named by ``package.module:function``, imported with the working directory on the path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--factory must look like package.module:function, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: a factory next to the user's code imports
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"cannot import {module_name!r} for --factory {spec}: {type(exc).__name__}: {exc}; expected an "
            "importable module (run from the directory that contains it, or install it)"
        ) from exc
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"module {module_name} has no attribute {attr!r}; expected a function returning {EXPECTED_SHAPE}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{spec} is a {type(fn).__name__}, not a function; expected a function returning {EXPECTED_SHAPE}")
    return fn


def parse_params(pairs: list[str]) -> dict[str, str]:
    """``["lr=0.01", "--seed=1", "--bug", "softmax"]`` -> ``{"lr": "0.01", "seed": "1", "bug": "softmax"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(pairs):
        item = pairs[i]
        key, sep, value = item.removeprefix("--").partition("=")
        if not sep:
            if item.startswith("--") and i + 1 < len(pairs) and not pairs[i + 1].startswith("--"):
                value = pairs[i + 1]
                i += 1
            else:
                raise ValueError(f"parameter {item!r} has no value; expected key=value (or --key=value)")
        key = key.replace("-", "_")
        if not key.isidentifier():
            raise ValueError(f"parameter name {key!r} is not a Python identifier; expected key=value")
        out[key] = value
        i += 1
    return out


def bind_params(fn: Callable[..., Any], raw: dict[str, str], where: str) -> dict[str, Any]:
    """Convert ``raw`` strings to the factory's annotated types and check it accepts every name."""
    sig = inspect.signature(fn)
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    names = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names and not accepts_any:
            raise ValueError(f"{where} has no parameter {key!r}; it accepts: {', '.join(names) or 'none'}")
        try:
            out[key] = convert(value, hints.get(key, inspect.Parameter.empty))
        except ValueError as exc:
            raise ValueError(f"parameter {key}={value!r} for {where}: {exc}") from None
    try:
        sig.bind(**out)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}; pass the missing ones with --param key=value") from None
    return out


def convert(value: str, annotation: Any) -> Any:
    """A command-line string as the annotated type (bool, int, float, str, Literal, Optional); unannotated
    values are read as Python literals when they parse (``0.01``, ``True``), else kept as strings."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value.lower() in ("none", "null") and len(options) < len(typing.get_args(annotation)):
            return None
        errors = []
        for option in options:
            try:
                return convert(value, option)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is typing.Literal:
        for choice in typing.get_args(annotation):
            if str(choice) == value:
                return choice
        raise ValueError(f"expected one of {list(typing.get_args(annotation))}")
    if annotation is bool:
        lowered = value.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ValueError("expected a boolean (true/false)")
    if annotation in (int, float, str):
        try:
            return annotation(value)
        except ValueError:
            raise ValueError(f"expected {annotation.__name__}") from None
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def build_setup(spec: str, raw: dict[str, str]) -> tuple[CheckSetup, dict[str, Any]]:
    """Import the factory, call it with the converted params, and validate what it returns.

    Returns:
        The :class:`CheckSetup` and the converted parameters it was built with.
    """
    fn = load_factory(spec)
    params = bind_params(fn, raw, f"factory {spec}")
    try:
        value = fn(**params)
    except Exception as exc:
        raise ValueError(f"factory {spec} raised {type(exc).__name__}: {exc}") from exc
    return as_setup(value, f"factory {spec}"), params
