"""Tools a model calls by name: each has a JSON schema (what the prompt shows) and an async call.

    calculator   arithmetic on numbers: + - * / // % ** and parentheses (no names, no calls)
    python       runs the model's code in the sandbox (hpcrl/environments/sandbox.py) and returns
                 what it printed, or why it failed or was stopped

Your own: a class with `name`, `description`, `parameters` (JSON schema of the arguments) and
`async __call__(self, arguments) -> str`, named `module:Class` in the environment's `tools`.
Raise ToolError for a call that fails: the model reads the message, and it counts as a tool error.
ToolEnvironment runs each call in a thread of its own, on an event loop of its own (so a tool keeps
no loop-bound resource from one call to the next), and cuts it at the tool's `time_limit_s`.
"""
from __future__ import annotations

import ast
import asyncio
import functools
import math
import operator
from concurrent.futures import ThreadPoolExecutor

from hpcrl.importing import import_object


class ToolError(Exception):
    """The call failed; the message is what the model reads."""


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}
    time_limit_s: float = 30.0
    """seconds a call may take: then ToolEnvironment cuts it, and the model reads that it was stopped"""

    @classmethod
    def schema(cls) -> dict:
        """What the prompt shows of the tool (its class attributes: the driver shows it without making one)."""
        return {"type": "function", "function": {"name": cls.name, "description": cls.description,
                                                 "parameters": cls.parameters}}

    async def __call__(self, arguments: dict) -> str:
        raise NotImplementedError


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                  "required": ["expression"]}
    OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                 ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
                 ast.USub: operator.neg, ast.UAdd: operator.pos}
    # Bounds that keep every call to microseconds and every failure a ToolError: Python's parser and
    # this evaluator recurse (a long sum or deep unary minus ran out of stack), and integers grow
    # without limit (9**9**9 would take the process's memory and minutes, holding the GIL all along)
    MAX_LENGTH = 1000    # characters of an expression
    MAX_DEPTH = 100      # levels of its syntax tree: a number is 1, a sum of n terms n, -(-x) 2 more than x
    MAX_DIGITS = 1000    # of every integer it reaches; floats stay within their own range (about 1.8e308)
    _BOUND = 10 ** MAX_DIGITS

    async def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        return self.evaluate(expression)

    def evaluate(self, expression: str) -> str:
        """The expression's value as the model reads it; ToolError, saying why, for anything else."""
        if len(expression) > self.MAX_LENGTH:
            raise ToolError(f"the expression is {len(expression)} characters long; the calculator takes at most "
                            f"{self.MAX_LENGTH}")
        try:
            tree = ast.parse(expression.strip(), mode="eval").body
        except (SyntaxError, ValueError):    # ValueError: a null byte, on Python 3.10
            raise ToolError(f"not an arithmetic expression: {expression!r}") from None
        depth = _depth(tree)
        if depth > self.MAX_DEPTH:
            raise ToolError(f"the expression is {depth} levels deep (a sum of n terms is n levels); the calculator "
                            f"takes at most {self.MAX_DEPTH}")
        try:
            value = self._value(tree)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large for a floating-point number (at most about 1.8e308)") from None
        if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            value = int(value)
        return str(value) if not isinstance(value, float) else repr(round(value, 12))

    def _value(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in self.OPERATORS:
            return self.OPERATORS[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self.OPERATORS:
            left, right = self._value(node.left), self._value(node.right)
            if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0
                    and (abs(left).bit_length() - 1) * right >= self._BOUND.bit_length()):
                raise self._too_large()     # at least 2**(bits - 1) to that power: past the bound, so not computed
            return self._bounded(self.OPERATORS[type(node.op)](left, right))
        raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")

    def _bounded(self, value):
        """value, if it is a real number within the calculator's bounds."""
        if isinstance(value, complex):
            raise ToolError("the result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is too large for a floating-point number (at most about 1.8e308)")
        if isinstance(value, int) and abs(value) >= self._BOUND:
            raise self._too_large()
        return value

    def _too_large(self) -> ToolError:
        return ToolError(f"the result is too large: the calculator works with integers of at most {self.MAX_DIGITS} digits")


def _depth(tree: ast.AST) -> int:
    """How many levels of expressions tree has (a number: 1), counted without recursion."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack += [(child, depth + 1) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)]
    return deepest


class Python(Tool):
    name = "python"
    description = "Run Python code in a sandbox (no network, no files kept) and return what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "a Python program; "
                                                            "print the results you want to see"}},
                  "required": ["code"]}

    def __init__(self, **limits):
        box = _sandbox()
        self.run, self.limits = box.run_python, box.Limits(**limits)
        # the sandbox kills the code at wall_s (SIGKILL, its whole pid namespace); the environment's
        # limit is the backstop past that kill
        self.time_limit_s = self.limits.wall_s + 10.0

    async def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<program>"}')
        try:
            run = await asyncio.get_running_loop().run_in_executor(_SANDBOXES, self.run, code, self.limits)
        except OSError as e:     # no sandbox could start (out of processes, memory, descriptors): this call failed
            raise ToolError(f"the sandbox could not start: {e}") from None
        if run.outcome != "ok":
            raise ToolError(run.summary())
        return run.summary()


# the sandboxes of every call of the process at once: at most min(32, CPUs + 4), as many as one event
# loop's own executor runs (each call runs on a loop of its own, whose executor would not bound them)
_SANDBOXES = ThreadPoolExecutor(thread_name_prefix="hpcrl-sandbox")


@functools.cache
def _sandbox():
    """The sandbox module, checked once per process (an environment without the python tool needs none)."""
    from hpcrl.environments import sandbox

    sandbox.check_sandbox()
    return sandbox


BUILTIN = {"calculator": Calculator, "python": Python}


def tool_class(spec: str | dict) -> tuple[type[Tool], dict]:
    """A tool of the environment's `tools` list -> (its class, its keyword arguments). `spec`: a
    built-in name, `module:Class`, or a mapping {name or module:Class: its keyword arguments}
    (e.g. {python: {wall_s: 5}})."""
    (name, kwargs), = spec.items() if isinstance(spec, dict) else [(spec, {})]
    cls = import_object(name) if ":" in name else BUILTIN.get(name)
    if cls is None:
        raise ValueError(f"tool {name!r}: not a built-in tool ({', '.join(BUILTIN)}) nor module:Class")
    return cls, dict(kwargs or {})
