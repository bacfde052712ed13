"""Rendering a model's chat template, which comes with the model file: code
from the internet, run with bounds on what it may cost.

What it owns: the Jinja2 environment ``transformers`` renders chat templates
in (immutable sandbox, ``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, ``tojson``, ``strftime_now``), and
:class:`ChatTemplate`, which renders a conversation within these bounds:

* output: :data:`MAX_TEMPLATE_OUTPUT` characters beyond the messages' own
  text, counted as the output streams out (``Template.generate``);
* time: :data:`MAX_TEMPLATE_SECONDS`, checked between output chunks, at
  every loop iteration, call, attribute or item lookup and operator, so a
  loop that writes nothing stops too;
* loops: :data:`MAX_TEMPLATE_ITERATIONS` iterations in all, which bounds what
  a ``{% set %}`` block can gather without writing, and ``range`` at most
  :data:`MAX_TEMPLATE_RANGE` items;
* single operations, checked BEFORE they allocate (a deadline cannot stop one
  C call): ``*``, ``+`` and ``%`` on strings and lists, ``**`` and ``*`` on
  integers (:data:`MAX_TEMPLATE_INT_BITS`), the string methods and filters
  that multiply their input (``replace``, ``join``, ``indent``,
  ``expandtabs``, format widths), and any integer argument above the output
  limit (``center(2**31)``, ``tojson(indent=10**9)``, ``slice(10**9)``).

Exceeding any bound raises :class:`TemplateTooCostly`; the caller turns it
into a :class:`~pmetal.pipeline.models.ModelFormatError` (the template is at
fault, not the messages). The sandbox itself is what blocks code execution;
these bounds are about memory and time.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplate", "TemplateRaised", "TemplateTooCostly"]

MAX_TEMPLATE_OUTPUT = 1 << 20
"""Most characters a chat template may write beyond the messages' own text,
and the longest string or list it may build (1 MiB). Real templates add a
few hundred characters of framing to the messages."""

MAX_TEMPLATE_SECONDS = 2.0
"""Longest a chat template may take to render. Real ones take well under a
millisecond."""

MAX_TEMPLATE_ITERATIONS = 1_000_000
"""Most loop iterations, over all loops, of one rendering. Real templates
loop once or twice over the messages."""

MAX_TEMPLATE_RANGE = 10_000
"""Most items a template's ``range()`` may have (jinja2's sandbox allows
100,000)."""

MAX_TEMPLATE_INT_BITS = 1 << 16
"""Largest integer, in bits, a template may compute with ``*`` or ``**``
(about 20,000 decimal digits)."""


class TemplateRaised(Exception):
    """``raise_exception()`` called by a chat template: the messages are wrong."""


class TemplateTooCostly(Exception):
    """A chat template went past one of this module's bounds."""


class _Budget:
    """What is left of one rendering's bounds."""

    def __init__(self, messages_size: int) -> None:
        self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS
        self.max_size = MAX_TEMPLATE_OUTPUT + messages_size
        self.iterations = MAX_TEMPLATE_ITERATIONS

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateTooCostly(f"it ran longer than {MAX_TEMPLATE_SECONDS} s")

    def size(self, size: int, what: str) -> None:
        if size > self.max_size:
            raise TemplateTooCostly(f"{what} would make {size:,} characters or items, more "
                                    f"than the limit of {self.max_size:,}")


# Set by ChatTemplate.render() for the rendering running in this thread (or task).
_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("pmetal_template_budget")


def _size(value: Any) -> int:
    """Characters (or items, and the characters of string items) in ``value``:
    what copying or repeating it costs, one level deep."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(item) for item in value if isinstance(item, str))
    return 0


def _text_size(value: Any, depth: int = 0) -> int:
    """Characters of the strings in a conversation (dicts and lists, 4 deep)."""
    if isinstance(value, str):
        return len(value)
    if depth < 4 and isinstance(value, Mapping):
        return sum(_text_size(v, depth + 1) for v in value.values())
    if depth < 4 and isinstance(value, (list, tuple)):
        return sum(_text_size(v, depth + 1) for v in value)
    return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A %-conversion's width and precision, and a str.format field's spec.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_NUMBER = re.compile(r"\d+")


def _check_format(budget: _Budget, fmt: str, args: Any, percent: bool) -> None:
    widths = 0
    if percent:
        for width, precision in _PERCENT_SPEC.findall(fmt):
            if "*" in (width, precision):
                raise TemplateTooCostly("a %-format takes its width from its arguments ('*')")
            widths += int(width or 0) + int(precision or 0)
    else:
        for field in re.findall(r"\{[^{}]*\}", fmt):
            widths += sum(int(n) for n in _FORMAT_NUMBER.findall(field.partition(":")[2]))
    budget.size(len(fmt) + _size(args) + widths, "a format")


def _check_product(budget: _Budget, left: Any, right: Any) -> None:
    if _is_int(left) and _is_int(right):
        if left.bit_length() + right.bit_length() > MAX_TEMPLATE_INT_BITS:
            raise TemplateTooCostly(f"a product of more than {MAX_TEMPLATE_INT_BITS} bits")
        return
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, (str, list, tuple)) and _is_int(count):
            budget.size(_size(sequence) * max(count, 0), "a repetition")


def _check_power(left: Any, right: Any) -> None:
    if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1 \
            and left.bit_length() * right > MAX_TEMPLATE_INT_BITS:
        raise TemplateTooCostly(f"{left} ** {right} has more than {MAX_TEMPLATE_INT_BITS} bits")


def _check_call(budget: _Budget, name: str, value: Any, args: tuple[Any, ...],
                kwargs: Mapping[str, Any], *, is_filter: bool) -> None:
    """Refuse a call of the string method or filter ``name`` on ``value``
    whose result would pass the bounds, before it runs."""
    for arg in (*args, *kwargs.values()):
        if _is_int(arg) and abs(arg) > budget.max_size:
            raise TemplateTooCostly(f"{name}() with an argument of {arg:,}, more than the "
                                    f"limit of {budget.max_size:,}")
    if name == "replace" and isinstance(value, str) and len(args) >= 2 \
            and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = value.count(old) if old else len(value) + 1
        if len(args) > 2 and _is_int(args[2]) and args[2] >= 0:
            count = min(count, args[2])
        budget.size(len(value) + count * max(0, len(new) - len(old)), "replace()")
    elif name == "join":
        # "sep".join(items), or the filter items|join(sep)
        sep, items = (args[0] if args else "", value) if is_filter \
            else (value, args[0] if args else None)
        if isinstance(sep, str) and isinstance(items, (list, tuple)):
            budget.size(_size(items) + len(sep) * len(items), "join()")
    elif name in ("indent", "expandtabs") and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", kwargs.get("tabsize", 4))
        width = len(width) if isinstance(width, str) else width if _is_int(width) else 0
        lines = value.count("\n") + 1 if name == "indent" else value.count("\t")
        budget.size(len(value) + lines * width, f"{name}()")
    elif name == "format" and isinstance(value, str):
        # the filter is %-formatting, the method str.format
        _check_format(budget, value, args, percent=is_filter)
    elif name == "format_map" and isinstance(value, str) and args:
        _check_format(budget, value, args[0], percent=False)


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # A filter marked pass_context/pass_eval_context/pass_environment gets that
    # first; functools.wraps keeps the mark, so jinja2 passes it to the wrapper.
    skip = 1 if hasattr(func, "jinja_pass_arg") else 0

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget.get()
        budget.tick()
        if len(args) > skip:
            _check_call(budget, name, args[skip], args[skip + 1:], kwargs, is_filter=True)
        return func(*args, **kwargs)

    return bounded


def _paced(iterable: Iterable[Any]) -> Iterator[Any]:
    """Every ``{% for %}`` loop iterates through this: the deadline and the
    iteration budget are checked per item."""
    budget = _budget.get()
    for item in iterable:
        budget.iterations -= 1
        if budget.iterations < 0:
            raise TemplateTooCostly(f"its loops ran more than {MAX_TEMPLATE_ITERATIONS:,} "
                                    "iterations")
        budget.tick()
        yield item


def _range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_TEMPLATE_RANGE:
        raise TemplateTooCostly(f"range() of {len(items):,} items, more than the limit of "
                                f"{MAX_TEMPLATE_RANGE:,}")
    return items


def _environment() -> Any:
    """The environment transformers renders chat templates in, with this
    module's bounds: sandboxed, immutable, trim_blocks and lstrip_blocks,
    with raise_exception, tojson (no ASCII escaping) and strftime_now."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget.get()
            budget.tick()
            if operator == "*":
                _check_product(budget, left, right)
            elif operator == "**":
                _check_power(left, right)
            elif operator == "+" and isinstance(left, (str, list, tuple)):
                budget.size(_size(left) + _size(right), "a concatenation")
            elif operator == "%" and isinstance(left, str):
                _check_format(budget, left, right, percent=True)
            return super().call_binop(context, operator, left, right)

        def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            budget = _budget.get()
            budget.tick()
            target = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped
            owner = getattr(target, "__self__", None)
            if isinstance(owner, str):
                _check_call(budget, getattr(target, "__name__", ""), owner, args, kwargs,
                            is_filter=False)
            elif target is not _range:  # which says more itself
                _check_call(budget, getattr(target, "__name__", "a call"), None, args, kwargs,
                            is_filter=False)
            return super().call(context, obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _budget.get().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _budget.get().tick()
            return super().getitem(obj, argument)

    def raise_exception(message: str) -> None:
        raise TemplateRaised(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: _bounded_filter(name, func) for name, func in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _range
    # lipsum(n=10**6, min=100, max=100) writes 600 MB in one call, with every
    # argument under the output limit; no chat template uses it.
    del env.globals["lipsum"]
    env.globals["_pmetal_paced"] = _paced
    return env


class ChatTemplate:
    """A chat template's source, compiled on first use with every
    ``{% for %}`` loop iterating through :func:`_paced`, so a loop that writes
    nothing still meets the deadline (streamed output is checked only when
    something is written)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._template: Any = None

    def _compile(self) -> Any:
        from jinja2 import nodes

        env = _environment()
        tree = env.parse(self.source)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name("_pmetal_paced", "load"), [loop.iter], [], None,
                                   None, lineno=loop.lineno)
        tree.set_environment(env)
        return env.from_string(tree)

    def render(self, messages: list[Any], **variables: Any) -> str:
        """The template rendered for ``messages`` within this module's
        bounds: :class:`TemplateTooCostly` past one, :class:`TemplateRaised`
        when the template refuses the messages, jinja2's and Python's own
        errors when it is broken."""
        if self._template is None:
            self._template = self._compile()
        budget = _Budget(_text_size(messages))
        token = _budget.set(budget)
        try:
            out: list[str] = []
            written = 0
            for chunk in self._template.generate(messages=messages, **variables):
                written += len(chunk)
                budget.size(written, "its output")
                budget.tick()
                out.append(chunk)
            return "".join(out)
        finally:
            _budget.reset(token)
