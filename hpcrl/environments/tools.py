"""Tools a model calls by name: each has a JSON schema (what the prompt shows) and an async call.

    calculator   arithmetic on numbers: + - * / // % ** and parentheses (no names, no calls)
    python       runs the model's code in the sandbox (hpcrl/environments/sandbox.py) and returns
                 what it printed, or why it failed or was stopped

Your own: a class with `name`, `description`, `parameters` (JSON schema of the arguments) and
`async __call__(self, arguments) -> str`, named `module:Class` in the environment's `tools`.
Raise ToolError for a call that fails: the model reads the message, and it counts as a tool error.
"""
from __future__ import annotations

import ast
import asyncio
import functools
import math
import operator

from hpcrl.importing import import_object


class ToolError(Exception):
    """The call failed; the message is what the model reads."""


class Tool:
    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}}

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
    MAX_EXPONENT = 1000        # 9**9**9 would take the process's memory

    async def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        return self.evaluate(expression)

    def evaluate(self, expression: str) -> str:
        try:
            value = self._value(ast.parse(expression.strip(), mode="eval").body)
        except SyntaxError:
            raise ToolError(f"not an arithmetic expression: {expression!r}") from None
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            value = int(value)
        return str(value) if not isinstance(value, float) else repr(round(value, 12))

    def _value(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in self.OPERATORS:
            return self.OPERATORS[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self.OPERATORS:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.MAX_EXPONENT:
                raise ToolError(f"exponent {right} is too large (at most {self.MAX_EXPONENT})")
            value = self.OPERATORS[type(node.op)](left, right)
            if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
                raise ToolError("the result is not a finite real number")
            return value
        raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


class Python(Tool):
    name = "python"
    description = "Run Python code in a sandbox (no network, no files kept) and return what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "a Python program; "
                                                            "print the results you want to see"}},
                  "required": ["code"]}

    def __init__(self, **limits):
        box = _sandbox()
        self.run, self.limits = box.run_python, box.Limits(**limits)

    async def __call__(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<program>"}')
        run = await asyncio.to_thread(self.run, code, self.limits)
        if run.outcome != "ok":
            raise ToolError(run.summary())
        return run.summary()


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
